"""Mask-free fast path of the torch `sparse_decode` backend (CPU).

Most decode indices are *clean*: no padding slots, every row long enough for its sinks and
dense tail, and every selected block strictly between them. Then every slot of the padded
selection is a distinct real token: no positions need clamping and no mask is needed.

Why a separate path: on CPU a decode step runs attention once per layer right after the
layer's MLP (or, in the benchmark, a dense pass) has evicted the CPU caches, and then every
torch call, views included, costs ~10-30 us before it does any work (its code and the
allocator state come back from DRAM). The general path (`kvpress.kernels.torch_decode`) makes
~40 such calls for positions, masks, chunking and views; at a 256-token budget that fixed cost
was larger than reading the selected rows. This path makes ~17: the row ids are two broadcast
``add`` (plus two for sinks/tail) into cached buffers, K is one ``index_select`` into a cached
workspace, scores one ``baddbmm``, an unnormalised softmax, ``P @ V`` one ``embedding_bag``
straight from the V cache, and the normalisation writes ``out``.

Whether an index is clean is decided from the block ids' range (the builder's ``id_range``
hint, else one ``tolist`` / ``aminmax``) and the per-row lengths as Python ints (no device sync
on CPU); otherwise `clean_rows` returns None and the
caller runs the general path.
"""
from __future__ import annotations

import threading

import torch

from .index import SparseIndex

_LOCAL = threading.local()  # per-thread buffers and their views, keyed by shape
_MAX_ENTRIES = 64


def clean_rows(index: SparseIndex) -> list[tuple[int, int]] | None:
    """Per-row ``(seq_start, seq_len)`` when ``index`` (a valid one) needs no mask, else None.

    Clean means: every row has ``seq_len - seq_start >= sinks + dense_tail`` (sinks and tail
    are full and disjoint), no block slot is padding (-1), and every selected block lies inside
    ``[seq_start + sinks, seq_len - dense_tail)`` of every row. Then the ``sinks + dense_tail +
    K_max * block_size`` slots of each (row, KV head) are distinct tokens of the row.
    """
    S, Tl, bs = index.sinks, index.dense_tail, index.block_size
    lens = index.seq_lens.tolist()
    rows = list(zip([0] * len(lens) if index.seq_starts is None else index.seq_starts.tolist(), lens))
    if not rows or any(n - Tl < s + S for s, n in rows):
        return None
    if index.max_blocks:
        if index.id_range is not None:  # the builder's bounds: no need to read the ids
            lo, hi = index.id_range
        elif index.block_idx.numel() <= 4096:  # one tolist (cheaper than aminmax + two item calls)
            ids = index.block_idx.reshape(-1).tolist()
            lo, hi = min(ids), max(ids)
        else:
            lo, hi = (int(x) for x in torch.aminmax(index.block_idx))
        # lo >= 0: no padding slot (a valid index pads exactly the slots beyond block_cnt)
        if lo < 0 or lo * bs < max(s for s, _ in rows) + S or (hi + 1) * bs > min(n for _, n in rows) - Tl:
            return None
    return rows


def _cached(key: tuple, build):
    """Per-thread memo of small constants and reusable buffers (bounded; contexts grow K_max)."""
    memo = getattr(_LOCAL, "memo", None)
    if memo is None:
        memo = _LOCAL.memo = {}
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= _MAX_ENTRIES:
            memo.clear()
        hit = memo[key] = build()
    return hit


def _id_buffers(B: int, H: int, R: int, K: int, F: int, bs: int, steps: tuple[int, int, int]):
    """Row-id buffer ``(B*H*R*V,)`` for ``R`` repeats of each (row, KV head), its sink/tail and
    block views, and the matching constant offsets (see `clean_row_ids`)."""
    sb, sh, st = steps
    V = F + K * bs
    buf = torch.empty(B, H, R, V, dtype=torch.long)
    pair = torch.arange(B)[:, None, None, None] * sb + torch.arange(H)[:, None, None] * sh  # (B, H, 1, 1)
    return (buf.view(-1), buf[..., :F], buf[..., F:].view(B, H, R, K, bs),
            pair.expand(B, H, R, 1).contiguous(), (pair[..., None] + torch.arange(bs) * st).expand(B, H, R, 1, bs).contiguous())


