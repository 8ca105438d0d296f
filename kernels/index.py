"""`SparseIndex`: the one selection format every sparse-decode path consumes.

A decode step attends, per (batch row, KV head), to the union of

* ``sinks`` tokens counted from the row's first valid token ``seq_start``,
* ``dense_tail`` most recent tokens ending at ``seq_len``,
* the tokens of the selected blocks (block ``j`` covers absolute positions
  ``[j * block_size, (j + 1) * block_size)``),

restricted to ``[seq_start, seq_len)`` and deduplicated: a token counts once even when it is
both a sink/tail token and inside a selected block.  Every backend and `num_attended` use the
same decomposition, which makes the deduplication exact and cheap::

    sink_end   = min(seq_start + sinks, seq_len)
    tail_start = max(seq_len - dense_tail, sink_end)
    attended   = [seq_start, sink_end)  U  [tail_start, seq_len)
                 U  (selected blocks  n  [sink_end, tail_start))
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ALLOWED_BLOCK_SIZES = (1, 8, 16, 32, 64)


def _check_int(name: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _row_ranges(seq_lens: torch.Tensor, seq_starts: torch.Tensor | None, sinks: int,
                dense_tail: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(seq_start, sink_end, tail_start)`` as int64 tensors of shape (B,)."""
    lens = seq_lens.long()
    starts = torch.zeros_like(lens) if seq_starts is None else seq_starts.long()
    sink_end = torch.minimum(starts + sinks, lens)
    tail_start = torch.maximum(lens - dense_tail, sink_end)
    return starts, sink_end, tail_start


