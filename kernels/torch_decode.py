"""Torch backend of `sparse_decode`: gather only the selected K/V rows, then one attention pass.

Work and memory traffic grow with the budget (sinks + tail + K_max * block_size), not with
the context, which makes this the fast path on CPU. Scores and softmax run in fp32.

A decode step calls this once per layer, so the fixed cost per call matters as much as the
bandwidth: a budget of 256 tokens moves ~2 MB, ~0.2 ms on one CPU core, while every distinct
torch op costs a few microseconds warm and tens of microseconds when its code and data were
evicted (which a layer's MLP, or the dense pass of the benchmark, does). So a call is ~20
torch ops whatever the index looks like, with no Python loop over heads or blocks and no
device sync:

1. ``_slot_positions``: ``V = sinks + dense_tail + K_max * block_size`` slots per (row, KV
   head) in three segments, each built by one ``add`` and clamped by one ``clamp`` into its
   range of the `SparseIndex` decomposition (sinks ``[seq_start, sink_end)``, tail
   ``[tail_start, seq_len)``, blocks ``[sink_end, tail_start)``). A slot counts exactly when
   the clamp leaves it unchanged: the ranges are disjoint, so tokens are deduplicated by
   construction, padding ids (-1) and overlaps drop out, and every clamped position is a real
   token (safe to gather). ``eq`` + ``log_`` turn that test into the 0 / -inf mask. The
   per-row bounds come from Python ints on CPU (`_row_table_host`) and from tensor ops
   elsewhere (`_row_table_device`, no sync).
2. ``_row_view`` / ``_cache_rows``: a ``(rows, D)`` view of the cache storage and one row id
   per slot, so one ``index_select`` copies the selected rows of every (row, KV head)
   whatever the cache strides are (``KVBuffer`` views with spare capacity, HF caches,
   transposed layouts).
0. CPU, *clean* index (no padding slot, every selected block strictly between the sinks and
   the tail of every row: what top-k selections without left padding produce): no positions,
   no mask, ~17 torch calls (`kvpress.kernels.torch_fast`; `_clean_decode`). Steps 1-3 are
   the general path.
3. Attention. CPU fp32: ``baddbmm`` scores (scale and mask folded in), an unnormalised
   softmax, and ``embedding_bag`` for ``P @ V``, which reads the selected V rows straight from
   the cache instead of copying them (`_attend_bag`). CPU fp16/bf16 or caches whose rows
   overlap: gather K and V (converted to fp32) and torch's fused CPU flash-attention op, which
   also returns the log-sum-exp (`_attend`). Other devices: ``baddbmm`` + ``logsumexp`` +
   ``bmm``. A selection that covers most of the cache (fp32) is one masked pass instead.
"""
from __future__ import annotations

import math
import threading

import torch

from .checks import check_decode_inputs
from .index import SparseIndex
from .torch_fast import clean_decode_bag, clean_decode_fused, clean_row_ids, clean_rows

CPU_CHUNK_BYTES = 16 << 20  # gathered bytes per step of the CPU loop (bounds the workspace)
DENSE_FRACTION = 0.75  # padded selection >= this share of the cache: one masked pass instead
_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------- positions
_EMPTY = -(1 << 40)  # both bounds of an empty range: clamping sends every slot there
_CACHE: dict = {}  # small per-shape constants (aranges, row offsets), built once
_MAX_CACHE = 256


def _const(key: tuple, build) -> tuple[torch.Tensor, ...]:
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) >= _MAX_CACHE:  # contexts grow K_max step by step: keep it bounded
            _CACHE.clear()
        hit = _CACHE[key] = build()
    return hit


def _row_table_host(index: SparseIndex) -> tuple[torch.Tensor, bool, bool]:
    """`_row_table` from Python ints: cheaper than ~15 tiny tensor ops, and no sync on CPU."""
    S, Tl, K = index.sinks, index.dense_tail, index.max_blocks
    lens = index.seq_lens.tolist()
    starts = [0] * len(lens) if index.seq_starts is None else index.seq_starts.tolist()
    rows, any_empty, no_fixed = [], False, False
    for start, n in zip(starts, lens):
        sink_end = min(start + S, n)
        tail_start = max(n - Tl, sink_end)
        row = [start, tail_start]
        for lo, hi, slots in ((start, sink_end, S), (tail_start, n, Tl), (sink_end, tail_start, K)):
            row += [lo, hi - 1] if hi > lo else [_EMPTY, _EMPTY]
            any_empty |= bool(slots) and hi <= lo
        no_fixed |= sink_end == start and n == tail_start
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long).view(len(lens), 8), any_empty, no_fixed