def clean_row_ids(index: SparseIndex, rows: list[tuple[int, int]], steps: tuple[int, int, int],
                  repeat: int = 1, tag: str = "k") -> torch.Tensor:
    """Row ids (into a ``(rows, D)`` view of the cache) of every slot of a clean index.

    Parameters
    ----------
    rows : list of (seq_start, seq_len)
        From `clean_rows`.
    steps : (b_step, h_step, t_step)
        Token ``t`` of (row ``b``, KV head ``h``) is view row ``b * b_step + h * h_step + t * t_step``.
    repeat : int
        Copies of each (row, KV head)'s ids (the G query heads of a group for `embedding_bag`).
    tag : str
        Names the returned buffer: two live results need two tags (same shape and steps).

    Returns
    -------
    torch.Tensor
        int64 ``(B * H_kv * repeat * V,)`` with ``V = sinks + dense_tail + K_max * block_size``,
        slots ordered sinks, tail, blocks. A per-thread buffer: valid until the next call.
    """
    B, H, K = index.block_idx.shape
    S, Tl, bs = index.sinks, index.dense_tail, index.block_size
    F = S + Tl
    flat, fixed_out, block_out, pair, blocks = _cached(("ids", tag, B, H, repeat, K, F, bs, *steps),
                                                       lambda: _id_buffers(B, H, repeat, K, F, bs, steps))
    if F:
        s0, n0 = rows[0]
        if all(row == rows[0] for row in rows):
            # one shared range (no padding): sinks at s0.., tail ending at n0 -> one add, no tensor from Python
            base, is_tail = _cached(("fixed", tag, B, H, repeat, S, Tl, s0, *steps), lambda: (
                (pair + torch.cat([torch.arange(s0, s0 + S), torch.arange(-Tl, 0)]) * steps[2]).contiguous(),
                torch.cat([torch.zeros(S, dtype=torch.long), torch.ones(Tl, dtype=torch.long)])))
            torch.add(base, is_tail, alpha=n0 * steps[2], out=fixed_out)  # tail: (n0 - Tl + j) * t_step
        else:
            fixed = torch.tensor([[[[*range(s, s + S), *range(n - Tl, n)]]] for s, n in rows])  # (B, 1, 1, F)
            torch.add(pair, fixed, alpha=steps[2], out=fixed_out)
    if K:
        # block j, token i sits (j * bs + i) * t_step past its (b, h) base: one broadcast add
        torch.add(blocks, index.block_idx.reshape(B, H, 1, K, 1), alpha=bs * steps[2], out=block_out)
    return flat


