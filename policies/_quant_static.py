"""Pure-torch pieces of the quantizers' static decode step (`QuantWindowLayer`'s ``plan.static``
path): fixed shapes over the preallocated stores, positions and the flush decision on the device.

Between forwards a quantized layer holding ``seen`` tokens has packed exactly
``packed_count(seen)`` of them: ``0`` while the window never reached ``residual_length +
flush_unit`` tokens, else the largest multiple of ``flush_unit`` that leaves at least
``residual_length`` tokens in the window (a flush always packs ``flush_unit``-multiples from
index 0 and leaves fewer than ``residual_length + flush_unit``). A decode step therefore knows
from its device position alone where its token goes in the window, how many packed tokens it
reads and whether it flushes, and commits the flush with a device mask: one graph for the steps
that flush and those that do not.
"""
from __future__ import annotations

import torch

from kvpress.plan import capacity_bucket, static_address

from ._quant_storage import resized


def packed_count(pos: torch.Tensor, residual_length: int, flush_unit: int) -> torch.Tensor:
    """Tokens packed before a decode step at sequence index ``pos`` (long, any shape)."""
    return (pos - residual_length).clamp(min=0) // flush_unit * flush_unit


def masked_write(buf: torch.Tensor, dim: int, index: torch.Tensor, new: torch.Tensor, commit: torch.Tensor) -> None:
    """``buf.index_copy_(dim, index, new)`` where ``commit`` (bool, broadcast against ``new``) is
    True; elsewhere the slots keep their values. ``index`` (long (n,)) may repeat a slot only where
    nothing is committed."""
    buf.index_copy_(dim, index, torch.where(commit, new, buf.index_select(dim, index)))


