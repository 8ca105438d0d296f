"""Estimate the attention of the tokens a sparse decode step leaves out (the *tail*).

A query-aware policy attends ``budget`` tokens exactly and drops the rest; when the rest still
holds a sizeable share of the softmax mass (a diffuse head at long context), the renormalised
output over the budget drifts from the dense one. RetroInfer (Chen et al., "RetroInfer: A
Vector-Storage Approach for Scalable Long-Context LLM Inference", arXiv 2505.02922) splits
tokens into an exactly attended zone and an *estimation zone* whose contribution it
approximates from cluster centroids. Here the clusters are contiguous chunks of
``chunk_size`` tokens, summarised by running fp32 sums of their keys and values:

for chunk ``c`` with ``n_c`` tokens not attended exactly, mean key ``k_c`` and mean value
``v_c`` (of those tokens only), the chunk stands for ``n_c`` tokens of score ``q . k_c``::

    out_tail = sum_c w_c v_c,  w_c = softmax_c(scale * q . k_c + log n_c),
    lse_tail = logsumexp_c(scale * q . k_c + log n_c)

and `merge_states` combines ``(out_tail, lse_tail)`` with the exact part. The means exclude
the attended tokens by subtracting their keys / values from the chunk sums (O(budget) work,
no pass over the cache), so no token is counted twice. ``exp`` of a mean key under-estimates
the mean of ``exp`` (Jensen), so the tail is weighted conservatively; with ``chunk_size = 1``
the estimate is exact and the merged step equals dense attention.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .backend import BACKENDS, sparse_decode_backend
from .checks import check_decode_inputs
from .decode import native_decode
from .index import SparseIndex
from .merge import merge_states
from .triton_decode import triton_sparse_decode
from .torch_decode import selected_positions  # noqa: F401  (importable from here, as before)
from .torch_tail import _check, _chunk_attention, _estimate, _positions  # noqa: F401


def chunk_attention(q: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, count: torch.Tensor, *,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of decode queries over chunk summaries alone: chunk ``c`` stands for ``count[c]``
    tokens of key ``k_mean[c]`` and value ``v_mean[c]`` (the estimate `tail_estimate` makes, for
    chunks whose tokens are none of them attended exactly -- e.g. tokens a sinks + window layer
    evicted). Merge with the exact part by `merge_states`.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)``.
    k_mean, v_mean : torch.Tensor
        ``(B, H_kv, N, D)``.
    count : torch.Tensor
        ``(B, N)`` or ``(B, H_kv, N)``: tokens per chunk; 0 = an empty chunk (stands for nothing).

    Returns
    -------
    out, lse : torch.Tensor
        fp32 ``(B, H_q, D)`` / ``(B, H_q)``; ``lse`` is ``-inf`` where every chunk is empty.
    """
    B, H, N, D = k_mean.shape
    if q.dim() != 3 or q.shape[0] != B or q.shape[1] % H or q.shape[2] != D or v_mean.shape != k_mean.shape:
        raise ValueError(f"chunk_attention needs q (B, H_q, D) and k_mean / v_mean (B, H_kv, N, D), got q "
                         f"{tuple(q.shape)}, k_mean {tuple(k_mean.shape)}, v_mean {tuple(v_mean.shape)}")
    if count.dim() == 2 and tuple(count.shape) == (B, N):
        count = count[:, None, :].expand(B, H, N)
    if tuple(count.shape) != (B, H, N):
        raise ValueError(f"count must have shape (B, N) or (B, H_kv, N) = {(B, H, N)}, got {tuple(count.shape)}")
    return _chunk_attention(q, k_mean.float(), v_mean.float(), count.float(), float(scale))