def clean_decode_bag(q: torch.Tensor, rows_k: torch.Tensor, steps_k: tuple, rows_v: torch.Tensor, steps_v: tuple,
                     index: SparseIndex, rows: list[tuple[int, int]], scale: float,
                     out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a clean index, fp32 on CPU, with ``P @ V`` read straight from the V cache.

    Parameters
    ----------
    q : torch.Tensor
        fp32 ``(B, H_q, D)``, contiguous.
    rows_k, rows_v : torch.Tensor
        fp32 ``(rows, D)`` views of the caches (``rows_v`` non-overlapping) and their row steps.
    out : torch.Tensor or None
        ``(B, H_q, D)`` fp32 output to write.

    Returns
    -------
    out : fp32 ``(B, H_q, D)``. lse : fp32 ``(B, H_q)``.
    """
    B, H, K = index.block_idx.shape
    H_q, D = q.shape[1], q.shape[2]
    G, N = H_q // H, B * H
    V = index.sinks + index.dense_tail + K * index.block_size
    ids_k = clean_row_ids(index, rows, steps_k)  # (N * V,)
    ids_v = clean_row_ids(index, rows, steps_v, G)  # (N * G * V,)
    k_flat, k_t, zero, offsets = _cached(("bag", N, G, V, D), lambda: _bag_buffers(N, G, V, D))
    torch.index_select(rows_k, 0, ids_k, out=k_flat)  # (N * V, D) selected K rows
    scores = torch.baddbmm(zero, q.view(N, G, D), k_t, alpha=scale)  # (N, G, V)
    m = scores.amax(-1, keepdim=True)  # (N, G, 1); finite: every slot is a real token
    p = scores.sub_(m).exp_()  # unnormalised; the max term is exp(0) = 1
    denom = p.sum(-1, keepdim=True)  # (N, G, 1) >= 1
    o = torch.nn.functional.embedding_bag(ids_v, rows_v, offsets, mode="sum", per_sample_weights=p.view(-1))
    out = torch.div(o.view(B, H_q, D), denom.view(B, H_q, 1), out=out)
    return out, denom.log_().add_(m).view(B, H_q)


def _grow_only(slot: str, numel: int) -> torch.Tensor:
    """Per-thread fp32 workspace of at least ``numel`` elements (a fresh multi-MB CPU tensor per
    call would page-fault on every step). Growing it drops the memo, whose views hold the old one."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.numel() < numel:
        _LOCAL.memo = {}
        buf = bufs[slot] = torch.empty(numel)
    return buf


def _bag_buffers(N: int, G: int, V: int, D: int):
    """K workspace views, the zero score bias and the bag offsets of `clean_decode_bag`."""
    k_flat = _grow_only("k", N * V * D)[: N * V * D].view(N * V, D)
    return (k_flat, k_flat.view(N, V, D).transpose(1, 2), torch.zeros(N, 1, V),
            torch.arange(N * G) * V)


def _fused_buffers(N: int, V: int, D: int):
    """K and V workspace views of `clean_decode_fused`: flat ``(N * V, D)`` and ``(N, 1, V, D)``."""
    k_flat = _grow_only("k", N * V * D)[: N * V * D].view(N * V, D)
    v_flat = _grow_only("v", N * V * D)[: N * V * D].view(N * V, D)
    return k_flat, v_flat, k_flat.view(N, 1, V, D), v_flat.view(N, 1, V, D)


def clean_decode_fused(op, q: torch.Tensor, rows_k: torch.Tensor, steps_k: tuple, rows_v: torch.Tensor,
                       steps_v: tuple, index: SparseIndex, rows: list[tuple[int, int]], scale: float,
                       out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `clean_decode_bag`, but gathers V too and runs torch's fused CPU attention ``op``
    (fewer torch calls; better for small selections, where the fixed cost dominates)."""
    B, H, K = index.block_idx.shape
    H_q, D = q.shape[1], q.shape[2]
    G, N = H_q // H, B * H
    V = index.sinks + index.dense_tail + K * index.block_size
    ids_k = clean_row_ids(index, rows, steps_k)  # (N * V,)
    ids_v = ids_k if steps_v == steps_k else clean_row_ids(index, rows, steps_v, 1, "v")
    k_flat, v_flat, k4, v4 = _cached(("fused", N, V, D), lambda: _fused_buffers(N, V, D))
    torch.index_select(rows_k, 0, ids_k, out=k_flat)
    torch.index_select(rows_v, 0, ids_v, out=v_flat)
    o, lse = op(q.view(N, 1, G, D), k4, v4, scale=scale)  # (N, 1, G, D), (N, 1, G)
    if out is None:
        return o.view(B, H_q, D), lse.view(B, H_q)
    return out.copy_(o.view(B, H_q, D)), lse.view(B, H_q)
