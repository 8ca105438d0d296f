"""The full-precision window of the quantization layers (`kivi`, `zipcache`, `gear`; `_quant`):
appending to it, flushing its oldest tokens into the packed store, and taking a recorded forward's
tokens back (``rollback = "truncate"``: a crop)."""
from __future__ import annotations

import torch

from ._quant_storage import resized, window_slots


class QuantWindow:
    """Window bookkeeping and crop of `QuantWindowLayer`, which holds the state: ``k_win`` / ``v_win``
    (B, H_kv, slots, D) with ``win_len`` tokens, ``n_quant`` tokens flushed, ``residual_length`` /
    ``flush_unit``, the recorded forward (``_recorded``, ``_record_from``) and the flushes inside it
    that a crop may undo (``_undo``, written by `_attend_across_flushes`), and ``by_row``. The layer
    implements ``_flush`` and, with ``undoable_flush``, ``_unflush``."""

    # ------------------------------------------------------------------ window bookkeeping
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        if self.k_win is None or self.win_len + n > self.k_win.shape[2]:
            slots = window_slots(self.win_len + n, self.residual_length + self.flush_unit)
            self.k_win = resized(self.k_win, self.win_len, slots, like=k)
            self.v_win = resized(self.v_win, self.win_len, slots, like=v)
        self.k_win[:, :, self.win_len : self.win_len + n] = k
        self.v_win[:, :, self.win_len : self.win_len + n] = v
        self.win_len += n

    # ------------------------------------------------------------------ crop (``rollback = "truncate"``)
    def record_forward(self, k, v):
        self._recorded, self._record_from = k.shape[2], self.seen
        self._undo = []  # an earlier forward's flushes are final

    def truncatable(self) -> int:
        """The latest recorded forward's tokens: still in the window, their flush deferred (0 when
        no forward is recorded)."""
        return self._recorded if self.by_row is None else self.by_row.removable()

    def end_record(self) -> None:
        """A crop took back the latest ``n`` tokens of the recorded forward (``seen`` already cut;
        ``n`` may be 0): the flushes inside the forward that only those tokens' steps reached are
        undone, the window loses them, and the flush the forward deferred runs."""
        n = self._record_from + self._recorded - self.seen if self._recorded else 0
        kept, self._recorded = self._recorded - n, 0
        if self.by_row is not None:
            return self.by_row.remove_latest(n)
        while self._undo and self._undo[-1][0] >= kept:  # a flush after a step that is taken back
            _, n_quant, k, v, state = self._undo.pop()
            self.n_quant = n_quant
            self._unflush(state)
            self._prepend_window(k, v)
        self._undo = []
        self.win_len -= n
        self._after_crop(n)
        self._maybe_flush()

    def _prepend_window(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put flushed tokens ``k`` / ``v`` (B, H, n, D) back in front of the window."""
        k_all = torch.cat([k, self.k_win[:, :, : self.win_len]], dim=2)
        v_all = torch.cat([v, self.v_win[:, :, : self.win_len]], dim=2)
        self.win_len = 0
        self._append(k_all, v_all)

    def _after_crop(self, n: int) -> None:
        """Hook: the latest forward lost its last ``n`` tokens (window cut, not flushed yet)."""

    def _maybe_flush(self) -> None:
        if self._recorded:  # a recorded forward: flush at `crop`, once its kept tokens are known
            return
        self._flush_window()

    def _flush_window(self) -> None:
        """Quantize the window's oldest ``flush_unit``-multiples beyond ``residual_length``."""
        excess = self.win_len - self.residual_length
        n = excess // self.flush_unit * self.flush_unit if excess >= self.flush_unit else 0
        if n:
            self._flush(self.k_win[:, :, :n], self.v_win[:, :, :n], self.n_quant)
            self.n_quant += n
            rest = self.win_len - n
            k_rest = self.k_win[:, :, n : self.win_len].clone()
            v_rest = self.v_win[:, :, n : self.win_len].clone()
            limit = self.residual_length + self.flush_unit
            if self.k_win.shape[2] > limit:  # a long prefill: back to what the remaining tokens need
                slots = window_slots(rest, limit)
                self.k_win, self.v_win = resized(None, 0, slots, self.k_win), resized(None, 0, slots, self.v_win)
            self.k_win[:, :, :rest], self.v_win[:, :, :rest] = k_rest, v_rest
            self.win_len = rest
