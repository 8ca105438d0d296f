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

from .index import SparseIndex
from .torch_decode import _cache_rows, _gather, _row_view, selected_positions


def _check(q: torch.Tensor, k_sum: torch.Tensor, v_sum: torch.Tensor, count: torch.Tensor) -> None:
    if q.dim() != 3 or k_sum.dim() != 4 or k_sum.shape != v_sum.shape or k_sum.shape[0] != q.shape[0]:
        raise ValueError(f"tail estimate needs q (B, H_q, D) and k_sum / v_sum (B, H_kv, N, D) of one shape, got "
                         f"q {tuple(q.shape)}, k_sum {tuple(k_sum.shape)}, v_sum {tuple(v_sum.shape)}")
    if tuple(count.shape) != (k_sum.shape[0], k_sum.shape[2]):
        raise ValueError(f"count must have shape (B, N) = {(k_sum.shape[0], k_sum.shape[2])}, got {tuple(count.shape)}")
    if q.shape[1] % k_sum.shape[1] or q.shape[2] != k_sum.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not match {k_sum.shape[1]} KV heads of dim {k_sum.shape[3]}")


def _chunk_attention(q: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, n: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H_q, D) over chunk means (B, H_kv, N, D) standing for ``n`` (B, H_kv, N) tokens each."""
    B, H_q, D = q.shape
    H = k_mean.shape[1]
    qg = q.float().reshape(B, H, H_q // H, D) * scale  # (B, H_kv, G, D)
    logits = qg @ k_mean.transpose(-1, -2) + n.clamp(min=1).log()[:, :, None]  # (B, H_kv, G, N)
    logits = logits.masked_fill((n < 0.5)[:, :, None], float("-inf"))  # empty chunks stand for nothing
    lse = torch.logsumexp(logits, dim=-1)  # (B, H_kv, G); -inf when every chunk is empty
    out = torch.softmax(logits, dim=-1).nan_to_num(0.0) @ v_mean  # (B, H_kv, G, D)
    return out.reshape(B, H_q, D), lse.reshape(B, H_q)


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


def _positions(index: SparseIndex, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attended positions ``(B, H_kv, V)`` and their validity (each real token once).

    The unpadded token index of the decode hot path (`range_topk_index`: ``block_size`` 1, no
    ``seq_starts``, a trusted ``id_range`` inside ``[sinks, seq_len - dense_tail)``) is laid out
    directly as sinks + ids + tail (validity None on CPU when every slot holds an id); anything
    else goes through `selected_positions`.
    """
    r = index.id_range
    if (seq_len is None or index.block_size != 1 or index.seq_starts is not None or r is None
            or r[0] < index.sinks or r[1] >= seq_len - index.dense_tail):
        return selected_positions(index)
    B, H, K = index.block_idx.shape
    dev = index.device
    S, W = index.sinks, index.dense_tail
    pos = torch.empty(B, H, S + K + W, dtype=torch.long, device=dev)
    pos[..., :S] = torch.arange(S, device=dev)
    pos[..., S:S + K] = index.block_idx
    pos[..., S + K:] = torch.arange(seq_len - W, seq_len, device=dev)
    if dev.type == "cpu" and int(index.block_cnt.min()) == K:
        return pos, None  # every slot holds a token (the top-k hot path): no mask to apply
    valid = torch.ones(B, H, S + K + W, dtype=torch.bool, device=dev)
    valid[..., S:S + K] = torch.arange(K, device=dev) < index.block_cnt[..., None]
    return pos.masked_fill_(~valid, 0), valid


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


