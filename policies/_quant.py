"""Shared cache layer of the quantization policies (kivi, zipcache, gear): a full-precision
window of recent tokens in front of a packed low-bit store.

Every step the new tokens enter the window; once the window holds ``residual_length +
flush_unit`` tokens or more, its oldest ``flush_unit``-multiples are handed to the subclass's
:meth:`QuantWindowLayer._flush`, which quantizes and packs them. Attention of a step = one
softmax over [packed tokens | window + new tokens]: the subclass scores its packed tokens and
applies the probabilities to them straight from the codes (``kvpress.kernels.quant``), so a
decode step never rebuilds a full-precision copy of the cache. Prefill is plain causal
attention over the unquantized prompt (as KIVI does), then the prompt is stored like any other
tokens. A later forward of ``DEQUANT_MIN_QUERIES`` tokens or more (a prompt piece, a new turn)
amortises one transient fp32 copy of the packed tokens over its queries and runs SDPA.

A subclass with ``static_decode = True`` (kivi, gear, zipcache) also has a static decode step for
``torch.compile`` (``_quant_static``, through the layer's store hooks): with a planned
capacity the window (``residual_length + flush_unit`` slots at most) and the packed store (every
token the window can flush) are preallocated after each eager forward, the step writes and reads
at device positions, and the flush is committed by a device mask, so flushing and non-flushing
steps are one graph. Its attention dequantizes the whole store in torch (no native or Triton
launch) and is the eager path's math up to rounding.
"""
from __future__ import annotations

import torch

from kvpress.attention import dense_causal_attention
from kvpress.cache import CacheLayer
from kvpress.kernels import native
from kvpress.kernels.backend import fused_quant_backend, quant_step_backend
from kvpress.kernels.merge import merge_states
from kvpress.kernels.rows import attend_rows
from kvpress.plan import ForwardKind

from ._quant_forward import attend_over_store, blocked_attend, dequantized
from ._quant_rows import RowSplit
from ._quant_static import reserve_planned, static_attend, static_sizes
from ._quant_window import QuantWindow
from ._rotation import value_basis

# A forward of at least this many tokens (a prompt piece, a new turn) dequantizes the packed store
# once into a transient fp32 copy and attends through SDPA; shorter ones (decode steps, short
# verifications) read the codes directly. From 16 tokens the copy is the faster path for all three
# quantizers on the 2-core CPU at 8k, at 8 only for gear (`python -m kvpress.evals.bench_quant_forward`).
# See `QuantWindowLayer.attend`.
DEQUANT_MIN_QUERIES = 16


