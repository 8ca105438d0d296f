"""Shared pieces of the query-aware selection policies (``quest``, ``tidal``, ``exact_topk``,
``double_sparsity``); a selection policy writes only its ``select`` / ``static_select`` and metadata.

``SelectiveLayer``
    A cache layer that keeps every token in a :class:`kvpress.cache.KVBuffer`, runs plain
    causal attention for prefill (and for any multi-token step), and for a one-token decode
    step asks the subclass for a :class:`~kvpress.kernels.SparseIndex` (:meth:`select`) and
    attends through :func:`kvpress.kernels.sparse_decode`. When the budget covers every row it
    attends densely instead, so ``budget >= length`` is exactly ``full``. A static decode step
    (``plan.static``) makes the same choice over the whole capacity as a mask (:meth:`static_select`)
    and attends it with one masked softmax; a row the budget covers then selects every candidate.
    Per-token metadata (Quest's page bounds, labels, the tail's chunk sums) follows the buffer through one
    protocol: stores, static stores, crops, beam reordering and ``cache_stats``.
``check_selection`` / ``check_budget``
    Validation of the fields every selection policy has.
``select_pages`` / ``page_index``
    Top-k pages per KV head among candidate pages, and the `SparseIndex` that attends them.
``range_topk_index`` / ``range_index``
    The unpadded decode hot path: top-k over one candidate range shared by every row (or
    given ids in that range).
``token_topk_index``
    Sinks + window + top tokens in between, hot path or masked (``double_sparsity``, ``exact_topk``).
``ChunkTail`` (defined in `kvpress.layers`, re-exported here)
    Running per-chunk key / value sums that estimate the attention of the tokens a step leaves
    out (``tail_chunk`` of the selection policies; `kvpress.kernels.sparse_decode_tail`).
``static_slots`` / ``static_token_split`` / ``topk_mask`` / ``static_sparse_attention``
    The static decode step (``plan.static``, a step traced by ``torch.compile``): the same
    selection over the whole preallocated capacity as masks, so every step has the same shapes.

Positions: the buffer stores sequence index ``i`` (left padding included) at slot ``i``; row
``b``'s real tokens are ``[row_start[b], seen)``, its relative position ``r = i - row_start[b]``.
"""

from __future__ import annotations

import torch

from kvpress.attention import dense_causal_attention, masked_group_attention
from kvpress.layers import ChunkTail, DenseLayer
from kvpress.kernels import REDUCTIONS, SparseIndex, select_topk, sparse_decode, topk_ids
from kvpress.registry import check_choice, check_tokens