def _row_table_device(index: SparseIndex) -> tuple[torch.Tensor, bool, bool]:
    """`_row_table` with tensor ops only (no host sync: CUDA and other devices)."""
    starts, sink_end, tail_start = index.row_ranges()  # (B,) each
    lens = index.seq_lens.long()
    cols = [starts, tail_start]
    for lo, hi in ((starts, sink_end), (tail_start, lens), (sink_end, tail_start)):
        ok = hi > lo
        cols += [torch.where(ok, lo, _EMPTY), torch.where(ok, hi - 1, _EMPTY)]
    return torch.stack(cols, 1), True, True


def _row_table(index: SparseIndex) -> tuple[torch.Tensor, bool, bool]:
    """Per-row token ranges of the SparseIndex decomposition (see `kvpress.kernels.index`).

    Returns
    -------
    table : torch.Tensor
        int64 ``(B, 8)``: ``seq_start, tail_start``, then the inclusive bounds ``lo, hi`` of
        the sink ``[seq_start, sink_end)``, tail ``[tail_start, seq_len)`` and block
        ``[sink_end, tail_start)`` ranges; an empty range gets ``lo = hi = _EMPTY``.
    any_empty : bool
        Whether some row has an empty range for a segment that has slots (False is exact).
    maybe_nothing : bool
        Whether some (row, KV head) may attend no token at all (False is exact).
    """
    if index.device.type == "cpu":
        return _row_table_host(index)
    return _row_table_device(index)


def _slot_positions(index: SparseIndex) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Token position of every slot, clamped into its range, and the slot's additive mask.

    Slots per (row, KV head): ``sinks`` from ``seq_start``, ``dense_tail`` from
    ``tail_start``, then ``block_size`` tokens per block slot (``V`` in all). Each segment is
    clamped into its range (sinks ``[seq_start, sink_end)``, tail ``[tail_start, seq_len)``,
    blocks ``[sink_end, tail_start)``): a slot counts exactly when clamping leaves it
    unchanged, so the disjoint ranges deduplicate by construction, padding ids (-1) and
    overlaps drop out, and every counted position is a real token.

    Returns
    -------
    pos : torch.Tensor
        int64 ``(B, H_kv, V)``; in ``[0, capacity)`` for every slot (uncounted ones too).
    bias : torch.Tensor
        fp32 ``(B, H_kv, V)``: 0 for counted slots, -inf otherwise.
    maybe_nothing : bool
        False when every (row, KV head) certainly attends at least one token.
    """
    B, H_kv, K = index.block_idx.shape
    S, Tl, bs = index.sinks, index.dense_tail, index.block_size
    F, V = S + Tl, S + Tl + K * bs
    dev = index.device
    ar_s, ar_t, ar_b = _const(("ar", S, Tl, bs, str(dev)),
                              lambda: tuple(torch.arange(n, device=dev) for n in (S, Tl, bs)))
    table, any_empty, maybe_nothing = _row_table(index)
    t = table[:, None, :, None].expand(B, H_kv, 8, 1)  # broadcasts over slots
    slots = torch.empty(B, H_kv, V, dtype=torch.long, device=dev)
    pos = torch.empty_like(slots)
    # three segments, each built by one add and clamped by one clamp (segment-wide bounds)
    for first, end, base_col, bound_col, offsets in ((0, S, 0, 2, ar_s), (S, F, 1, 4, ar_t)):
        if end > first:
            torch.add(t[:, :, base_col], offsets, out=slots[..., first:end])
            torch.clamp(slots[..., first:end], t[:, :, bound_col], t[:, :, bound_col + 1],
                        out=pos[..., first:end])
    if K:
        torch.add(ar_b, index.block_idx[..., None], alpha=bs, out=slots[..., F:].view(B, H_kv, K, bs))
        torch.clamp(slots[..., F:], t[:, :, 6], t[:, :, 7], out=pos[..., F:])
    # eq gives 1.0 / 0.0 and log turns that into the 0 / -inf mask in place
    bias = torch.eq(pos, slots, out=torch.empty(B, H_kv, V, device=dev)).log_()
    if any_empty:
        pos.clamp_(min=0)  # the _EMPTY sentinel; every other clamped slot is a real token
    return pos, bias, maybe_nothing


def selected_positions(index: SparseIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions each (row, KV head) attends, as a padded list.

    Returns
    -------
    pos : torch.Tensor
        int64 ``(B, H_kv, V)`` with ``V = sinks + dense_tail + K_max * block_size``; padded
        slots hold 0.
    valid : torch.Tensor
        bool ``(B, H_kv, V)``; True exactly once for every attended token (deduplicated).
    """
    pos, bias, _ = _slot_positions(index)
    valid = bias == 0
    return pos.masked_fill_(~valid, 0), valid