def _estimate(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size: int, scale: float, seq_len: int | None,
              *, with_exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`tail_estimate` (``with_exact=False``) or `sparse_decode_tail`'s merged attention (True), fp32."""
    B, H, N, D = k_sum.shape
    G = q.shape[1] // H
    pos, valid = _positions(index, seq_len)  # (B, H_kv, V) attended positions, each real token once
    V = pos.shape[-1]
    rel = pos if index.seq_starts is None else (pos - index.seq_starts.long()[:, None, None]).clamp_(min=0)
    chunk = torch.div(rel, chunk_size, rounding_mode="floor").clamp_(max=N - 1).view(B * H, 1, V)
    # the attended tokens' rows, fp32 (B * H_kv, V, D), gathered once as the decode does
    rows_k, flat_k = _cache_rows(k_cache, pos)
    k_att = _gather(rows_k, flat_k, "tail_k")
    flat_v = flat_k if v_cache.stride() == k_cache.stride() else _cache_rows(v_cache, pos)[1]
    v_att = _gather(_row_view(v_cache)[0], flat_v, "tail_v")
    validf = None if valid is None else valid.view(B * H, 1, V).float()
    # Linear in the chunk sums, so the attended tokens come out of the scores and the output
    # instead of out of the (N, D) sums: q . mean_c = (q . S_c - sum_{j in c} q . k_j) / n_c and
    # out = (p / n) @ S_v - sum_j (p / n)_{c(j)} v_j. Per-chunk sums of the attended tokens' scores
    # and counts are one index_add over (V, G + 1) values; uncounted slots go to a spare chunk N.
    qg = q.float().reshape(B * H, G, D) * scale
    s_att = torch.bmm(qg, k_att.transpose(1, 2))  # (B * H_kv, G, V)
    ones = s_att.new_ones(B * H, 1, V) if validf is None else validf
    per_slot = torch.cat([s_att, ones], 1).transpose(1, 2)  # (B * H_kv, V, G + 1)
    slot_chunk = chunk.view(B * H, V) if valid is None else torch.where(valid.view(B * H, V), chunk.view(B * H, V), N)
    target = (torch.arange(B * H, device=pos.device).view(B * H, 1) * (N + 1) + slot_chunk).view(-1)
    removed = per_slot.new_zeros(B * H * (N + 1), G + 1).index_add_(0, target, per_slot.reshape(-1, G + 1))
    removed = removed.view(B * H, N + 1, G + 1)[:, :N]  # (B * H_kv, N, G + 1)
    n_rest = count[:, None, :].expand(B, H, N).reshape(B * H, 1, N) - removed[:, None, :, G]  # (B * H_kv, 1, N)
    inv = 1.0 / n_rest.clamp(min=1)
    s_chunk = (torch.bmm(qg, k_sum.reshape(B * H, N, D).transpose(1, 2)) - removed[..., :G].transpose(1, 2)) * inv
    s_chunk = (s_chunk + n_rest.clamp(min=1).log()).masked_fill(n_rest < 0.5, float("-inf"))  # (B * H_kv, G, N)
    # softmax and log-sum-exp from one exp (torch.logsumexp costs more than the rest on CPU); with
    # the exact part, one softmax over [attended tokens, chunk summaries]
    top = s_chunk.amax(-1, keepdim=True)
    if with_exact:
        if validf is not None:
            s_att = s_att.masked_fill(validf < 0.5, float("-inf"))
        top = torch.maximum(top, s_att.amax(-1, keepdim=True))
    top = top.clamp_(min=torch.finfo(torch.float32).min)  # finite when everything is -inf
    e_chunk = (s_chunk - top).exp_()
    total = e_chunk.sum(-1, keepdim=True)  # (B * H_kv, G, 1); 0 when nothing is attended or estimated
    if with_exact:
        e_att = (s_att - top).exp_()
        total = total + e_att.sum(-1, keepdim=True)
    lse = (top + total.log()).view(B, H * G)  # -inf when nothing is attended or estimated
    norm = 1.0 / total.clamp(min=torch.finfo(torch.float32).tiny)
    w_chunk = e_chunk.mul_(inv).mul_(norm)  # (B * H_kv, G, N): per unit of a chunk's value sum
    # an attended token's weight, less its share of its chunk's (value sum - attended values)
    w_att = torch.gather(w_chunk, 2, chunk.expand(B * H, G, V)).neg_()
    if validf is not None:
        w_att = w_att.mul_(validf)
    if with_exact:
        w_att = w_att.add_(e_att.mul_(norm))
    out = torch.baddbmm(torch.bmm(w_chunk, v_sum.reshape(B * H, N, D)), w_att, v_att)  # (B * H_kv, G, D)
    return out.view(B, H * G, D), lse


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
    functions in turn. The native backend (fp32 CPU, a clean index; ``"auto"`` picks it when it
    is built) does the same math in one compiled call (`kvpress.kernels.native`). The triton
    backend (CUDA) runs `sparse_decode`'s kernel and then the estimate and the merge in torch.

    Arguments as `sparse_decode` and `tail_estimate`. Returns ``out`` ``(B, H_q, D)`` in q's
    dtype and fp32 ``lse`` ``(B, H_q)`` of everything (attended and estimated).
    """
    from .checks import check_decode_inputs
    from .decode import BACKENDS, _native_decode, _native_first, sparse_decode
    from .merge import merge_states

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check(q, k_sum, v_sum, count)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if _native_first(q, backend):
        done = _native_decode(q, k_cache, v_cache, index, scale, None, validate_index, backend == "native",
                              tail=(k_sum, v_sum, count), chunk_size=chunk_size)
        if done is not None:
            return done
        validate_index = False  # validated by _native_decode
    if backend != "torch" and q.is_cuda:
        out, lse = sparse_decode(q, k_cache, v_cache, index, scale=scale, backend=backend,
                                 validate_index=validate_index)
        t_out, t_lse = tail_estimate(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size=chunk_size,
                                     scale=scale, seq_len=seq_len)
        return merge_states(out, lse, t_out.to(out.dtype), t_lse)
    check_decode_inputs(q, k_cache, v_cache, index, None, validate_index)
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
