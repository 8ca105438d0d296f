"""Block / token scores that feed `select_topk`, one per query-aware policy.

Every function takes the decode query ``q (B, H_q, D)`` and returns scores per KV head,
``(B, H_kv, N)``, reduced over the GQA group by `reduce_over_group`.

GQA reduction (default ``"softmax_max"``): each query head's scores go through a softmax over
the N candidates, then the group takes the max. The softmax puts heads on one scale (raw
logits of heads with large query norms would otherwise win every max); the max keeps a block
that *any* head of the group attends to strongly, because the group shares one selection and
a mean would dilute a single retrieval head's sharp peak among its neighbours' flat ones.
Since the softmax is monotone per head, G = 1 ranks exactly as the raw scores do.
"""
from __future__ import annotations

import math

import torch

REDUCTIONS = ("softmax_max", "softmax_mean", "max", "mean")


def _group(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``(B, H_q, D)`` -> fp32 ``(B, H_kv, G, D)`` (HF repeat_kv order: head h -> KV head h // G)."""
    if q.dim() != 3:
        raise ValueError(f"q must have shape (B, H_q, D), got {tuple(q.shape)}")
    B, H_q, D = q.shape
    if num_kv_heads < 1 or H_q % num_kv_heads:
        raise ValueError(f"H_q ({H_q}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return q.float().reshape(B, num_kv_heads, H_q // num_kv_heads, D)  # (B, H_kv, G, D)


def _check_kv(name: str, t: torch.Tensor, q: torch.Tensor, last: int | None) -> None:
    if t.dim() != 4 or t.shape[0] != q.shape[0] or (last is not None and t.shape[-1] != last):
        want = "(B, H_kv, N, D)" if last == q.shape[-1] else "(B, H_kv, N, r)"
        raise ValueError(f"{name} must have shape {want} matching q {tuple(q.shape)}, got {tuple(t.shape)}")


def reduce_over_group(scores: torch.Tensor, num_kv_heads: int, *, reduction: str = "softmax_max",
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-query-head scores to per-KV-head scores.

    Parameters
    ----------
    scores : torch.Tensor
        ``(B, H_q, N)``, already multiplied by the attention scale.
    num_kv_heads : int
        H_kv; query head ``h`` belongs to group ``h // (H_q // H_kv)``.
    reduction : {"softmax_max", "softmax_mean", "max", "mean"}
        See the module docstring for why ``"softmax_max"`` is the default. ``"softmax_mean"``
        ranks by the group's total attention probability (the mass a selection keeps).
    mask : torch.Tensor, optional
        bool ``(B, N)``; False candidates get -inf (kept out of the softmax normaliser).

    Returns
    -------
    torch.Tensor
        fp32 ``(B, H_kv, N)``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    B, H_q, N = scores.shape
    s = scores.float()
    if mask is not None:
        if tuple(mask.shape) != (B, N):
            raise ValueError(f"mask must have shape (B, N) = {(B, N)}, got {tuple(mask.shape)}")
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
    s = s.reshape(B, num_kv_heads, H_q // num_kv_heads, N)  # (B, H_kv, G, N)
    if reduction in ("softmax_max", "softmax_mean"):
        s = torch.softmax(s, dim=-1).nan_to_num(0.0)  # an all-masked row gives NaN -> 0
        s = s.amax(dim=2) if reduction == "softmax_max" else s.mean(dim=2)
        return s if mask is None else s.masked_fill(~mask[:, None, :], float("-inf"))
    return s.amax(dim=2) if reduction == "max" else s.mean(dim=2)


def pool_blocks(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """Max-pool token scores ``(B, H_kv, T)`` into block scores ``(B, H_kv, ceil(T / block_size))``."""
    B, H, T = scores.shape
    n = -(-T // block_size)
    padded = torch.nn.functional.pad(scores, (0, n * block_size - T), value=float("-inf"))
    return padded.reshape(B, H, n, block_size).amax(dim=-1)  # (B, H_kv, n_blocks)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def quest_scores(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, *,
                 scale: float | None = None, reduction: str = "softmax_max",
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Quest page upper bound ``sum_d max(q_d * min_d, q_d * max_d)`` (Tang et al., 2024).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``.
    page_min, page_max : torch.Tensor
        ``(B, H_kv, P, D)`` per-page elementwise key min / max (see `page_min_max`).

    Returns
    -------
    torch.Tensor
        fp32 ``(B, H_kv, P)``.
    """
    _check_kv("page_min", page_min, q, q.shape[-1])
    if page_max.shape != page_min.shape:
        raise ValueError(f"page_max shape {tuple(page_max.shape)} != page_min shape {tuple(page_min.shape)}")
    B, H_kv, P, _ = page_min.shape
    qg = _group(q, H_kv) * _scale(q, scale)  # (B, H_kv, G, D)
    # max(q*mn, q*mx) picks mx where q > 0 and mn where q < 0: two matmuls, no (G, P, D) temporary
    s = qg.clamp(min=0) @ page_max.float().transpose(-1, -2) + qg.clamp(max=0) @ page_min.float().transpose(-1, -2)
    return reduce_over_group(s.reshape(B, -1, P), H_kv, reduction=reduction, mask=mask)  # s: (B, H_kv, G, P)


def page_min_max(k_cache: torch.Tensor, page_size: int, *, seq_lens: torch.Tensor | None = None,
                 seq_starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page key min and max, ``(B, H_kv, ceil(T / page_size), D)`` each, for `quest_scores`.

    Tokens outside ``[seq_start, seq_len)`` are ignored; a page without valid tokens gets zeros.
    """
    B, H, T, D = k_cache.shape
    P = -(-T // page_size)
    pos = torch.arange(P * page_size, device=k_cache.device)
    lens = torch.full((B,), T, device=k_cache.device) if seq_lens is None else seq_lens.long()
    starts = torch.zeros_like(lens) if seq_starts is None else seq_starts.long()
    valid = (pos[None, :] >= starts[:, None]) & (pos[None, :] < lens[:, None])  # (B, P*page)
    k = torch.nn.functional.pad(k_cache.float(), (0, 0, 0, P * page_size - T))  # (B, H, P*page, D)
    v = valid[:, None, :, None]
    mn = k.masked_fill(~v, float("inf")).reshape(B, H, P, page_size, D).amin(dim=3)  # (B, H, P, D)
    mx = k.masked_fill(~v, float("-inf")).reshape(B, H, P, page_size, D).amax(dim=3)
    empty = ~valid.reshape(B, P, page_size).any(-1)[:, None, :, None]  # (B, 1, P, 1)
    return mn.masked_fill(empty, 0.0).to(k_cache.dtype), mx.masked_fill(empty, 0.0).to(k_cache.dtype)


def label_scores(q: torch.Tensor, labels: torch.Tensor, channels: torch.Tensor, *, block_size: int = 1,
                 scale: float | None = None, reduction: str = "softmax_max",
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Double Sparsity approximate scores from r outlier channels (Yang et al., 2024).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``.
    labels : torch.Tensor
        ``(B, H_kv, T, r)`` label cache: ``k_cache[..., channels[h]]`` per KV head.
    channels : torch.Tensor
        int ``(H_kv, r)`` calibrated channel ids per KV head, in ``[0, D)``.
    block_size : int
        1 for token scores; otherwise max-pooled into blocks (`pool_blocks`).
    mask : torch.Tensor, optional
        bool ``(B, T)`` of selectable tokens.

    Returns
    -------
    torch.Tensor
        fp32 ``(B, H_kv, ceil(T / block_size))``.
    """
    B, H_q, D = q.shape
    _check_kv("labels", labels, q, None)
    H_kv, T, r = labels.shape[1], labels.shape[2], labels.shape[3]
    if tuple(channels.shape) != (H_kv, r):
        raise ValueError(f"channels must have shape (H_kv, r) = {(H_kv, r)}, got {tuple(channels.shape)}")
    if channels.numel() and (channels.min() < 0 or channels.max() >= D):
        raise ValueError(f"channels must lie in [0, {D})")
    qg = _group(q, H_kv) * _scale(q, scale)  # (B, H_kv, G, D)
    G = qg.shape[2]
    idx = channels.long().to(q.device)[None, :, None, :].expand(B, H_kv, G, r)
    q_sel = qg.gather(-1, idx)  # (B, H_kv, G, r)
    s = q_sel @ labels.float().transpose(-1, -2)  # (B, H_kv, G, T)
    s = reduce_over_group(s.reshape(B, H_q, T), H_kv, reduction=reduction, mask=mask)
    return s if block_size == 1 else pool_blocks(s, block_size)


def build_labels(k_cache: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Label cache ``(B, H_kv, T, r)`` = the keys' calibrated channels (for `label_scores`)."""
    B, H, T, D = k_cache.shape
    if channels.dim() != 2 or channels.shape[0] != H:
        raise ValueError(f"channels must have shape (H_kv={H}, r), got {tuple(channels.shape)}")
    idx = channels.long().to(k_cache.device)[None, :, None, :].expand(B, H, T, channels.shape[1])
    return k_cache.gather(-1, idx)


def landmark_scores(q: torch.Tensor, landmarks: torch.Tensor, *, scale: float | None = None,
                    reduction: str = "softmax_max", mask: torch.Tensor | None = None) -> torch.Tensor:
    """ShadowKV chunk scores ``q . landmark`` (Sun et al., 2024).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``.
    landmarks : torch.Tensor
        ``(B, H_kv, C, D)`` per-chunk mean of post-RoPE keys (see `chunk_landmarks`).

    Returns
    -------
    torch.Tensor
        fp32 ``(B, H_kv, C)``.
    """
    _check_kv("landmarks", landmarks, q, q.shape[-1])
    B, H_kv, C, _ = landmarks.shape
    s = (_group(q, H_kv) * _scale(q, scale)) @ landmarks.float().transpose(-1, -2)  # (B, H_kv, G, C)
    return reduce_over_group(s.reshape(B, -1, C), H_kv, reduction=reduction, mask=mask)


def chunk_landmarks(k_cache: torch.Tensor, chunk_size: int, *, seq_lens: torch.Tensor | None = None,
                    seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Mean key of each chunk over its valid tokens, ``(B, H_kv, ceil(T / chunk_size), D)``; zeros if none."""
    B, H, T, D = k_cache.shape
    C = -(-T // chunk_size)
    pos = torch.arange(C * chunk_size, device=k_cache.device)
    lens = torch.full((B,), T, device=k_cache.device) if seq_lens is None else seq_lens.long()
    starts = torch.zeros_like(lens) if seq_starts is None else seq_starts.long()
    valid = ((pos[None, :] >= starts[:, None]) & (pos[None, :] < lens[:, None])).float()  # (B, C*chunk)
    k = torch.nn.functional.pad(k_cache.float(), (0, 0, 0, C * chunk_size - T))  # (B, H, C*chunk, D)
    total = (k * valid[:, None, :, None]).reshape(B, H, C, chunk_size, D).sum(3)  # (B, H, C, D)
    count = valid.reshape(B, 1, C, chunk_size, 1).sum(3)  # (B, 1, C, 1)
    return (total / count.clamp(min=1)).to(k_cache.dtype)


def exact_scores(q: torch.Tensor, k_cache: torch.Tensor, *, block_size: int = 1, scale: float | None = None,
                 reduction: str = "softmax_max", mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact ``q . k`` scores, as TidalDecode's selection layers compute them (Yang et al., 2024).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``.
    k_cache : torch.Tensor
        ``(B, H_kv, T, D)``.
    block_size : int
        1 for token scores; otherwise max-pooled into blocks.
    mask : torch.Tensor, optional
        bool ``(B, T)`` of selectable tokens (e.g. ``[seq_start, seq_len)``).

    Returns
    -------
    torch.Tensor
        fp32 ``(B, H_kv, ceil(T / block_size))``.
    """
    _check_kv("k_cache", k_cache, q, q.shape[-1])
    B, H_kv, T, _ = k_cache.shape
    s = (_group(q, H_kv) * _scale(q, scale)) @ k_cache.float().transpose(-1, -2)  # (B, H_kv, G, T)
    s = reduce_over_group(s.reshape(B, -1, T), H_kv, reduction=reduction, mask=mask)
    return s if block_size == 1 else pool_blocks(s, block_size)