# ---------------------------------------------------------------------------- gather
def _row_view(cache: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """A ``(rows, D)`` view of ``cache``'s storage and the row arithmetic to address it.

    Returns ``rows, b_step, h_step, t_step``: token ``t`` of (row ``b``, KV head ``h``) is
    ``rows[b * b_step + h * h_step + t * t_step]``. Rows are ``g`` elements apart with ``g``
    the gcd of the cache strides (``D`` for every layout met in practice); they overlap when
    ``g < D``, which is fine for reading.
    """
    B, H_kv, T, D = cache.shape
    strides = [s for s, n in zip(cache.stride()[:3], (B, H_kv, T)) if n > 1 and s]
    g = math.gcd(*strides) if strides else D
    sb, sh, st = (s // g if n > 1 else 0 for s, n in zip(cache.stride()[:3], (B, H_kv, T)))
    n_rows = (B - 1) * sb + (H_kv - 1) * sh + (T - 1) * st + 1
    return cache.as_strided((n_rows, D), (g, 1)), sb, sh, st


_WORKSPACE = threading.local()


def _workspace(slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Reusable per-thread CPU buffer of ``shape``.

    Why: a fresh multi-MB CPU tensor is returned to the OS on free and page-faults again on
    the next step; at a 4k budget that costs more than the gather itself.
    """
    buffers = getattr(_WORKSPACE, "buffers", None)
    if buffers is None:
        buffers = _WORKSPACE.buffers = {}
    numel = math.prod(shape)
    buf = buffers.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        buf = buffers[(slot, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def _gather(rows: torch.Tensor, flat: torch.Tensor, slot: str) -> torch.Tensor:
    """``rows[flat]`` for ``flat`` of shape (n, V) -> fp32 ``(n, V, D)`` (one copy of each row)."""
    n, V = flat.shape
    D = rows.shape[1]
    if rows.device.type != "cpu":
        return rows.index_select(0, flat.view(-1)).view(n, V, D).float()
    sel = torch.index_select(rows, 0, flat.view(-1), out=_workspace(slot, (n * V, D), rows.dtype))
    if rows.dtype == torch.float32:
        return sel.view(n, V, D)
    # fp16 / bf16: the copy reads half the bytes; the math runs in fp32 like the reference
    return _workspace(slot + "32", (n, V, D), torch.float32).copy_(sel.view(n, V, D))


# ---------------------------------------------------------------------------- attention
def _fused_cpu_op():
    """torch's fused CPU flash-attention op, or None when absent or unfit.

    It returns the log-sum-exp next to the output, which the public SDPA does not. It is a
    private op, so it is probed once: a row with every token masked must come out as zeros
    (older torch versions gave NaN there), and the lse it returns is checked by the tests.
    """
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    try:
        q, k = torch.ones(2, 1, 1, 8), torch.ones(2, 1, 3, 8)
        bias = torch.tensor([0.0, float("-inf")])[:, None, None, None].expand(2, 1, 1, 3)
        o, lse = op(q, k, k, attn_mask=bias.contiguous(), scale=1.0)
        if o.shape != q.shape or not torch.equal(o[1], torch.zeros_like(o[1])) \
                or abs(float(lse[0, 0, 0]) - (8 + math.log(3))) > 1e-4:
            return None
    except RuntimeError:
        return None
    return op


_FUSED_CPU = _fused_cpu_op()
USE_FUSED_CPU = True  # tests switch it off to cover the explicit path on CPU


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
            maybe_nothing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with an additive mask, all fp32.

    Parameters
    ----------
    q : torch.Tensor
        ``(n, 1, G, D)``: the G query heads sharing one KV head are G query rows.
    k, v : torch.Tensor
        ``(n, 1, V, D)``, any strides with a contiguous last dim.
    bias : torch.Tensor or None
        ``(n, 1, 1, V)``, 0 for attended tokens and -inf otherwise; None attends every token.
    scale : float
        Score scale.
    maybe_nothing : bool
        Whether some row of ``bias`` may be all -inf (False skips the fix-up for such rows).

    Returns
    -------
    o : torch.Tensor
        ``(n, 1, G, D)``, contiguous; zeros where nothing is attended.
    lse : torch.Tensor
        ``(n, 1, G)``, natural log-sum-exp of the scaled, masked scores; -inf where nothing
        is attended.
    """
    if q.device.type == "cpu" and _FUSED_CPU is not None and USE_FUSED_CPU:
        o, lse = _FUSED_CPU(q, k, v, attn_mask=bias, scale=scale)
        # the op reports lse 0 for a row with nothing attended; max(bias) is 0 or -inf
        return o, (lse.add_(bias.amax(-1)) if maybe_nothing and bias is not None else lse)
    kt = k.flatten(0, 1).transpose(1, 2)  # (n, D, V)
    if bias is None:
        scores = torch.bmm(q.flatten(0, 1), kt).mul_(scale)  # (n, G, V)
    else:
        scores = torch.baddbmm(bias.flatten(0, 2)[:, None], q.flatten(0, 1), kt, alpha=scale)  # (n, G, V)
    lse = torch.logsumexp(scores, dim=-1)  # (n, G); -inf where everything is masked
    p = scores.sub_(lse.nan_to_num(neginf=0.0)[..., None]).exp_()  # masked tokens: exp(-inf) = 0
    return torch.bmm(p, v.flatten(0, 1)).view(q.shape), lse.view(q.shape[:-1])


_FLT_MIN = torch.finfo(torch.float32).min
USE_BAG_CPU = True  # tests switch it off to cover the gather-both path on CPU


def _attend_bag(q: torch.Tensor, k: torch.Tensor, rows_v: torch.Tensor, flat_v: torch.Tensor,
                bias: torch.Tensor, scale: float, maybe_nothing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention whose ``P @ V`` reads the selected V rows straight from the cache.

    ``embedding_bag(mode="sum", per_sample_weights=P)`` is a weighted sum of table rows: with
    the cache rows as the table it computes ``P @ V`` without copying V first, at about half
    the cost of gather + bmm on CPU (fbgemm's prefetching row kernel).

    Parameters
    ----------
    q : torch.Tensor
        fp32 ``(n, G, D)``.
    k : torch.Tensor
        fp32 ``(n, V, D)``, the gathered K rows.
    rows_v : torch.Tensor
        fp32 ``(rows, D)`` view of the V cache (contiguous rows).
    flat_v : torch.Tensor
        int64 ``(n, G, V)`` row ids, repeated over the G query heads of a group.
    bias : torch.Tensor
        fp32 ``(n, 1, V)``, 0 / -inf.

    Returns
    -------
    o : torch.Tensor
        fp32 ``(n, G, D)``. lse : fp32 ``(n, G)``; zeros / -inf where nothing is attended.
    """
    n, G, V = flat_v.shape
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)  # (n, G, V)
    m = scores.amax(-1, keepdim=True)  # (n, G, 1)
    if maybe_nothing:
        m.clamp_(min=_FLT_MIN)  # all -inf row: exp(-inf - min) = 0 instead of NaN
    p = scores.sub_(m).exp_()  # unnormalised: the max term is exp(0) = 1
    denom = p.sum(-1, keepdim=True)  # (n, G, 1); >= 1 unless nothing is attended
    lse = denom.log().add_(m)  # log(0) = -inf for empty rows
    offsets = _const(("bag", n * G, V, str(q.device)),
                     lambda: (torch.arange(n * G, device=q.device) * V,))[0]
    o = torch.nn.functional.embedding_bag(flat_v.reshape(-1), rows_v, offsets, mode="sum",
                                          per_sample_weights=p.view(-1))  # (n * G, D)
    o = o.view(n, G, -1).div_(denom.clamp_(min=1.0) if maybe_nothing else denom)
    return o, lse.view(n, G)


def _cache_rows(cache: torch.Tensor, pos: torch.Tensor, group: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` view of ``cache`` and the row id of each token in ``pos`` (B, H_kv, V).

    Returns ``rows`` and int64 row ids ``(B * H_kv, V)``, or ``(B * H_kv, group, V)`` repeated
    over ``group`` query heads when ``group`` is given (the layout `_attend_bag` reads).
    """
    B, H_kv, V = pos.shape
    n_rep = 1 if group is None else group
    rows, sb, sh, st = _row_view(cache)
    pair = _const(("pair", B, H_kv, n_rep, sb, sh, str(pos.device)),
                  lambda: ((torch.arange(B)[:, None, None, None] * sb + torch.arange(H_kv)[:, None, None] * sh)
                           .expand(B, H_kv, n_rep, 1).to(pos.device),))[0]  # (B, H_kv, n_rep, 1)
    flat = torch.add(pair, pos[:, :, None], alpha=st)  # (B, H_kv, n_rep, V)
    return rows, flat.view(B * H_kv, V) if group is None else flat.view(B * H_kv, n_rep, V)


def _selects_whole_cache(index: SparseIndex, capacity: int) -> bool:
    """Whether ``index`` (a valid one) attends every token of every row: full rows and every
    block of the cache selected (ids are distinct and in range, so the count decides)."""
    if index.seq_starts is not None and any(index.seq_starts.tolist()):
        return False
    if any(n != capacity for n in index.seq_lens.tolist()):
        return False
    n_blocks = -(-capacity // index.block_size)
    return index.max_blocks >= n_blocks and int(index.block_cnt.min()) == n_blocks


def _cat_parts(parts: list) -> tuple[torch.Tensor, torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


USE_CLEAN_CPU = True  # tests switch it off to cover the masked path with clean indices
# clean fp32 selections of at most this many (KV head, token) rows: gather K and V + the fused op
# (fewer torch calls) instead of embedding_bag (which reads V in place: less traffic when large)
CLEAN_FUSED_ROWS = 1024


def _clean_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex,
                  rows: list, scale: float, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """CPU path for a clean index (`kvpress.kernels.torch_fast`): no positions, no mask.

    fp32 with contiguous V rows and a workspace under ``CPU_CHUNK_BYTES``: the lean
    ``embedding_bag`` path, which writes ``out`` (returns ``out, lse, True``). Otherwise gathers
    K and V rows (fp32) in chunks and runs the unmasked attention: ``(N, 1, G, D)``,
    ``(N, 1, G)``, False.
    """
    B, H_kv, _ = index.block_idx.shape
    N, G, D = B * H_kv, q.shape[1] // H_kv, q.shape[2]
    V = index.sinks + index.dense_tail + index.max_blocks * index.block_size
    rows_k, *steps_k = _row_view(k_cache)
    rows_v, *steps_v = _row_view(v_cache)
    if q.dtype == torch.float32 and q.is_contiguous() and N * V * D * 4 <= CPU_CHUNK_BYTES:
        if _FUSED_CPU is not None and USE_FUSED_CPU and N * V <= CLEAN_FUSED_ROWS:
            return *clean_decode_fused(_FUSED_CPU, q, rows_k, tuple(steps_k), rows_v, tuple(steps_v), index, rows,
                                       scale, out), True
        if USE_BAG_CPU and rows_v.is_contiguous():
            return *clean_decode_bag(q, rows_k, tuple(steps_k), rows_v, tuple(steps_v), index, rows, scale,
                                     out), True
    ids_k = clean_row_ids(index, rows, tuple(steps_k)).view(N, V)
    ids_v = ids_k if steps_v == steps_k else clean_row_ids(index, rows, tuple(steps_v), 1, "v").view(N, V)
    q4 = q.reshape(N, 1, G, D).float()
    chunk = max(1, CPU_CHUNK_BYTES // (V * D * 8))  # gathered K + V bytes per step
    parts = []
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        k_sel, v_sel = _gather(rows_k, ids_k[s:e], "k"), _gather(rows_v, ids_v[s:e], "v")  # (n, V, D) fp32
        parts.append(_attend(q4[s:e], k_sel[:, None], v_sel[:, None], None, scale, False))
    return *_cat_parts(parts), False


def torch_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        index: SparseIndex, *, scale: float | None = None,
                        out: torch.Tensor | None = None, validate_index: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of `kvpress.kernels.sparse_decode` (same arguments and results)."""
    B, H_q, H_kv, G, T_cap, D = check_decode_inputs(q, k_cache, v_cache, index, out, validate_index)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    N = B * H_kv
    V = index.sinks + index.dense_tail + index.max_blocks * index.block_size
    if V == 0 or T_cap == 0:
        out = torch.zeros_like(q) if out is None else out.zero_()
        return out, torch.full((B, H_q), _NEG_INF, device=q.device)
    cpu = q.device.type == "cpu"
    masked_pass = q.dtype == torch.float32 and V >= DENSE_FRACTION * T_cap
    # CPU, clean index (no padding, no overlaps: `torch_fast`): no positions, no mask
    rows = clean_rows(index) if cpu and USE_CLEAN_CPU and not masked_pass else None
    q4 = None if rows is not None else q.reshape(N, 1, G, D).float()  # (N, 1, G, D); a view for fp32 q
    if rows is not None:
        o, lse, done = _clean_decode(q, k_cache, v_cache, index, rows, scale, out)
        if done:
            return o, lse
    elif masked_pass:
        # the padded selection is about as large as the cache: one masked pass over the cache
        # reads less than gathering (copying) most of it first. (fp16/bf16 always gather: the
        # fused CPU kernel is slow in half precision, and the gathered copy is fp32 anyway.)
        everything = cpu and _selects_whole_cache(index, T_cap)
        # every token of every row selected: plain attention, no mask to build (~10 ops on T)
        bias = None if everything else torch.where(index.token_mask(T_cap), 0.0, _NEG_INF).view(N, 1, 1, T_cap)
        o, lse = _attend(q4, k_cache.reshape(N, 1, T_cap, D), v_cache.reshape(N, 1, T_cap, D), bias,
                         scale, not everything)
    else:
        pos, bias, maybe_nothing = _slot_positions(index)  # (B, H_kv, V) each
        rows_k, flat_k = _cache_rows(k_cache, pos)  # (N, V) row ids
        rows_v = _row_view(v_cache)[0]
        # embedding_bag needs a plain (rows, D) table: fp32, non-overlapping rows
        bag = cpu and USE_BAG_CPU and q.dtype == torch.float32 and rows_v.is_contiguous()
        if bag:
            flat_v = _cache_rows(v_cache, pos, G)[1]  # (N, G, V)
        elif v_cache.stride() == k_cache.stride():  # same row arithmetic (HF caches, KVBuffer)
            flat_v = flat_k
        else:
            flat_v = _cache_rows(v_cache, pos)[1]
        # CPU: bound the gathered bytes per step (workspace size; cache residency)
        per_pair = V * D * 4 * (1 if bag else 2)
        chunk = max(1, CPU_CHUNK_BYTES // per_pair) if cpu else N
        parts = []
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            k_sel = _gather(rows_k, flat_k[s:e], "k")  # (n, V, D) fp32
            if bag:
                parts.append(_attend_bag(q4[s:e, 0], k_sel, rows_v, flat_v[s:e], bias.view(N, 1, V)[s:e],
                                         scale, maybe_nothing))
            else:
                v_sel = _gather(rows_v, flat_v[s:e], "v")
                parts.append(_attend(q4[s:e], k_sel[:, None], v_sel[:, None], bias.view(N, 1, 1, V)[s:e],
                                     scale, maybe_nothing))
        o, lse = _cat_parts(parts)
    o = o.view(B, H_q, D)
    if out is None:
        out = o if o.dtype == q.dtype else o.to(q.dtype)
    else:
        out.copy_(o)
    return out, lse.view(B, H_q)
