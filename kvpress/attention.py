"""Pure-torch attention used by the cache layers for prefill and dense decode.

Conventions: ``q`` is [B, H_q, T_q, D] and ``k``/``v`` are [B, H_kv, T_k, D] with
``H_q = G * H_kv`` (query head h reads KV head h // G, as transformers' ``repeat_kv``). Positions
are *sequence indices* (left padding included); ``row_start[b]`` is the first real token of row
b, so keys before it are never attended. A padded query (position < row_start) attends only to
itself, which keeps its output finite: a NaN there would reach real tokens through 0 * NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .kernels import SparseIndex
from .kernels.backend import triton_unsupported

# Upper bound on the fp32 score block one query chunk may materialise (bytes).
_SCORE_BYTES = 256 * 2**20


def _query_chunk(batch: int, heads: int, keys: int, total: int) -> int:
    per_query = max(1, batch * heads * keys * 4)
    return int(max(1, min(total, _SCORE_BYTES // per_query)))


def _triton_decode_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.dtype == k.dtype and triton_unsupported(q, q.shape[-1], q.shape[1] // k.shape[1], forced=False) is None


def _triton_decode(q, k, v, scaling, row_start):
    """One decode token per head on CUDA: the Triton decode kernel over the whole cache.

    SDPA would do here, but with torch 2.11 on an H100 it picked its cuDNN backend, which builds
    a new plan for every new key length -- 1.5-2 ms of host time per call, i.e. per layer and
    decode step (profiled on an H100, 2026-11-22); this kernel costs ~0.2 ms of host
    time and about SDPA's device time.
    """
    return whole_cache_decode(q, k, v, scaling, row_start, backend="triton")


def whole_cache_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                       row_start: torch.Tensor | None, *, backend: str = "auto") -> torch.Tensor:
    """One query per head ``q [B, H_q, 1, D]`` over every cached token ``k, v [B, H_kv, T, D]``
    (rows start at ``row_start``) through ``kvpress.kernels.sparse_decode``; returns ``[B, H_q, 1, D]``."""
    out, _ = kernels.sparse_decode(q[:, :, 0], k, v, whole_cache_index(k, row_start, q.device), scale=scaling,
                                   backend=backend, validate_index=False)
    return out[:, :, None]


_WHOLE_INDEX: dict = {}  # key -> (row_start, index) of `whole_cache_index`, the latest few


def whole_cache_index(k: torch.Tensor, row_start: torch.Tensor | None, device) -> SparseIndex:
    """The dense `SparseIndex` of every token of ``k [B, H_kv, T, D]`` from ``row_start`` on.

    Every layer of a decode step asks for one of a few (one per KV head count and length: ``duo``'s
    layers keep different numbers of retrieval heads, a full window layer asks for its slots), so
    the latest 16 are kept and handed out again: about ten small ops, i.e. launches on a GPU, per
    layer and step saved. Keyed by the shapes, the device and ``row_start`` (the tensor itself,
    held so that its id cannot be reused, and its version, which an in-place change bumps)."""
    batch, heads, t_k, _ = k.shape
    key = (batch, heads, t_k, str(device), None if row_start is None else (id(row_start), row_start._version))
    hit = _WHOLE_INDEX.get(key)
    if hit is not None:
        return hit[1]
    if len(_WHOLE_INDEX) >= 16:
        _WHOLE_INDEX.clear()  # older steps' lengths, other models: done with
    lens = torch.full((batch,), t_k, dtype=torch.int32, device=device)
    index = SparseIndex.dense(lens, heads, seq_starts=row_start, capacity=t_k)
    _WHOLE_INDEX[key] = (row_start, index)
    return index


def static_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *,
                            end: torch.Tensor, row_start: torch.Tensor | None) -> torch.Tensor:
    """One query per head ``q [B, H_q, 1, D]`` over a preallocated cache ``k, v [B, H_kv, C, D]`` whose
    first ``end`` slots hold tokens (``end``: a [1] long device tensor; rows start at ``row_start``).

    The shapes depend only on the capacity ``C`` and the visible slots come from a device tensor,
    so a compiled decode step keeps one graph while the cache fills. The masked slots cost their
    share of the work: the price of fixed shapes (a capacity bucket leaves at most ~12.5% slack).
    """
    slots = torch.arange(k.shape[2], device=q.device)
    visible = (slots < end)[None, :]  # [1, C]
    if row_start is not None:
        visible = visible & (slots[None, :] >= row_start[:, None])  # [B, C]
    return masked_decode_attention(q, k, v, scaling, visible)


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                            visible: torch.Tensor) -> torch.Tensor:
    """One query per head ``q [B, H_q, 1, D]`` over the slots of ``k, v [B, H_kv, C, D]`` that
    ``visible`` ([B or 1, C] bool, every row seeing at least one) marks; returns [B, H_q, 1, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=scaling,
                                          enable_gqa=q.shape[1] != k.shape[1])