@dataclass(frozen=True, eq=False)
class SparseIndex:
    """Which KV tokens a decode step attends to, per batch row and KV head.

    Parameters
    ----------
    block_size : int
        Tokens per logical block, one of ``ALLOWED_BLOCK_SIZES`` = (1, 8, 16, 32, 64).
    block_idx : torch.Tensor
        int32 ``(B, H_kv, K_max)``. Selected logical block ids; entry ``k`` is valid for
        ``k < block_cnt[b, h]`` and is -1 otherwise. Valid ids are distinct within a row.
    block_cnt : torch.Tensor
        int32 ``(B, H_kv)``. Number of valid entries of ``block_idx``.
    seq_lens : torch.Tensor
        int32 ``(B,)``. Tokens present in the cache per row; positions ``>= seq_len`` are
        never attended.
    seq_starts : torch.Tensor or None
        int32 ``(B,)``. First valid token per row (left padding); positions before it are
        never attended. ``None`` means 0 for every row.
    sinks : int
        Always-attended first tokens, counted from ``seq_start``.
    dense_tail : int
        Always-attended most recent tokens, ending at ``seq_len``.
    id_range : (int, int) or None
        Optional trusted hint from the builder: inclusive bounds that *every* ``block_idx``
        entry (padding slots included) lies in. With it the CPU torch backend decides whether
        the index needs a mask without reading the ids (a hot-loop saving); `validate` checks it.

    Notes
    -----
    ``__post_init__`` checks types, dtypes, shapes and devices (no device sync);
    `validate` additionally checks the values (it syncs, so call it in tests and at plan time,
    not per layer).
    """

    block_size: int
    block_idx: torch.Tensor
    block_cnt: torch.Tensor
    seq_lens: torch.Tensor
    seq_starts: torch.Tensor | None = None
    sinks: int = 0
    dense_tail: int = 0
    id_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.block_size not in ALLOWED_BLOCK_SIZES or isinstance(self.block_size, bool):
            raise ValueError(f"block_size must be one of {ALLOWED_BLOCK_SIZES}, got {self.block_size!r}")
        _check_int("sinks", self.sinks)
        _check_int("dense_tail", self.dense_tail)
        r = self.id_range
        if r is not None and not (isinstance(r, tuple) and len(r) == 2 and r[0] <= r[1]
                                  and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise ValueError(f"id_range must be None or a tuple of ints (lo, hi) with lo <= hi, got {r!r}")
        named = {"block_idx": (self.block_idx, 3), "block_cnt": (self.block_cnt, 2),
                 "seq_lens": (self.seq_lens, 1)}
        if self.seq_starts is not None:
            named["seq_starts"] = (self.seq_starts, 1)
        for name, (t, ndim) in named.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
            if t.dim() != ndim:
                raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
            if t.device != self.block_idx.device:
                raise ValueError(f"{name} is on {t.device} but block_idx is on {self.block_idx.device}; "
                                 "all index tensors must share one device")
        B, H_kv, _ = self.block_idx.shape
        if tuple(self.block_cnt.shape) != (B, H_kv):
            raise ValueError(f"block_cnt must have shape (B, H_kv) = {(B, H_kv)}, got {tuple(self.block_cnt.shape)}")
        for name in ("seq_lens", "seq_starts"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B,):
                raise ValueError(f"{name} must have shape (B,) = {(B,)}, got {tuple(t.shape)}")

    # ------------------------------------------------------------------ shape helpers
    @property
    def batch_size(self) -> int:
        return self.block_idx.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.block_idx.shape[1]

    @property
    def max_blocks(self) -> int:
        """K_max, the padded number of block slots per (row, KV head)."""
        return self.block_idx.shape[2]

    @property
    def device(self) -> torch.device:
        return self.block_idx.device

    def to(self, device) -> "SparseIndex":
        """Copy of this index with every tensor on ``device``."""
        starts = None if self.seq_starts is None else self.seq_starts.to(device)
        return SparseIndex(self.block_size, self.block_idx.to(device), self.block_cnt.to(device),
                           self.seq_lens.to(device), starts, self.sinks, self.dense_tail, self.id_range)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def dense(cls, seq_lens: torch.Tensor, num_kv_heads: int, *, block_size: int = 64,
              seq_starts: torch.Tensor | None = None, capacity: int | None = None) -> "SparseIndex":
        """Index that selects every token of ``[seq_start, seq_len)`` of every row.

        Parameters
        ----------
        seq_lens : torch.Tensor
            int ``(B,)`` tokens per row.
        num_kv_heads : int
            H_kv.
        block_size : int
            One of ``ALLOWED_BLOCK_SIZES``.
        seq_starts : torch.Tensor, optional
            int ``(B,)`` first valid token per row.
        capacity : int, optional
            Cache capacity T_cap. When given, K_max = ceil(T_cap / block_size) and no device
            sync is needed; otherwise K_max comes from ``seq_lens.max()``.

        Returns
        -------
        SparseIndex
            Row ``b`` selects blocks ``seq_start // block_size .. ceil(seq_len / block_size) - 1``.
        """
        _check_int("num_kv_heads", num_kv_heads, 1)
        if block_size not in ALLOWED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {ALLOWED_BLOCK_SIZES}, got {block_size!r}")
        lens = seq_lens.to(torch.int64)
        starts = torch.zeros_like(lens) if seq_starts is None else seq_starts.to(torch.int64)
        first = starts // block_size  # (B,)
        end = (lens + block_size - 1) // block_size  # (B,) one past the last block
        cnt = (end - first).clamp(min=0)
        if capacity is None:
            k_max = int(end.max().item()) if lens.numel() else 0
        else:
            _check_int("capacity", capacity)
            k_max = -(-capacity // block_size)
        slots = torch.arange(k_max, device=lens.device)  # (K_max,)
        ids = first[:, None] + slots[None, :]  # (B, K_max)
        ids = torch.where(slots[None, :] < cnt[:, None], ids, torch.full_like(ids, -1))
        B = lens.shape[0]
        block_idx = ids[:, None, :].expand(B, num_kv_heads, k_max).to(torch.int32).contiguous()
        block_cnt = cnt[:, None].expand(B, num_kv_heads).to(torch.int32).contiguous()
        return cls(block_size, block_idx, block_cnt, seq_lens.to(torch.int32),
                   None if seq_starts is None else seq_starts.to(torch.int32))

    # ------------------------------------------------------------------ accounting
    def row_ranges(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(seq_start, sink_end, tail_start)``, each int64 ``(B,)`` (see module docstring)."""
        return _row_ranges(self.seq_lens, self.seq_starts, self.sinks, self.dense_tail)

    def num_attended(self) -> torch.Tensor:
        """Exact number of distinct tokens attended per (row, KV head).

        Returns
        -------
        torch.Tensor
            int32 ``(B, H_kv)``: sinks + tail + the selected-block tokens that lie in
            ``[sink_end, tail_start)``, so overlaps are counted once.
        """
        starts, sink_end, tail_start = self.row_ranges()  # (B,) each
        fixed = (sink_end - starts) + (self.seq_lens.long() - tail_start)  # (B,)
        bs = self.block_size
        ids = self.block_idx.long()  # (B, H_kv, K_max)
        lo = torch.maximum(ids * bs, sink_end[:, None, None])
        hi = torch.minimum((ids + 1) * bs, tail_start[:, None, None])
        per_block = (hi - lo).clamp(min=0) * (ids >= 0)  # (B, H_kv, K_max)
        return (fixed[:, None] + per_block.sum(-1)).to(torch.int32)

    def token_mask(self, capacity: int) -> torch.Tensor:
        """Dense boolean mask of attended tokens, ``(B, H_kv, capacity)``.

        Simple by design (the reference path and the tests rely on it); costs O(capacity).
        """
        _check_int("capacity", capacity)
        B, H_kv, K_max = self.block_idx.shape
        bs = self.block_size
        n_blocks = -(-capacity // bs)
        ids = self.block_idx.long()  # (B, H_kv, K_max)
        valid = ids >= 0
        sel = torch.zeros(B, H_kv, n_blocks + 1, dtype=torch.bool, device=ids.device)
        # invalid slots write into the spare column n_blocks, which is dropped below
        sel.scatter_(2, torch.where(valid, ids, torch.full_like(ids, n_blocks)), True)
        sel = sel[:, :, :n_blocks].repeat_interleave(bs, dim=2)[:, :, :capacity]  # (B, H_kv, T)
        starts, sink_end, tail_start = self.row_ranges()
        pos = torch.arange(capacity, device=ids.device)[None, :]  # (1, T)
        lens = self.seq_lens.long()[:, None]
        in_row = (pos >= starts[:, None]) & (pos < lens)  # (B, T)
        always = (pos < sink_end[:, None]) | (pos >= tail_start[:, None])  # (B, T)
        return in_row[:, None, :] & (always[:, None, :] | sel)

    # ------------------------------------------------------------------ checks
    def validate(self, *, num_kv_heads: int | None = None, capacity: int | None = None,
                 batch_size: int | None = None) -> "SparseIndex":
        """Check the values (syncs with the device). Returns ``self`` for chaining.

        Raises
        ------
        ValueError
            On a shape mismatch with the given sizes, counts outside ``[0, K_max]``, valid ids
            outside ``[0, ceil(capacity / block_size))`` (or negative without ``capacity``),
            padding slots not -1, repeated ids in a row, ``seq_starts`` outside
            ``[0, seq_len]``, ``seq_lens`` outside ``[0, capacity]`` or ids outside ``id_range``.
        """
        B, H_kv, K_max = self.block_idx.shape
        if batch_size is not None and B != batch_size:
            raise ValueError(f"index batch size {B} != expected batch size {batch_size}")
        if num_kv_heads is not None and H_kv != num_kv_heads:
            raise ValueError(f"index has {H_kv} KV heads, expected num_kv_heads={num_kv_heads}")
        cnt = self.block_cnt.long()
        if B * H_kv and (cnt.min() < 0 or cnt.max() > K_max):
            raise ValueError(f"block_cnt must lie in [0, K_max={K_max}], got range "
                             f"[{int(cnt.min())}, {int(cnt.max())}]")
        lens = self.seq_lens.long()
        if B and lens.min() < 0:
            raise ValueError("seq_lens must be >= 0")
        if capacity is not None and B and lens.max() > capacity:
            raise ValueError(f"seq_lens must be <= capacity={capacity}, got max {int(lens.max())}")
        if self.seq_starts is not None and B:
            st = self.seq_starts.long()
            if st.min() < 0 or (st > lens).any():
                raise ValueError("seq_starts must lie in [0, seq_len] for every row")
        if K_max and self.id_range is not None:
            lo, hi = self.id_range
            if bool((self.block_idx < lo).any()) or bool((self.block_idx > hi).any()):
                raise ValueError(f"block_idx entries (padding included) must lie in id_range={self.id_range}")
        if K_max:
            ids = self.block_idx.long()
            slot_valid = torch.arange(K_max, device=ids.device) < cnt[..., None]  # (B, H_kv, K_max)
            if (ids[~slot_valid] != -1).any():
                raise ValueError("block_idx slots at or beyond block_cnt must be -1")
            valid_ids = ids[slot_valid]
            if valid_ids.numel():
                hi = None if capacity is None else -(-capacity // self.block_size)
                if valid_ids.min() < 0 or (hi is not None and valid_ids.max() >= hi):
                    allowed = "[0, inf)" if hi is None else f"[0, {hi})"
                    raise ValueError(f"valid block ids must lie in {allowed} "
                                     f"(block_size={self.block_size}, capacity={capacity}), got range "
                                     f"[{int(valid_ids.min())}, {int(valid_ids.max())}]")
                big = torch.where(slot_valid, ids, torch.full_like(ids, -1))
                srt = big.sort(dim=-1).values
                if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
                    raise ValueError("block ids must be distinct within each (row, KV head)")
        return self


def topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last dim of ``scores``, in no set order.

    The same set as ``torch.topk(scores, k, dim=-1, sorted=False).indices`` (ties broken either
    way; NaN ranks above everything, as in ``torch.topk``). For fp32 / fp64 CPU tensors it runs
    numpy's introselect (``argpartition``): about 3.5x faster than ``torch.topk`` on the decode
    hot path's 3 x 8k scores (68 vs 250 us, torch 2.13, one thread, whatever ``k``), which
    every query-aware policy pays per layer and step. Returns int64 ``(..., k)``.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be in [0, {n}] (the last dim of scores {tuple(scores.shape)})")
    if (scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64)
            and not scores.requires_grad and 0 < k < n):
        return torch.from_numpy(np.argpartition(scores.numpy(), n - k, axis=-1)[..., n - k:])
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def select_topk(scores: torch.Tensor, budget_blocks: int, *, block_size: int,
                seq_lens: torch.Tensor, seq_starts: torch.Tensor | None = None,
                sinks: int = 0, dense_tail: int = 0, sort: bool = True) -> SparseIndex:
    """Build a `SparseIndex` from per-block scores by per-KV-head top-k.

    Blocks that cannot add a token are masked before the top-k: blocks outside
    ``[seq_start, seq_len)`` and blocks entirely covered by the sinks or the dense tail (those
    tokens are attended anyway, so selecting them would waste budget).

    Parameters
    ----------
    scores : torch.Tensor
        float ``(B, H_kv, N_blocks)``, higher is better; already reduced over the GQA group
        (see `kvpress.kernels.scores`). NaN and -inf scores still rank, below every finite one.
    budget_blocks : int
        Maximum number of blocks selected per (row, KV head); K_max = min(budget, N_blocks).
    block_size : int
        One of ``ALLOWED_BLOCK_SIZES``; block ``j`` covers ``[j * block_size, (j+1) * block_size)``.
    seq_lens, seq_starts : torch.Tensor
        int ``(B,)``, as in `SparseIndex`.
    sinks, dense_tail : int
        As in `SparseIndex`.
    sort : bool
        Sort the selected ids ascending (sequential memory access in the kernels).

    Returns
    -------
    SparseIndex
        ``block_cnt = min(budget_blocks, number of useful blocks)``.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
        raise ValueError(f"scores must be a tensor of shape (B, H_kv, N_blocks), got "
                         f"{getattr(scores, 'shape', type(scores).__name__)}")
    _check_int("budget_blocks", budget_blocks)
    _check_int("sinks", sinks)
    _check_int("dense_tail", dense_tail)
    if block_size not in ALLOWED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {ALLOWED_BLOCK_SIZES}, got {block_size!r}")
    B, H_kv, N = scores.shape
    if tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens must have shape (B,) = {(B,)}, got {tuple(seq_lens.shape)}")
    _, sink_end, tail_start = _row_ranges(seq_lens, seq_starts, sinks, dense_tail)
    j = torch.arange(N, device=scores.device)  # (N,)
    # a block is useful when it meets [sink_end, tail_start)
    useful = (j[None, :] * block_size < tail_start[:, None]) & ((j[None, :] + 1) * block_size > sink_end[:, None])
    s = scores.float()
    lowest = torch.finfo(torch.float32).min
    s = torch.nan_to_num(s, nan=lowest, neginf=lowest).clamp(min=lowest)
    s = torch.where(useful[:, None, :], s, torch.full_like(s, float("-inf")))  # (B, H_kv, N)
    k = min(budget_blocks, N)
    top = torch.topk(s, k, dim=-1)
    cnt = useful.sum(-1).clamp(max=k)[:, None].expand(B, H_kv)  # (B, H_kv)
    ids = top.indices
    slot_valid = torch.arange(k, device=scores.device) < cnt[..., None]  # (B, H_kv, K)
    if sort:
        big = torch.where(slot_valid, ids, torch.full_like(ids, N))
        ids = big.sort(dim=-1).values
    ids = torch.where(slot_valid, ids, torch.full_like(ids, -1))
    return SparseIndex(block_size, ids.to(torch.int32).contiguous(), cnt.to(torch.int32).contiguous(),
                       seq_lens.to(torch.int32), None if seq_starts is None else seq_starts.to(torch.int32),
                       sinks, dense_tail)