def attend_masked(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``qg`` fp32 (B, H, G, D) over ``k`` / ``v`` (B, H, n, D) but the keys ``hidden`` (bool,
    broadcastable to (B, H, G, n)): fp32 output (B, H, G, D), zero where every key is hidden, and
    log-sum-exp (B, H, G), -inf there (a part of a decode step, merged by `merge_states`)."""
    s = qg @ k.float().transpose(-1, -2) * scaling  # (B, H, G, n)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = s.logsumexp(-1)
    return torch.nan_to_num((s - lse[..., None]).exp()) @ v.float(), lse


class QuantWindowLayer(QuantWindow, CacheLayer):
    """fp window + packed store. Subclasses implement ``_flush``, ``_quant_scores``,
    ``_quant_output`` and ``_quant_tensors`` (and may override ``_after_attend`` / ``_prefill``).

    Window storage ``k_win`` / ``v_win`` (B, H_kv, capacity, D) in the model dtype. The capacity
    grows with the tokens the window holds (`window_slots`: 128 slots, doubled as needed) up to
    ``residual_length + flush_unit``, the most it holds between flushes (more only transiently,
    during a long prefill, dropped at its flush).
    ``n_quant`` tokens (sequence indices ``0 .. n_quant - 1``) have been flushed; the window
    holds sequence indices ``n_quant .. seen - 1``.
    """

    packed_in_sequence_order = True  # column i of _quant_scores is token i (benchmarks read K/V back)
    # Rollback by truncating the full-precision window: with past recording on, a forward's flush
    # waits for the crop (`end_record`), so the tokens it takes back are still in the window
    # (`truncatable`); the flush then packs exactly what a forward without them would have packed.
    rollback = "truncate"
    # score-sized temporaries a subclass's `_quant_scores` / `_quant_output` hold per block (GEAR's
    # rank-wide corrections): the query blocks of a multi-token forward shrink by this factor
    score_block_factor = 1
    # Whether a flush can be taken back (`_flush_state` / `_unflush`): the packed store only grows
    # at ``n_quant``. Then assisted decoding's verification flushes where decode steps would
    # (`_attend_across_flushes`), so it keeps plain decoding's tokens; otherwise its tokens are
    # all read unquantized and its flush waits for `crop`.
    undoable_flush = False
    # Whether the one-token decode step has a static path (`_quant_static.static_attend`): a
    # subclass that implements `_store_slots`, `_reserve_store`, `_static_packed` and `_static_flush` says so
    static_decode = False

    def __init__(self, cache, layer_idx: int, residual_length: int, flush_unit: int, rotate_values: bool = False):
        super().__init__(cache, layer_idx)
        self.residual_length = residual_length
        self.flush_unit = flush_unit
        self.rotate_values = rotate_values
        self.v_basis = None  # (D, D) fp32 orthonormal, with rotate_values: values are stored as v @ v_basis
        self.k_win = self.v_win = None
        self.win_len = 0
        self.n_quant = 0
        self._recorded = 0  # tokens of the latest forward while its flush waits for `crop`
        self._record_from = 0  # ``seen`` before that forward
        self._undo: list[tuple] = []  # flushes inside the recorded forward: (after step, n_quant, k, v, state)
        # a left-padded batch: one layer per row (`RowSplit`), so that each row's groups, chunks and
        # flushes are counted from its own first real token, as in its batch-1 run
        self.by_row: RowSplit | None = None

    def step_int_paths(self) -> tuple[str, ...]:
        if self.by_row is None:
            return self.step_ints
        return self.step_ints + tuple(f"by_row.layers[{j}].{name}" for j, row in enumerate(self.by_row.layers)
                                      if row is not None for name in row.step_int_paths())

    def _row_layer(self, cache) -> "QuantWindowLayer":
        """A fresh layer of this policy on ``cache`` (a row of a padded batch, `RowSplit`)."""
        raise NotImplementedError

    def _split_rows(self, batch: int) -> bool:
        """Whether this layer hands its calls to per-row layers: from the first forward of a
        left-padded batch on."""
        if self.by_row is None and self.seen == 0 and self.row_start is not None:
            self.by_row = RowSplit(self, batch)
        return self.by_row is not None

    # ------------------------------------------------------------------ subclass hooks
    def _flush(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Quantize tokens at sequence indices ``start .. start + n - 1``; k, v (B, H_kv, n, D)."""
        raise NotImplementedError

    def _quant_scores(self, qg: torch.Tensor, scaling: float) -> torch.Tensor:
        """Scaled scores (B, H_kv, M, N) of query rows ``qg`` (B, H_kv, M, D) fp32 against the N
        packed tokens, -inf for padding."""
        raise NotImplementedError

    def _quant_output(self, p: torch.Tensor) -> torch.Tensor:
        """``p`` (B, H_kv, M, N) applied to the packed values: fp32 (B, H_kv, M, D)."""
        raise NotImplementedError

    def _quant_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _dequantize_into(self, k_out: torch.Tensor, v_out: torch.Tensor) -> bool:
        """Write the N packed tokens' keys and values, as `_quant_scores` / `_quant_output` read
        them, into ``k_out`` / ``v_out`` fp32 (B, H_kv, N, D); return False if this layer cannot
        (then multi-token forwards read the codes). Each row's left-padding tokens go to its first
        columns, so column ``c < row_start`` is hidden as in sequence order; the other tokens may
        come in any order, since every packed token precedes every query."""
        return False

    def _flush_state(self):
        """What a flush changes besides the packed store's length (taken before an undoable flush)."""
        return None

    def _unflush(self, state) -> None:
        """Take back the latest flush's side state (`_flush_state`); ``n_quant`` is reset by the caller."""

    # static decode hooks (`_quant_static`), with ``static_decode = True``
    def _store_slots(self) -> int:
        """Tokens the packed store holds room for (0 before it exists)."""
        raise NotImplementedError

    def _reserve_store(self, like_k: torch.Tensor, like_v: torch.Tensor, slots: int) -> None:
        """Reallocate the packed store (zeroed where unused) to ``slots`` tokens, a multiple of
        ``flush_unit`` and at least ``n_quant``."""
        raise NotImplementedError

    def _static_packed(self, n: torch.Tensor) -> list:
        """The packed part of a static step: ``[(k, v, visible)]`` with ``k`` / ``v`` fp32
        (B, H, N, D) dequantized over the whole store and ``visible`` bool, broadcastable to
        (B, H, G, N), True for the ``n`` ([1] long) tokens packed so far (`decode_over_parts`)."""
        raise NotImplementedError

    def _static_flush(self, n: torch.Tensor, due: torch.Tensor) -> None:
        """Pack the window's first ``flush_unit`` tokens at sequence indices ``n ..`` ([1] long)
        where ``due`` ([1] bool); the store is left as it was where not."""
        raise NotImplementedError

    def _static_after_attend(self, q: torch.Tensor, lse: torch.Tensor, pos: torch.Tensor, scaling: float) -> None:
        """`_after_attend` of a static step (``pos``: the query's sequence index, [1] long)."""

    def _lse_rows(self, q_start: int, T: int) -> torch.Tensor | None:
        """bool (T,): the rows of a ``T``-token forward starting at ``q_start`` whose log-sum-exp
        `_after_attend` reads (None: none); the other rows' log-sum-exp is NaN there."""
        return None

    def _after_attend(self, q: torch.Tensor, lse: torch.Tensor, q_start: int, scaling: float) -> None:
        """Called with the step's queries (B, H_q, T, D) and their log-sum-exp (B, H_q, T). Every
        row is exact after the blocked paths (decode steps, forwards shorter than
        `DEQUANT_MIN_QUERIES`, or `_lse_rows` naming all rows); after SDPA over the copy only the
        rows `_lse_rows` names are (NaN in the others), and ``lse`` is None when it names none."""

    def _prefill(self, q, k, v, scaling) -> None:
        """Store a prompt whose attention already ran (``q`` may be None: shared prefill)."""
        self._append(k, v)
        self.seen += k.shape[2]
        self._maybe_flush()
        reserve_planned(self, k, v)

    # ------------------------------------------------------------------ CacheLayer API
    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        if self.rotate_values:
            self.v_basis = value_basis(value_states.shape[-1], value_states.device)

    def to_stored_values(self, v: torch.Tensor) -> torch.Tensor:
        """Values (..., D) in the model's basis -> the basis the layer stores them in (same dtype)."""
        return v if self.v_basis is None else (v.float() @ self.v_basis).to(v.dtype)

    def from_stored_values(self, x: torch.Tensor) -> torch.Tensor:
        """Values, or attention outputs, (..., D) in the stored basis -> the model's basis (same dtype)."""
        return x if self.v_basis is None else (x.float() @ self.v_basis.T).to(x.dtype)

    def attend(self, q, k_new, v_new, scaling):
        """The step's attention output (B, H_q, T, D). With ``rotate_values`` every value enters
        the layer rotated (`to_stored_values`), so the window, the codes and the readers all work
        in the rotated basis, and the output, linear in the values, is rotated back once. A
        left-padded batch attends row by row (`RowSplit`)."""
        plan = self.cache.plan
        if plan is not None and plan.static and self.static_decode and not self.record_past:
            if self.by_row is not None:
                return self.by_row.static_attend(q, k_new, v_new, scaling, plan.start)
            return static_attend(self, q, k_new, v_new, scaling, plan.start)
        if self._split_rows(q.shape[0]):
            return self.by_row.attend(q, k_new, v_new, scaling)
        if self.v_basis is None:
            return self._attend(q, k_new, v_new, scaling)
        return self.from_stored_values(self._attend(q, k_new, self.to_stored_values(v_new), scaling))

    def count_tokens(self, n: int) -> None:
        """Count ``n`` tokens of static steps: the packed and window counts follow from ``seen``
        (`_quant_static.packed_count`: a step that filled the window flushed ``flush_unit`` tokens).
        Written without reading them or branching, so a traced step that counts its token (counts
        not deferred) guards on ``seen`` only."""
        if self.by_row is not None:
            for layer in self.by_row.layers:
                if layer is not None and layer.counts_deferred:
                    layer.counts_deferred = False
                    layer.count_tokens(n)
            self.seen += n
            return
        self.seen += n
        self.n_quant = static_sizes(self, self.seen)[1]
        self.win_len = self.seen - self.n_quant

    def _attend(self, q, k_new, v_new, scaling):
        """`attend` in the stored value basis (subclasses add their fused and compiled steps here)."""
        T = q.shape[2]
        plan = self.cache.plan
        if self.undoable_flush and plan is not None and plan.kind is ForwardKind.VERIFY:
            first = self.residual_length + self.flush_unit - self.win_len - 1  # decode steps flush after this one
            if 0 <= first < T - 1:
                return self._attend_across_flushes(q, k_new, v_new, scaling, first)
        return self._attend_forward(q, k_new, v_new, scaling)

    def _attend_across_flushes(self, q, k_new, v_new, scaling, first: int) -> torch.Tensor:
        """Assisted decoding's verification crossing the window's flush point: decode steps read
        the flushed tokens quantized from the step after the flush on, so the forward runs in
        segments with each flush between them, recorded (`_undo`) so that `crop` can take back a
        flush that only rejected tokens reached."""
        T, outs, a, cut = q.shape[2], [], 0, first + 1
        while a < T:
            b = min(T, cut)
            outs.append(self._attend_forward(q[:, :, a:b], k_new[:, :, a:b], v_new[:, :, a:b], scaling))
            if b < T:
                n = self.flush_unit
                self._undo.append((b - 1, self.n_quant, self.k_win[:, :, :n].clone(), self.v_win[:, :, :n].clone(),
                                   self._flush_state()))
                self._flush_window()
            a, cut = b, b + self.flush_unit
        return torch.cat(outs, dim=2)

    def _attend_forward(self, q, k_new, v_new, scaling):
        if self.seen == 0:
            out = dense_causal_attention(q, k_new, v_new, scaling, q_start=0, row_start=self.row_start)
            self._prefill(q, k_new, v_new, scaling)
            return out
        T = q.shape[2]
        q_start = self.seen
        self._append(k_new, v_new)
        self.seen += T
        kw = self.k_win[:, :, : self.win_len].float()  # (B, H, W, D): window incl. the new tokens
        vw = self.v_win[:, :, : self.win_len].float()
        copy = dequantized(self, kw, vw) if T >= DEQUANT_MIN_QUERIES else None  # [packed | window] fp32
        packed = None if copy is None else (copy[0][:, :, : self.n_quant], copy[1][:, :, : self.n_quant])
        rows = self._lse_rows(q_start, T) if copy is not None else None
        if copy is not None and (rows is None or not bool(rows.all())):
            # SDPA over the copy; the log-sum-exp only of the rows the layer keeps
            out = dense_causal_attention(q.float(), *copy, scaling, q_start=q_start, row_start=self.row_start)
            lse = None
            if rows is not None:
                idx = rows.nonzero().squeeze(1).to(q.device)
                lse = torch.full_like(out[..., 0], float("nan"))
                lse[:, :, idx] = attend_over_store(self, q[:, :, idx], q_start + idx, kw, vw, scaling, packed)[1]
        else:
            out, lse = blocked_attend(self, q, q_start, kw, vw, scaling, packed)
        self._after_attend(q, lse, q_start, scaling)
        self._maybe_flush()
        reserve_planned(self, k_new, v_new)
        return out.to(q.dtype)

    # ------------------------------------------------------------------ fused GPU decode
    def fused_step_ok(self, q, k_new, decode_backend: str) -> bool:
        """Whether this step runs on the fused dequantize-attention kernel (`quant_decode`):
        `kvpress.kernels.backend.fused_quant_backend` decides from the shapes and ``decode_backend``
        (``"triton"``, forced, raises naming why it cannot)."""
        return fused_quant_backend(q, k_new.shape[1], n_quant=self.n_quant, decode_backend=decode_backend) == "triton"

    def _fused_decode(self, q, k_new, v_new, scaling):
        """A GPU decode step: the window (`window_rows`) and the packed store's parts (`_fused_parts`)
        merged by log-sum-exp, then the usual bookkeeping (probes, flush)."""
        B, H_q = q.shape[:2]
        q_start = self.seen
        self._append(k_new, v_new)
        self.seen += 1
        parts = self._fused_parts(q[:, :, 0], scaling)
        out, lse = self.window_rows(q[:, :, 0], scaling)
        for o, l in parts:
            out, lse = merge_states(out, lse, o, l)
        self._after_attend(q, lse.view(B, H_q, 1), q_start, scaling)
        self._maybe_flush()
        return out.to(q.dtype)[:, :, None]

    def _fused_parts(self, q0: torch.Tensor, scaling: float) -> list:
        """The packed store's parts of a fused step for one query per head ``q0`` (B, H_q, D), the
        new token already in the window: ``[(out fp32 (B, H_q, D), lse (B, H_q))]``."""
        raise NotImplementedError

    def window_rows(self, q0: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The window part of a fused (GPU) decode step for one query per head ``q0`` (B, H_q, D), the
        new token included: fp32 output (B, H_q, D) and log-sum-exp (B, H_q). One `attend_rows` call (one
        launch on CUDA, the window in its own dtype) when no row's window holds left padding (every
        row's start flushed, known on the host); else `attend_masked` (about ten launches, fp32 copies)."""
        if self.cache.max_row_start <= self.n_quant:
            return attend_rows(q0, [(self.k_win, self.v_win, None, self.win_len)], scale=scaling)
        B, H_q, D = q0.shape
        H, W = self.k_win.shape[1], self.win_len
        hidden = (self.n_quant + torch.arange(W, device=q0.device) < self.row_start[:, None])[:, None, None]
        out, lse = attend_masked(q0.float().view(B, H, H_q // H, D), self.k_win[:, :, :W], self.v_win[:, :, :W],
                                 hidden, scaling)
        return out.view(B, H_q, D), lse.view(B, H_q)

    # ------------------------------------------------------------------ native CPU decode
    def native_step_ok(self, q, k_new, backend: str, stores) -> bool:
        """Whether this step can run as one `kvpress.kernels.native.quant_attend` call over ``stores``
        (``((kc, ks, kz), (vc, vs, vz))`` views): `kvpress.kernels.backend.quant_step_backend` decides
        from ``backend`` (a `READ_BACKENDS` name; ``"native"`` raises naming why it cannot)."""
        return quant_step_backend(q, k_new.shape[1], stores, n_quant=self.n_quant, backend=backend,
                                  decode_backend="torch") == "native"

    def native_decode(self, q, k_new, v_new, scaling, segments, exact=None):
        """A CPU decode step as one native call: the packed ``segments`` (`native.PackedSegment`)
        and the window under one softmax, then the usual bookkeeping (probes, flush). ``exact``:
        ``(k, v)`` (B, H, S, D) rows attended beside the window, every row of them by every query
        (``kivi``'s flushed sinks; the caller makes sure no row's window is padded then)."""
        B, H_q, _, D = q.shape
        H = k_new.shape[1]
        q_start = self.seen
        self._append(k_new, v_new)
        self.seen += 1
        rs = self.row_start
        k_win, v_win = self.k_win[:, :, : self.win_len].float(), self.v_win[:, :, : self.win_len].float()
        win_starts = None if rs is None else (rs - self.n_quant).clamp(min=0)
        if exact is not None:
            k_win, v_win = torch.cat([exact[0].float(), k_win], 2), torch.cat([exact[1].float(), v_win], 2)
            win_starts = None
        qg = q[:, :, 0].float().view(B, H, H_q // H, D) * scaling
        out, lse = native.quant_attend(qg, k_win=k_win, v_win=v_win, win_starts=win_starts, segments=segments)
        self._after_attend(q, lse.view(B, H_q, 1), q_start, scaling)
        self._maybe_flush()
        return out.view(B, H_q, 1, D).to(q.dtype)

    def ingest_prefill(self, k, v):
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        if self._split_rows(k.shape[0]):
            return self.by_row.ingest_prefill(k, v)
        self._prefill(None, k, self.to_stored_values(v), None)

    def padding_mask(self, start: int, n: int, device) -> torch.Tensor | None:
        """(B, n) bool, True for left-padding tokens among sequence indices start .. start + n - 1."""
        rs = self.row_start
        if rs is None:
            return None
        return torch.arange(start, start + n, device=device)[None, :] < rs[:, None]

    def sink_positions(self, count: int, batch: int, device) -> torch.Tensor:
        """(B, count) sequence index of each row's first ``count`` real tokens (attention sinks)."""
        pos = torch.arange(count, device=device)[None].expand(batch, count)
        rs = self.row_start
        return pos if rs is None else pos + rs[:, None]

    def sinks_in_chunk(self, count: int, x: torch.Tensor, start: int):
        """The sinks among sequence indices ``start .. start + n - 1`` of a chunk ``x`` (B, H, n, D):
        ``(index inside the chunk (B, count) clamped into range, inside (B, count) bool)``, or None
        when the chunk holds none of them."""
        pos = self.sink_positions(count, x.shape[0], x.device) - start
        inside = (pos >= 0) & (pos < x.shape[2])
        if not bool(inside.any()):
            return None
        return pos.clamp(0, x.shape[2] - 1), inside

    def zero_padding(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """``x`` (B, H, n, D) with left-padding tokens zeroed, so they never widen a group's range."""
        pad = self.padding_mask(start, x.shape[2], x.device)
        return x if pad is None else x.masked_fill(pad[:, None, :, None], 0)

    def mask_padding_scores(self, s: torch.Tensor) -> torch.Tensor:
        """-inf on scores (B, H, M, N) of sequence-ordered packed tokens 0 .. N - 1 before row_start."""
        pad = self.padding_mask(0, s.shape[-1], s.device)
        return s if pad is None else s.masked_fill(pad[:, None, None, :], float("-inf"))

    def end_prompt(self) -> None:
        if self.by_row is not None:
            self.by_row.end_prompt()

    def batch_select(self, indices):
        if self.by_row is not None:
            return self.by_row.batch_select(indices)
        return super().batch_select(indices)

    # ------------------------------------------------------------------ stats
    def state_tensors(self):
        if self.by_row is not None:
            return self.by_row.state_tensors()
        return {"k_win": self.k_win, "v_win": self.v_win, **self._quant_tensors()}

    def stored_tokens(self) -> int:
        return self.seen

    def cached_elements(self) -> int:
        if self.by_row is not None:
            return self.by_row.cached_elements()
        if self.k_win is None:
            return 0
        B, H, _, D = self.k_win.shape
        return 2 * B * H * self.seen * D