def tail_estimate(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex,
                  k_sum: torch.Tensor, v_sum: torch.Tensor, count: torch.Tensor, *, chunk_size: int,
                  scale: float, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-mean estimate of the attention over the tokens ``index`` does not attend.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)`` decode queries.
    k_cache, v_cache : torch.Tensor
        ``(B, H_kv, T_cap, D)``: the attended tokens' keys / values are read from here (only those).
    index : SparseIndex
        The exactly attended tokens (sinks, dense tail, selected blocks).
    k_sum, v_sum : torch.Tensor
        fp32 ``(B, H_kv, N, D)``: sums of the keys / values of chunk ``c`` = tokens
        ``[seq_start + c * chunk_size, seq_start + (c + 1) * chunk_size)`` of each row (chunks
        counted from the row's first real token, so left padding does not shift them), up to
        ``seq_len``.
    count : torch.Tensor
        fp32 ``(B, N)``: real tokens summed into each chunk.
    chunk_size, scale : int, float
    seq_len : int, optional
        Tokens in every row (the caller's count, so no device read): lets the unpadded token
        index of the decode hot path skip the general slot table.

    Returns
    -------
    out : torch.Tensor
        fp32 ``(B, H_q, D)``, the estimated attention output over the unattended tokens.
    lse : torch.Tensor
        fp32 ``(B, H_q)``, its estimated log-sum-exp; ``-inf`` when nothing is left out.
    """
    _check(q, k_sum, v_sum, count)
    return _estimate(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size, scale, seq_len, with_exact=False)


def sparse_decode_tail(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex,
                       k_sum: torch.Tensor, v_sum: torch.Tensor, count: torch.Tensor, *, chunk_size: int,
                       scale: float | None = None, seq_len: int | None = None, backend: str = "auto",
                       validate_index: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_decode` over ``index`` merged with the `tail_estimate` of the tokens it leaves out.

    Equals ``merge_states(sparse_decode(...), tail_estimate(...))`` (tested against that and
    against the brute-force references), in one pass on the torch backend: the attended K / V
    rows are gathered once and serve both the exact attention and the subtraction of the
    attended tokens from their chunks, and one softmax runs over the attended tokens' scores
    and the chunk summaries together. On CPU that is ~3x fewer torch calls than the three
    functions in turn. The native backend (fp32 CPU; ``"auto"`` picks it when it is built) does the
    same math in one compiled call (`kvpress.kernels.native`; an index that is not clean runs the
    torch path inside its op). The triton backend (CUDA) runs `sparse_decode`'s kernel and then
    the estimate and the merge in torch (`kvpress.kernels.backend.sparse_decode_backend` decides).

    Arguments as `sparse_decode` and `tail_estimate`. Returns ``out`` ``(B, H_q, D)`` in q's
    dtype and fp32 ``lse`` ``(B, H_q)`` of everything (attended and estimated).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check(q, k_sum, v_sum, count)
    check_decode_inputs(q, k_cache, v_cache, index, None, validate_index and not torch.compiler.is_compiling())
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    choice = sparse_decode_backend(q, k_cache, v_cache, index.block_idx, backend, tail=(k_sum, v_sum, count))
    if choice == "native":
        done = native_decode(q, k_cache, v_cache, index, scale, None, required=backend == "native",
                             tail=(k_sum, v_sum, count), chunk_size=chunk_size)
        if done is not None:
            return done
    if choice == "triton":
        out, lse = triton_sparse_decode(q, k_cache, v_cache, index, scale=scale, validate_index=False)
        t_out, t_lse = tail_estimate(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size=chunk_size,
                                     scale=scale, seq_len=seq_len)
        return merge_states(out, lse, t_out.to(out.dtype), t_lse)
    out, lse = _estimate(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size, scale, seq_len, with_exact=True)
    return out.to(q.dtype), lse


def reference_tail_estimate(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex,
                            *, chunk_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute-force `tail_estimate`: chunk means taken directly over every unattended real token."""
    B, H, T, D = k_cache.shape
    attended = index.token_mask(T)  # (B, H_kv, T)
    pos = torch.arange(T, device=q.device)[None, :]
    starts = torch.zeros(B, dtype=torch.long, device=q.device) if index.seq_starts is None else index.seq_starts.long()
    real = (pos >= starts[:, None]) & (pos < index.seq_lens.long()[:, None])  # (B, T)
    rest = (real[:, None, :] & ~attended).float()  # (B, H_kv, T)
    N = -(-T // chunk_size)
    chunk = ((pos - starts[:, None]).clamp(min=0) // chunk_size)  # (B, T), counted from each row's start
    one_hot = torch.nn.functional.one_hot(chunk, N).float()[:, None] * rest[..., None]  # (B, H_kv, T, N)
    n = one_hot.sum(2)  # (B, H_kv, N)

    def means(x):
        return (one_hot.transpose(-1, -2) @ x.float()) / n.clamp(min=1)[..., None]  # (B, H_kv, N, D)

    return _chunk_attention(q, means(k_cache), means(v_cache), n, scale)


def landmark_tail_estimate(q: torch.Tensor, landmarks: torch.Tensor, keep: torch.Tensor, v_sum: torch.Tensor, *,
                           chunk_size: int, group: int, scale: float,
                           offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tail estimate from chunk landmarks (ShadowKV's ``tail_chunk``): one mean key / value per group.

    The kept chunks (``keep[b, h, c]``, ``chunk_size`` real tokens each) fall into groups
    ``g = (c + offset) // group`` (``offset`` lets groups align with the end of a prompt, as
    ShadowKV's chunks do, so a left-padded row groups its chunks as when run alone). Group ``g``
    stands for its kept tokens: ``n_g = chunk_size * (kept chunks)`` tokens of key the mean of
    their landmarks (= the mean of their keys) and value ``v_sum[g] / n_g`` — the estimate of
    `tail_estimate` over ``group * chunk_size``-token chunks, with keys taken from the landmarks
    already on the device instead of running key sums.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)`` decode queries.
    landmarks : torch.Tensor
        ``(B, H_kv, C, D)`` mean post-RoPE key of each chunk.
    keep : torch.Tensor
        bool ``(B, H_kv, C)``: the chunks the estimate stands for (not attended exactly); or float
        weights in [0, 1], the share of each chunk's tokens it stands for (``select="tokens"``):
        a group's key is then the weighted mean of its landmarks, and it stands for
        ``chunk_size * sum(weights)`` tokens.
    v_sum : torch.Tensor
        fp32 ``(B, H_kv, N, D)``, ``N = ceil((C + offset) / group)``: value sums of each group's kept chunks.

    Returns
    -------
    out, lse : torch.Tensor
        fp32 ``(B, H_q, D)`` / ``(B, H_q)``, as `tail_estimate` (``lse`` is ``-inf`` when no chunk is kept).
    """
    B, H, C, D = landmarks.shape
    N = v_sum.shape[2]
    if q.dim() != 3 or q.shape[1] % H or q.shape[2] != D or tuple(keep.shape) != (B, H, C):
        raise ValueError(f"q {tuple(q.shape)}, landmarks {tuple(landmarks.shape)} and keep {tuple(keep.shape)} "
                         "must be (B, H_q, D), (B, H_kv, C, D) and (B, H_kv, C)")
    if not 0 <= offset < group:
        raise ValueError(f"offset={offset} must be in [0, group={group})")
    if N != -(-(C + offset) // group) or tuple(v_sum.shape) != (B, H, N, D):
        raise ValueError(f"v_sum {tuple(v_sum.shape)} must hold ceil((C + offset) / group) = "
                         f"{-(-(C + offset) // group)} groups of {H} KV heads")
    pad = (offset, N * group - C - offset)
    kept = F.pad(keep.float(), pad).view(B, H, N, group).sum(-1)  # (B, H_kv, N) kept chunks per group
    k_sum = F.pad(landmarks.float() * keep[..., None], (0, 0) + pad).view(B, H, N, group, D).sum(3)
    # a group keeps its mean key however little of it is left (with ``select="tokens"`` a chunk counts
    # for the fraction of its tokens not attended, so ``kept`` can be under 1): divide by ``kept``
    k_mean = k_sum / torch.where(kept > 0, kept, torch.ones_like(kept))[..., None]
    n = kept * chunk_size
    return _chunk_attention(q, k_mean, v_sum.float() / n.clamp(min=1)[..., None], n, scale)


def reference_landmark_tail_estimate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                                     chunk_size: int, group: int, scale: float,
                                     offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`landmark_tail_estimate` from the tokens: ``k`` / ``v`` ``(B, H_kv, C * chunk_size, D)``, means taken here."""
    B, H, C = keep.shape
    tok_group = (torch.arange(C * chunk_size, device=k.device) // chunk_size + offset) // group
    N = -(-(C + offset) // group)
    one_hot = F.one_hot(tok_group, N).float()[None, None] * keep.repeat_interleave(chunk_size, -1)[..., None]
    n = one_hot.sum(2)  # (B, H, N) kept tokens per group

    def means(x):
        return (one_hot.transpose(-1, -2) @ x.float()) / n.clamp(min=1)[..., None]

    return _chunk_attention(q, means(k), means(v), n, scale)