class SelectiveLayer(DenseLayer):
    """Dense storage (a :class:`DenseLayer`), dense prefill, sparse decode over a per-step selection.

    Subclasses implement :meth:`select` and :meth:`static_select`; per-token metadata derived from
    the stored keys (page bounds, labels) goes in :attr:`metadata`, whose objects this class keeps
    in step with the buffer through one protocol (`ChunkTail`'s): ``append(k, v, start, row_start)``,
    ``static_append(k, v, pos, row_start, capacity)``, ``reserve(capacity, like)``,
    ``truncate(buffer, row_start, cache)``, ``count_stored(length)``, ``state_tensors()``,
    ``batch_select(indices)``.

    Parameters
    ----------
    budget : int
        Tokens attended per row and KV head in a sparse decode step; a step whose rows are all
        at most ``budget`` tokens long attends densely (identical to ``full``).
    tail_chunk : int
        0: a sparse step attends the budget only. ``n > 0``: it also adds a `ChunkTail`
        estimate of the tokens left out, from ``n``-token chunk means.
    backend : str
        ``backend=`` of the sparse decode kernel (`kvpress.kernels.sparse_decode`).
    """

    static_decode = True  # every selection decodes statically when traced (`static_select`)
    verify_as_steps = True  # a verification selects per token as decode does (a new turn attends densely)

    def __init__(self, cache, layer_idx: int, budget: int, tail_chunk: int = 0, backend: str = "auto"):
        super().__init__(cache, layer_idx)
        self.budget = budget
        self.backend = backend
        self.tail = ChunkTail(tail_chunk) if tail_chunk else None
        self.metadata: list = [] if self.tail is None else [self.tail]
        self._validated = False  # sparse_decode checks the first index against the cache only
        self.forward_start = 0  # sequence index of the current forward's first token

    # ------------------------------------------------------------------ the policy's selection
    def select(self, q: torch.Tensor, scaling: float) -> SparseIndex:
        """Index for one decode query ``q`` [B, H_q, D] (the token is stored; `lengths` gives the
        real tokens per row)."""
        raise NotImplementedError

    def static_select(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Static decode step (the token is stored): bool (B, H_kv, C) of the capacity's slots that
        query ``q`` [B, H_q, D] attends exactly, the same choice :meth:`select` makes, from device
        tensors only (``self.cache.plan.end``, ``row_start``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ contract
    def attend(self, q, k_new, v_new, scaling):
        plan = self.cache.plan
        if plan is not None and plan.static:
            return self.static_step(q, k_new, v_new, scaling)
        q_start = self.seen
        self.forward_start = q_start - (0 if plan is None else plan.step)
        n = k_new.shape[2]
        if self.buffer.k is None and self.cache.capacity:  # a planned generation: decode keeps one shape
            self.buffer.reserve(self.cache.capacity, k_new, v_new, exact=True)
        self.buffer.append(k_new, v_new)
        self.seen += n
        self._store_metadata(k_new, v_new, q_start)
        # several tokens, or any piece of an open prompt (a one-token last piece included), attend
        # as a prompt continuation
        if n > 1 or self.cache.prompt_open or self.dense_step():
            return dense_causal_attention(
                q, self.buffer.keys, self.buffer.values, scaling, q_start=q_start, row_start=self.row_start
            )
        return self.decode_step(q, scaling)

    def _store_metadata(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Fold k / v [B, H_kv, n, D] at sequence indices ``start ..`` into the metadata, sized for
        the buffer's capacity (the first static decode step then finds the shapes every later one has)."""
        for part in self.metadata:
            part.reserve(self.buffer.capacity, self.buffer.k)
            part.append(k, v, start, self.row_start)

    def static_step(self, q, k_new, v_new, scaling):
        """One decode token at the plan's device position; the selection and the attention run over
        the whole capacity as masks (no host length in any shape), so a compiled step keeps one graph.
        Selects what the eager step selects: a row the budget covers selects every candidate."""
        plan = self.static_write(k_new, v_new)
        for part in self.metadata:
            part.static_append(k_new, v_new, plan.start, self.row_start, self.buffer.capacity)
        self.count_static_step()
        return self.static_attend_step(q, scaling)

    def static_attend_step(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """The attention of a static step whose token is stored: q [B, H_q, 1, D] -> [B, H_q, 1, D]."""
        return self.static_attend(q, self.static_select(q[:, :, 0], scaling), scaling)

    def static_attend(self, q: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
        """q [B, H_q, 1, D] over the slots ``visible`` (B, H_kv, C) marks (+ the tail estimate of the
        rest); returns [B, H_q, 1, D]."""
        if self.tail is not None:
            return self.tail.static_attend(q, self.buffer.k, self.buffer.v, visible, scaling, self.row_start)
        return static_sparse_attention(q, self.buffer.k, self.buffer.v, visible, scaling)

    def count_tokens(self, n: int) -> None:
        super().count_tokens(n)
        for part in self.metadata:
            part.count_stored(self.seen)

    def decode_step(self, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """One sparse decode step (the token is already stored): q [B, H_q, 1, D] -> [B, H_q, 1, D]."""
        return self.sparse_attend(q, self.select(q[:, :, 0], scaling), scaling)

    def dense_step(self) -> bool:
        """Whether this decode step attends densely: every row fits in the budget."""
        return self.seen - self.min_row_start() <= self.budget

    def sparse_attend(self, q: torch.Tensor, index: SparseIndex, scaling: float) -> torch.Tensor:
        """``sparse_decode`` of q [B, H_q, 1, D] over the buffer (+ the tail estimate); returns [B, H_q, 1, D]."""
        if self.tail is not None:
            out = self.tail.attend(q[:, :, 0], self.buffer, index, scaling, backend=self.backend,
                                   validate_index=not self._validated)
        else:
            out, _ = sparse_decode(q[:, :, 0], self.buffer.k, self.buffer.v, index, scale=scaling,
                                   backend=self.backend, validate_index=not self._validated)
        self._validated = True  # every step builds its index the same way: check the values once
        return out[:, :, None]

    def after_truncate(self) -> None:
        for part in self.metadata:
            part.truncate(self.buffer, self.row_start, self.cache)

    def ingest_prefill(self, k, v):
        start = self.seen
        super().ingest_prefill(k, v)
        self._store_metadata(k, v, start)

    def state_tensors(self):
        out = super().state_tensors()
        for part in self.metadata:
            out.update(part.state_tensors())
        return out

    def batch_select(self, indices):
        super().batch_select(indices)
        for part in self.metadata:
            part.batch_select(indices)

    # ------------------------------------------------------------------ helpers
    def min_row_start(self) -> int:
        """Smallest first-real-token index over the rows (no device sync)."""
        return self.cache.min_row_start

    def lengths(self) -> torch.Tensor:
        """Real tokens per row [B] (long) on the cache's device."""
        row_start = self.row_start
        full = torch.full((self.batch_size,), self.seen, dtype=torch.long, device=self.device)
        return full if row_start is None else full - row_start


def check_selection(policy, reduction: str) -> None:
    """ValueError unless the fields every selection policy has are in range: ``budget``,
    ``sink_tokens``, ``tail_chunk`` and the GQA reduction named by the field ``reduction``."""
    check_tokens("budget", policy.budget, 1)
    check_tokens("sink_tokens", policy.sink_tokens, 0)
    check_choice(reduction, getattr(policy, reduction), REDUCTIONS)
    check_tokens("tail_chunk", policy.tail_chunk, 0)


def check_budget(budget: int, always_on: int, what: str) -> None:
    """ValueError unless ``budget`` covers the always-attended tokens (``always_on``)."""
    if budget < always_on:
        raise ValueError(f"budget={budget} is below the {always_on} always-attended tokens ({what}); "
                         f"allowed: budget >= {always_on}")


def select_pages(scores: torch.Tensor, k: int, candidates: torch.Tensor,
                 row_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` candidate pages per (row, KV head), ids ascending.

    Parameters
    ----------
    scores : torch.Tensor
        float ``(B, H_kv, P)``, higher is better.
    k : int
        Pages to select (at most).
    candidates : torch.Tensor
        bool ``(B, P)``: selectable pages of each row.
    row_k : torch.Tensor, optional
        long ``(B,)``: a smaller per-row limit (at most ``k``).

    Returns
    -------
    ids : torch.Tensor
        int64 ``(B, H_kv, min(k, P))``, valid ids first (ascending), then -1.
    count : torch.Tensor
        int64 ``(B, H_kv)``, ``min(k, row_k, candidates per row)``.
    """
    B, H, P = scores.shape
    k = min(k, P)
    lowest = torch.finfo(torch.float32).min
    s = torch.nan_to_num(scores.float(), nan=lowest, neginf=lowest).clamp(min=lowest)
    s = s.masked_fill(~candidates[:, None, :], float("-inf"))  # (B, H, P)
    ids = torch.topk(s, k, dim=-1).indices  # candidates (finite) rank before the rest
    count = candidates.sum(-1).clamp(max=k)  # (B,)
    if row_k is not None:
        count = torch.minimum(count, row_k)
    count = count[:, None].expand(B, H)  # (B, H)
    slot_ok = torch.arange(k, device=scores.device) < count[..., None]  # (B, H, k)
    ids = torch.where(slot_ok, ids, torch.full_like(ids, P)).sort(dim=-1).values
    return torch.where(slot_ok, ids, torch.full_like(ids, -1)), count


def range_topk_index(scores: torch.Tensor, k: int, lo: int, seq_len: int, *, block_size: int, sinks: int,
                     dense_tail: int) -> SparseIndex:
    """`SparseIndex` of the top-``k`` candidates when every row's candidates are one range.

    The decode hot path of an unpadded batch: ``scores`` (B, H_kv, n) score blocks
    ``lo .. lo + n - 1`` (tokens when ``block_size`` is 1), the same for every row, so no mask is
    needed (`range_index` builds the index).
    """
    return range_index(topk_ids(scores, k), lo, seq_len, scores.shape[-1], block_size=block_size, sinks=sinks,
                       dense_tail=dense_tail)


def range_index(ids: torch.Tensor, lo: int, seq_len: int, n: int, *, block_size: int, sinks: int,
                dense_tail: int) -> SparseIndex:
    """`SparseIndex` attending candidates ``ids`` (B, H_kv, k), distinct, in ``[0, n)``, of blocks ``lo ..``.

    Ids come out ascending (the kernel's gather then walks the cache forward), as int32, with a
    trusted ``id_range`` ``(lo, lo + n - 1)`` so the kernel need not read them.
    """
    B, H, k = ids.shape
    top = ids.sort(dim=-1).values
    out = torch.add(top, lo, out=torch.empty(top.shape, dtype=torch.int32, device=ids.device))
    count = torch.full((B, H), k, dtype=torch.int32, device=ids.device)
    lens = torch.full((B,), seq_len, dtype=torch.int32, device=ids.device)
    return SparseIndex(block_size, out, count, lens, None, sinks, dense_tail, id_range=(lo, lo + n - 1))


def token_topk_index(scores_for, batch: int, seq_len: int, row_start: torch.Tensor | None, device, *,
                     keep: int, sinks: int, window: int) -> SparseIndex:
    """Token-level index: ``sinks`` first tokens + ``window`` most recent + the ``keep`` best in between.

    ``scores_for(lo, hi, mask)`` returns ``(B, H_kv, n)`` token scores: of tokens ``[lo, hi)``
    when ``mask`` is None (the unpadded hot path: one candidate range for every row, no masks,
    `range_topk_index`), else of all ``seq_len`` tokens with ``mask`` (B, T) marking each row's
    candidates ``[row_start + sinks, seq_len - window)`` (left padding, or rows shorter than the
    budget). Used by ``double_sparsity`` (label scores), ``exact_topk`` (exact scores) and ``tidal``
    (its selection layer's probabilities).
    """
    lo, hi = sinks, seq_len - window  # candidates: between the sinks and the window
    if row_start is None and 0 < keep <= hi - lo:
        return range_topk_index(scores_for(lo, hi, None), keep, lo, seq_len, block_size=1, sinks=sinks,
                                dense_tail=window)
    start = torch.zeros(batch, dtype=torch.long, device=device) if row_start is None else row_start
    pos = torch.arange(seq_len, device=device)[None, :]  # (1, T)
    mask = (pos >= start[:, None] + sinks) & (pos < hi)  # (B, T)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    return select_topk(scores_for(0, seq_len, mask), keep, block_size=1, seq_lens=seq_lens,
                       seq_starts=start.to(torch.int32), sinks=sinks, dense_tail=window)


def page_index(ids: torch.Tensor, count: torch.Tensor, page_size: int, seq_len: int,
               row_start: torch.Tensor | None, *, sinks: int, dense_tail: int) -> SparseIndex:
    """`SparseIndex` attending relative pages ``ids`` plus sinks and the dense tail.

    Parameters
    ----------
    ids, count : torch.Tensor
        From :func:`select_pages`; page ``j`` of row ``b`` starts at sequence index
        ``row_start[b] + j * page_size``.
    seq_len : int
        Tokens in the buffer (the same for every row).
    row_start : torch.Tensor or None
        long ``(B,)`` first real token per row.

    Notes
    -----
    With no left padding (or padding that keeps pages aligned) the kernel reads whole blocks
    of ``page_size`` tokens; otherwise the pages are expanded to tokens (``block_size=1``).
    """
    B, H, k = ids.shape
    lens = torch.full((B,), seq_len, dtype=torch.int32, device=ids.device)
    starts = None if row_start is None else row_start.to(torch.int32)
    aligned = row_start is None or not bool((row_start % page_size).any())
    if aligned:
        shift = 0 if row_start is None else (row_start // page_size)[:, None, None]
        blocks = torch.where(ids >= 0, ids + shift, ids)
        return SparseIndex(page_size, blocks.to(torch.int32), count.to(torch.int32), lens, starts,
                           sinks, dense_tail)
    first = ids * page_size + row_start[:, None, None]  # (B, H, k) first token of each page
    tokens = (first[..., None] + torch.arange(page_size, device=ids.device)).reshape(B, H, k * page_size)
    tokens = torch.where(ids.repeat_interleave(page_size, dim=-1) >= 0, tokens, torch.full_like(tokens, -1))
    return SparseIndex(1, tokens.to(torch.int32), (count * page_size).to(torch.int32), lens, starts,
                       sinks, dense_tail)


def static_slots(capacity: int, end: torch.Tensor, row_start: torch.Tensor | None, device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots of a static decode step: ``(slot, rel, real)``.

    ``slot`` (C,) long: sequence index of each capacity slot; ``rel`` (B or 1, C) long: its position
    relative to the row's first real token; ``real`` (B or 1, C) bool: slots holding a real token
    (``0 <= rel`` and ``slot < end``, ``end`` the plan's [1] device tensor)."""
    slot = torch.arange(capacity, device=device)
    rel = slot[None, :] if row_start is None else slot[None, :] - row_start[:, None]
    return slot, rel, (rel >= 0) & (slot < end)[None, :]


def static_token_split(capacity: int, end: torch.Tensor, row_start: torch.Tensor | None, batch: int, device, *,
                       sinks: int, recent: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A static decode step's slots as a token selection splits them: ``(real, always, candidates)``.

    ``real`` (B or 1, C) as :func:`static_slots`; ``always`` (B or 1, C): the real slots among a
    row's first ``sinks`` tokens or the ``recent`` last (attended every step); ``candidates`` (B, C):
    the other real slots, among which the selection chooses.
    """
    slot, rel, real = static_slots(capacity, end, row_start, device)
    sink, last = rel < sinks, slot[None, :] >= end - recent
    return real, real & (sink | last), (real & ~sink & ~last).expand(batch, capacity)


def top_entries(scores: torch.Tensor, k: int, *, lowest_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the ``k`` largest entries along the last dim, largest first.

    ``lowest_first``: equal scores rank by index, the lowest first (a stable sort), as the native
    CPU kernels choose (`kvpress.kernels.native.label_select`); else ``torch.topk``'s order."""
    if not lowest_first:
        return torch.topk(scores, k, dim=-1)
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def topk_mask(scores: torch.Tensor, k: int, candidates: torch.Tensor, row_k: torch.Tensor | None = None, *,
              lowest_first: bool = False) -> torch.Tensor:
    """bool mask of the top-``k`` candidates per (row, KV head): what :func:`select_pages` and
    `kvpress.kernels.select_topk` choose, as a mask over all of ``scores``' entries (fixed shape).

    ``scores`` float (B, H_kv, N), ``candidates`` bool (B or 1, N), ``row_k`` long (B,) a smaller
    per-row limit. NaN / -inf scores of candidates rank below every finite one, as there; ties as
    :func:`top_entries` breaks them.
    """
    B, H, N = scores.shape
    k = min(k, N)
    if k == 0:
        return torch.zeros(B, H, N, dtype=torch.bool, device=scores.device)
    lowest = torch.finfo(torch.float32).min
    s = torch.nan_to_num(scores.float(), nan=lowest, neginf=lowest).clamp(min=lowest)
    s = s.masked_fill(~candidates[:, None, :], float("-inf"))
    values, indices = top_entries(s, k, lowest_first=lowest_first)  # sorted: the first row_k are the top row_k
    take = values > float("-inf")
    if row_k is not None:
        take = take & (torch.arange(k, device=scores.device) < row_k[:, None, None])
    return torch.zeros(B, H, N, dtype=torch.bool, device=scores.device).scatter_(2, indices, take)


def static_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                            scaling: float) -> torch.Tensor:
    """One query per head q [B, H_q, 1, D] over the slots of k / v [B, H_kv, C, D] that ``visible``
    (B, H_kv, C) marks for each KV head (every row and head sees one at least); returns [B, H_q, 1, D]."""
    B, H_q, _, D = q.shape
    H = k.shape[1]
    qg = q.view(B, H, H_q // H, 1, D)  # (B, H_kv, G, 1, D)
    return masked_group_attention(qg, k, v, visible[:, :, None, :], scaling).view(B, H_q, 1, D)