def masked_group_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """Grouped queries over keys each query row chooses, through SDPA with a boolean mask.

    Parameters
    ----------
    qg : Tensor [B, H_kv, G, T, D]
        Queries grouped by KV head (query head ``h * G + g`` reads KV head ``h``).
    k, v : Tensor [B, H_kv, N, D], the dtype of ``qg``
    visible : bool Tensor [B, H_kv, T, N]
        Which keys each query row sees (the same for the G heads of a group); every row must see
        at least one.

    Returns
    -------
    Tensor [B, H_kv, G, T, D] in the dtype of ``qg``
    """
    B, H, G, T, D = qg.shape
    mask = visible[:, :, None].expand(B, H, G, T, visible.shape[-1]).reshape(B, H, G * T, visible.shape[-1])
    out = F.scaled_dot_product_attention(qg.reshape(B, H, G * T, D), k, v, attn_mask=mask, scale=scaling)
    return out.view(B, H, G, T, D)


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    *,
    q_start: int,
    row_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new queries over a contiguous cache.

    Parameters
    ----------
    q : Tensor [B, H_q, T_q, D]
        Queries at sequence indices ``q_start .. q_start + T_q - 1``.
    k, v : Tensor [B, H_kv, T_k, D]
        Keys/values at sequence indices ``0 .. T_k - 1`` (``T_k = q_start + T_q``).
    scaling : float
        Softmax scale (``head_dim ** -0.5`` for the supported families).
    row_start : Tensor [B] (long) or None
        First real token per row (left padding); None when no row is padded.

    Returns
    -------
    Tensor [B, H_q, T_q, D] in q's dtype.

    One decode token on CUDA (head_dim 64 / 128, Triton installed) goes through the Triton
    decode kernel (see `_triton_decode`); everything else through SDPA.
    """
    batch, _, t_q, _ = q.shape
    t_k = k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if t_q == 1 and q_start == t_k - 1 and _triton_decode_applies(q, k):
        return _triton_decode(q, k, v, scaling, row_start)
    if row_start is None and (t_q == 1 or q_start == 0):
        # Plain causal (or single-query) attention: SDPA's fused CPU/GPU kernels apply.
        return F.scaled_dot_product_attention(q, k, v, is_causal=t_q > 1, scale=scaling, enable_gqa=gqa)
    k_pos = torch.arange(t_k, device=q.device)
    outs = []
    step = _query_chunk(batch, q.shape[1], t_k, t_q)
    for i0 in range(0, t_q, step):
        i1 = min(t_q, i0 + step)
        q_pos = torch.arange(q_start + i0, q_start + i1, device=q.device)
        mask = k_pos[None, None, :] <= q_pos[None, :, None]  # (1, Tq, Tk)
        if row_start is not None:
            rs = row_start.view(batch, 1, 1)
            real = k_pos[None, None, :] >= rs
            padded_query = q_pos[None, :, None] < rs
            mask = (mask & real) | (padded_query & (k_pos[None, None, :] == q_pos[None, :, None]))
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, i0:i1], k, v, attn_mask=mask[:, None], scale=scaling, enable_gqa=gqa
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def sliding_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *, window: int,
                             row_start: torch.Tensor | None = None, query_chunk: int | None = None,
                             sinks: int = 0) -> torch.Tensor:
    """Causal attention of a whole sequence where query ``p`` sees keys ``p - window + 1 .. p``
    (transformers' sliding-window layers), and with ``sinks`` > 0 also keys ``0 .. sinks - 1``
    (StreamingLLM's pattern, as DuoAttention's calibration trains it), without a cache.

    q [B, H_q, T, D], k / v [B, H_kv, T, D] at sequence indices ``0 .. T - 1``; ``row_start`` [B]
    (long) or None as in :func:`dense_causal_attention`. Returns [B, H_q, T, D] in q's dtype.

    Queries go through SDPA (its fused CPU / GPU kernels, in q's dtype, as the model's own
    ``sdpa`` path) in chunks of ``query_chunk``, each over only the keys its window can reach (and
    the sinks), so the cost is O(T * (sinks + window + chunk)), not O(T^2). Default chunk: 128
    queries on CPU (1.2-1.4x faster than the fp32 streaming route at 4k-8k tokens and windows
    512-1024; chunks 64-512 measured by ``python -m kvpress.evals.bench_prefill``), 1024 elsewhere (fewer launches on a GPU; not yet timed there).
    """
    batch, h_q, t, _ = q.shape
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    if sinks and row_start is not None:
        raise ValueError("sinks count from sequence index 0, so they take no row_start (left padding)")
    step = (128 if q.device.type == "cpu" else 1024) if query_chunk is None else int(query_chunk)
    if step < 1:
        raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
    step = max(1, min(step, _query_chunk(batch, h_q, sinks + window + step, t)))
    gqa = h_q != k.shape[1]
    outs = []
    for i0 in range(0, t, step):
        i1 = min(t, i0 + step)
        lo = max(0, i0 - window + 1)
        q_pos = torch.arange(i0, i1, device=q.device)[:, None]  # (Tq, 1)
        head = min(sinks, lo)  # sink keys before the window's reach, gathered in front of it
        k_pos = torch.arange(lo, i1, device=q.device)
        kc, vc = k[:, :, lo:i1], v[:, :, lo:i1]
        if head:
            k_pos = torch.cat([torch.arange(head, device=q.device), k_pos])
            kc, vc = torch.cat([k[:, :, :head], kc], dim=2), torch.cat([v[:, :, :head], vc], dim=2)
        k_pos = k_pos[None, :]  # (1, Tk)
        near = q_pos - k_pos < window
        mask = (k_pos <= q_pos) & ((near | (k_pos < sinks)) if sinks else near)  # (Tq, Tk)
        if row_start is not None:
            rs = row_start.view(batch, 1, 1)
            mask = (mask & (k_pos >= rs)) | ((q_pos < rs) & (k_pos == q_pos))  # a padded query sees itself
            mask = mask[:, None]  # (B, 1, Tq, Tk)
        outs.append(F.scaled_dot_product_attention(q[:, :, i0:i1], kc, vc, attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def streaming_attention(
    q: torch.Tensor,
    k_cached: torch.Tensor,
    v_cached: torch.Tensor,
    pos_cached: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scaling: float,
    *,
    q_start: int,
    row_start: torch.Tensor,
    sinks: int,
    window: int,
    sink_query_fn=None,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention where query p sees the first ``sinks`` real tokens and its last ``window`` tokens.

    Every query is treated exactly as if tokens had been fed one at a time through a cache of
    ``sinks + window`` slots (StreamingLLM), so a long prefill costs O(T * (sinks + window)).

    Parameters
    ----------
    q : Tensor [B, H_q, T, D]
        Queries of the new tokens, post-RoPE, at sequence indices ``q_start .. q_start + T - 1``.
    k_cached, v_cached : Tensor [B, H_kv, T_c, D]
        Tokens kept from earlier forwards; ``pos_cached`` [B, T_c] (long) gives their sequence
        index, -1 for an empty slot.
    k_new, v_new : Tensor [B, H_kv, T, D]
        The new tokens' keys/values (same indices as the queries).
    row_start : Tensor [B] (long)
        First real token of each row; sinks are counted from it.
    sink_query_fn : callable or None
        ``sink_query_fn(q, shift)`` returns ``q`` rotated by RoPE ``shift`` [B, 1, T] positions.
        When given, sink keys are scored as if they sat right before the window (StreamingLLM's
        in-cache positions) instead of at their true distance.
    tail : (k_mean, v_mean, count) or None
        Chunk means of tokens every real query of this call has already lost (evicted before
        ``q_start``): k_mean / v_mean [B, H_kv, N, D], count [B, N] (tokens each chunk stands
        for; 0 = empty). Each chunk joins every real query's softmax as one key of score
        ``scale * q . k_mean + log(count)`` and value ``v_mean`` (`kvpress.kernels.tail_estimate`'s
        estimate, here inside the same softmax). Not combinable with ``sink_query_fn``.

    Returns
    -------
    Tensor [B, H_q, T, D] in q's dtype.

    Without ``sink_query_fn`` and ``tail`` each query chunk is one masked SDPA call in q's dtype;
    with either, the scores are built by hand in fp32.
    """
    batch, h_q, t_q, dim = q.shape
    h_kv = k_new.shape[1]
    group = h_q // h_kv
    device = q.device
    rs = row_start.view(batch, 1)
    if tail is not None:
        if sink_query_fn is not None:
            raise ValueError("streaming_attention: a tail estimate cannot be combined with sink_query_fn")
        t_k, t_v, t_n = (x.to(torch.float32) for x in tail)
        t_bias = t_n.clamp(min=1).log().masked_fill(t_n < 0.5, float("-inf"))[:, None, None, None, :]  # (B,1,1,1,N)
    outs = []
    # query chunk: 128 on CPU for the SDPA route (measured, see sliding_causal_attention), else 256
    cap = 128 if sink_query_fn is None and tail is None and device.type == "cpu" else 256
    step = _query_chunk(batch, h_q, k_cached.shape[2] + sinks + window + cap, t_q)
    step = max(1, min(step, cap))
    for i0 in range(0, t_q, step):
        i1 = min(t_q, i0 + step)
        q_pos = torch.arange(q_start + i0, q_start + i1, device=device)  # (Tq,)
        q_real = q_pos[None, :] - rs  # (B, Tq) position within the row
        # Keys of this chunk: cached slots, sinks that live in the new block, and the window slice.
        lo = max(0, i0 - window + 1)
        new_idx = torch.arange(lo, i1, device=device)
        sink_idx = (row_start - q_start).view(batch, 1) + torch.arange(sinks, device=device)  # (B, S)
        sink_ok = (sink_idx >= 0) & (sink_idx < lo)
        sink_idx = sink_idx.clamp(0, max(0, k_new.shape[2] - 1))
        parts_k = [k_cached, _gather_tokens(k_new, sink_idx), k_new[:, :, lo:i1]]
        parts_v = [v_cached, _gather_tokens(v_new, sink_idx), v_new[:, :, lo:i1]]
        parts_pos = [
            pos_cached,
            torch.where(sink_ok, sink_idx + q_start, torch.full_like(sink_idx, -1)),
            (new_idx + q_start).expand(batch, -1),
        ]
        keys = torch.cat(parts_k, dim=2)  # (B, H_kv, Tk, D)
        values = torch.cat(parts_v, dim=2)
        k_pos = torch.cat(parts_pos, dim=1)  # (B, Tk)

        k_real = k_pos - rs  # (B, Tk)
        is_sink = (k_real >= 0) & (k_real < sinks)
        visible = (
            (k_pos[:, None, :] >= 0)
            & (k_real[:, None, :] >= 0)
            & (k_pos[:, None, :] <= q_pos[None, :, None])
            & ((q_pos[None, :, None] - k_pos[:, None, :] < window) | is_sink[:, None, :])
        )  # (B, Tq, Tk)
        padded_query = q_real < 0
        visible = visible | (padded_query[:, :, None] & (k_pos[:, None, :] == q_pos[None, :, None]))

        if sink_query_fn is None and tail is None:  # plain masked attention: SDPA's fused kernels, q's dtype
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i0:i1], keys.to(q.dtype), values.to(q.dtype), attn_mask=visible[:, None], scale=scaling,
                enable_gqa=group > 1))
            continue
        qc, keys, values = q[:, :, i0:i1].to(torch.float32), keys.to(torch.float32), values.to(torch.float32)
        qg = qc.reshape(batch, h_kv, group * (i1 - i0), dim)  # (B, H_kv, G*Tq, D)
        scores = (qg @ keys.transpose(-1, -2)).view(batch, h_kv, group, i1 - i0, -1) * scaling
        if sink_query_fn is not None and sinks > 0:
            # Once a query's window is full, the sinks sit at in-cache slots 0..S-1 and the query at
            # slot S + window - 1: rotate the query there for the sink scores only. Window keys keep
            # their true relative distance, so their scores are unchanged.
            shift = (q_real.clamp(max=sinks + window - 1) - q_real).to(torch.float32)  # (B, Tq)
            q_sink = sink_query_fn(qc, shift[:, None, :]).reshape(batch, h_kv, group * (i1 - i0), dim)
            sink_scores = (q_sink @ keys.transpose(-1, -2)).view(batch, h_kv, group, i1 - i0, -1) * scaling
            scores = torch.where(is_sink[:, None, None, None, :], sink_scores, scores)
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        if tail is not None:  # the evicted chunks, seen by every real query (not by padding)
            t_scores = (qg @ t_k.transpose(-1, -2)).view(batch, h_kv, group, i1 - i0, -1) * scaling + t_bias
            t_scores = t_scores.masked_fill(padded_query[:, None, None, :, None], float("-inf"))
            scores = torch.cat([scores, t_scores], dim=-1)
            values = torch.cat([values, t_v], dim=2)
        probs = torch.softmax(scores, dim=-1).view(batch, h_kv, group * (i1 - i0), -1)
        out = (probs @ values).view(batch, h_q, i1 - i0, dim)
        outs.append(out.to(q.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], idx [B, N] -> [B, H, N, D] (the same tokens for every head of a row)."""
    batch, heads, _, dim = x.shape
    index = idx[:, None, :, None].expand(batch, heads, idx.shape[1], dim)
    return torch.gather(x, 2, index)