def decode_over_parts(qg: torch.Tensor, scaling: float, parts) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax of one query per head over several key/value parts.

    Parameters
    ----------
    qg : fp32 (B, H_kv, G, D)
        The step's queries grouped by KV head (query head ``h * G + g`` reads KV head ``h``).
    parts : sequence of ``(k, v, visible)``
        ``k`` / ``v`` fp32 (B, H_kv, N, D); ``visible`` bool broadcastable to (B, H_kv, G, N). Every
        query must see at least one slot over all parts.

    Returns
    -------
    out : fp32 (B, H_kv, G, D)
    lse : fp32 (B, H_kv, G), the log-sum-exp of the scaled scores
    """
    scores = [(qg @ k.transpose(-1, -2) * scaling).masked_fill(~visible, float("-inf")) for k, _, visible in parts]
    top = torch.stack([s.amax(-1) for s in scores]).amax(0)[..., None]  # (B, H, G, 1)
    probs = [(s - top).exp() for s in scores]
    total = sum(p.sum(-1, keepdim=True) for p in probs)
    out = sum((p / total) @ v for p, (_, v, _) in zip(probs, parts))  # normalised first, as the eager path does
    return out, (top + total.log()).squeeze(-1)


class StaticDecodeSteps:
    """The static decode step of `kvpress.policies._quant.QuantWindowLayer` (mixed into it): the
    window ``k_win`` / ``v_win`` and the counts ``seen``, ``n_quant``, ``win_len`` are the layer's;
    a subclass with ``static_decode = True`` implements the store hooks (``_reserve_store``,
    ``_store_slots``, ``_static_packed``, ``_static_flush``)."""

    def _reserve_store(self, like_k: torch.Tensor, like_v: torch.Tensor, slots: int) -> None:
        """Reallocate the packed store (zeroed where unused) to ``slots`` tokens, a multiple of
        ``flush_unit`` and at least ``n_quant`` (a subclass with a static decode step)."""
        raise NotImplementedError

    def _store_slots(self) -> int:
        """Tokens the packed store holds room for (0 before it exists)."""
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

    def _static_sizes(self, tokens) -> tuple:
        """``(window slots, packed slots)`` a static step needs while a row holds at most ``tokens``
        tokens: the window never holds more than ``residual_length + flush_unit`` of them, nor the
        store more than `packed_count` of them (no store at all while the window never fills)."""
        limit = self.residual_length + self.flush_unit
        packed = torch.sym_max(tokens - self.residual_length, 0) // self.flush_unit * self.flush_unit
        return torch.sym_min(tokens, limit), packed

    def _reserve_planned(self, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """With a planned capacity, size the storage for every decode step of the generation now
        (after an eager forward), so that its static steps keep one shape. A cache never planned
        keeps the eager sizes (no block factors for gear) until a traced step reserves a bucket:
        one more graph for that step."""
        if self.static_decode and self.cache.capacity:
            self._reserve_static(like_k, like_v, self.cache.capacity)

    def _reserve_static(self, like_k: torch.Tensor, like_v: torch.Tensor, tokens: int) -> None:
        """Storage of static steps for ``tokens`` tokens at least (the planned capacity, else a
        `capacity_bucket`): the window and the packed store at `_static_sizes`. Unused slots are
        zero, so masked slots never turn an output into NaN. The bytes are real and counted."""
        window, packed = self._static_sizes(max(capacity_bucket(tokens), self.cache.capacity or 0))
        if self.k_win is None or self.k_win.shape[2] < window:
            self.k_win = resized(self.k_win, self.win_len, window, like=like_k)
            self.v_win = resized(self.v_win, self.win_len, window, like=like_v)
            static_address(self.k_win, self.v_win)
        if self._store_slots() != packed and packed >= self.n_quant:  # (a cache outgrowing its plan grows eagerly)
            self._reserve_store(like_k, like_v, packed)

    def static_attend(self, q, k_new, v_new, scaling, pos: torch.Tensor) -> torch.Tensor:
        """`attend` of a static decode step whose token sits at sequence index ``pos`` ([1] long)
        of this layer (a row of a padded batch counts from its first real token)."""
        if self.v_basis is None:
            return self._static_step(q, k_new, v_new, scaling, pos)
        return self.from_stored_values(self._static_step(q, k_new, self.to_stored_values(v_new), scaling, pos))

    def _static_step(self, q, k_new, v_new, scaling, pos):
        """One decode token with fixed shapes and no host count read into a tensor: written at
        window slot ``pos - n`` (``n`` = `packed_count`), attended with the packed store
        dequantized over its whole capacity (the slots past ``n`` masked) and the window under one
        softmax, then the window's first ``flush_unit`` tokens packed at ``n`` and the window
        shifted, committed only when the window is full (the eager path's flush point)."""
        window, packed = self._static_sizes(self.seen + 1)
        if self.k_win is None or self.k_win.shape[2] < window or self._store_slots() < packed:
            self._reserve_static(k_new, v_new, self.seen + 1)  # an unplanned cache outgrown: a new shape
        B, H_q, _, D = q.shape
        H, W, F = k_new.shape[1], self.k_win.shape[2], self.flush_unit
        n = packed_count(pos, self.residual_length, F)  # [1]
        slot = pos - n  # [1]: the new token's window slot
        self.k_win.index_copy_(2, slot, k_new)
        self.v_win.index_copy_(2, slot, v_new)
        win_visible = torch.arange(W, device=q.device) <= slot  # (W,)
        qg = q[:, :, 0].float().view(B, H, H_q // H, D)
        stored = self._store_slots() > 0
        parts = self._static_packed(n) if stored else []
        out, lse = decode_over_parts(qg, scaling, parts + [(self.k_win.float(), self.v_win.float(), win_visible)])
        self._static_after_attend(q, lse.view(B, H_q, 1), pos, scaling)
        if stored:  # (without a store the window never fills)
            due = slot + 1 == self.residual_length + F  # [1]: the window is full, the eager flush point
            self._static_flush(n, due)
            for buf in (self.k_win, self.v_win):
                buf.copy_(torch.where(due.view(1, 1, 1, 1), buf.roll(-F, 2), buf))
        self.count_static_step()
        return out.view(B, H_q, 1, D).to(q.dtype)

    def count_tokens(self, n: int) -> None:
        """Count ``n`` tokens of static steps: the packed and window counts follow from ``seen``
        (`packed_count`: a step that filled the window flushed ``flush_unit`` tokens). Written
        without reading them or branching, so a traced step that counts its token (counts not
        deferred) guards on ``seen`` only."""
        if self.by_row is not None:
            for layer in self.by_row.layers:
                if layer is not None and layer.counts_deferred:
                    layer.counts_deferred = False
                    layer.count_tokens(n)
            self.seen += n
            return
        self.seen += n
        self.n_quant = self._static_sizes(self.seen)[1]
        self.win_len = self.seen - self.n_quant
