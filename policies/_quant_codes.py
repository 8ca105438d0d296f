"""The packed store ``kivi`` and ``gear`` share: KIVI's codes (keys per channel, values per token) and
each row's first ``sink_tokens`` real tokens beside them in fp16, as the base of both layers.

KIVI (Liu et al., arXiv 2402.02750) quantizes keys per channel over groups of ``group_size``
tokens and values per token over groups of ``value_group`` channels; GEAR (Kang et al., arXiv
2403.05527) adds corrections on top of the same codes. Both keep the attention-sink tokens in fp16
(kivi: the rows themselves, read in place of their codes; gear: what its other parts miss on them).
This module holds what the two layers do alike with that store: append a flush's codes, view,
dequantize, reserve and write it in a static step, keep the sinks and take a flush of them back.
"""
from __future__ import annotations

import torch

from kvpress.kernels.quant import dequantize_per_channel, dequantize_per_token
from kvpress.plan import static_address

from ._quant import QuantWindowLayer
from ._quant_static import masked_write
from ._quant_storage import GROW, append_tokens, resized

CODE_NAMES = ("kc", "ks", "kz", "vc", "vs", "vz")


class KiviCodesLayer(QuantWindowLayer):
    """A quantized window whose packed store holds KIVI's codes, in sequence order:

    ``kc`` uint8 (B, H, cap, D*bits/8), ``ks`` / ``kz`` fp16 (B, H, cap/G, D): keys, scale and zero
    per channel and group of G = ``group_size`` tokens; ``vc`` uint8 (B, H, cap, D*bits/8), ``vs`` /
    ``vz`` fp16 (B, H, cap, D/Gv): values, per token and group of Gv = ``value_group`` channels.
    ``sk`` / ``sv`` fp16 (B, H, S, D) with ``sink_tokens`` = S > 0: what the subclass keeps of each
    row's first S real tokens, zero until they are flushed (None before the first flush holding one).
    A subclass quantizes in ``_flush`` / ``_static_flush`` and reads in ``_quant_scores`` /
    ``_quant_output``; a flush appends at ``n_quant`` only, so it can be taken back.
    """

    undoable_flush = True  # a flush appends codes at n_quant (and may fill the sinks)
    static_decode = True

    def __init__(self, cache, layer_idx: int, *, bits: int, group_size: int, value_group: int, sink_tokens: int,
                 residual_length: int, flush_unit: int, rotate_values: bool = False):
        super().__init__(cache, layer_idx, residual_length, flush_unit=flush_unit, rotate_values=rotate_values)
        self.bits, self.group_size, self.value_group, self.sink_tokens = bits, group_size, value_group, sink_tokens
        self.kc = self.ks = self.kz = self.vc = self.vs = self.vz = None
        self.sk = self.sv = None

    # ------------------------------------------------------------------ the codes
    def _views(self) -> tuple[tuple, tuple]:
        """``((kc, ks, kz), (vc, vs, vz))``: the ``n_quant`` packed tokens as views of their buffers."""
        n, g = self.n_quant, self.group_size
        return ((self.kc[:, :, :n], self.ks[:, :, : n // g], self.kz[:, :, : n // g]),
                (self.vc[:, :, :n], self.vs[:, :, :n], self.vz[:, :, :n]))

    def _dequantized(self, keys: tuple, values: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values fp32 (B, H, N, D) of the codes ``keys`` / ``values`` (`_views`' pairs)."""
        return (dequantize_per_channel(*keys, self.bits, self.group_size),
                dequantize_per_token(*values, self.bits, self.value_group))

    def _dequantized_store(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`_dequantized` over the whole capacity of the store (a static step masks the slots past ``n``)."""
        return self._dequantized((self.kc, self.ks, self.kz), (self.vc, self.vs, self.vz))

    def _append_codes(self, start: int, keys: tuple, values: tuple) -> None:
        """A flush's codes (`quantize_per_channel` / `quantize_per_token` of its tokens) at sequence
        indices ``start ..``; the per-group scales grow with the tokens (``GROW`` tokens a step)."""
        (kc, ks, kz), (vc, vs, vz), g = keys, values, self.group_size
        self.kc, self.vc = append_tokens(self.kc, start, kc), append_tokens(self.vc, start, vc)
        self.vs, self.vz = append_tokens(self.vs, start, vs), append_tokens(self.vz, start, vz)
        self.ks = append_tokens(self.ks, start // g, ks, grow=max(1, GROW // g))
        self.kz = append_tokens(self.kz, start // g, kz, grow=max(1, GROW // g))

    def _write_codes(self, n: torch.Tensor, keys: tuple, values: tuple, commit: torch.Tensor) -> None:
        """A static step's flush of ``flush_unit`` tokens at sequence indices ``n ..`` ([1] long) into
        the reserved store, where ``commit`` ((1, 1, 1, 1) bool); elsewhere the store keeps its values."""
        g, F, cap = self.group_size, self.flush_unit, self.kc.shape[2]
        tokens = (n + torch.arange(F, device=n.device)).clamp(max=cap - 1)  # repeats only where not committed
        groups = (n // g + torch.arange(F // g, device=n.device)).clamp(max=cap // g - 1)
        for buf, x, index in zip((self.kc, self.ks, self.kz, self.vc, self.vs, self.vz), (*keys, *values),
                                 (tokens, groups, groups, tokens, tokens, tokens)):
            masked_write(buf, 2, index, x, commit)

    def _reserve_codes(self, like_k: torch.Tensor, slots: int) -> None:
        """The codes reallocated to ``slots`` tokens (a multiple of ``flush_unit``, zero where unused)
        and zero sinks, for static steps; ``like_k`` (B, H, n, D) gives the shapes and device."""
        g, half = self.group_size, torch.float16
        B, H, _, D = like_k.shape
        n = self.n_quant

        def like(width, dtype=half):  # (B, H, 0, width): what `resized` copies the other dims from
            return like_k.new_empty(B, H, 0, width, dtype=dtype)

        codes = like(D * self.bits // 8, torch.uint8)
        self.kc, self.vc = resized(self.kc, n, slots, codes), resized(self.vc, n, slots, codes)
        self.ks, self.kz = resized(self.ks, n // g, slots // g, like(D)), resized(self.kz, n // g, slots // g, like(D))
        per_token = like(D // self.value_group)
        self.vs, self.vz = resized(self.vs, n, slots, per_token), resized(self.vz, n, slots, per_token)
        if self.sink_tokens and self.sk is None:  # zero until flushed, as the eager flush leaves them
            self.sk = like_k.new_zeros(B, H, self.sink_tokens, D, dtype=half)
            self.sv = torch.zeros_like(self.sk)

    # static decode hooks (`_quant_static`); a subclass with more parts extends them
    def _store_slots(self) -> int:
        return 0 if self.kc is None or (self.sink_tokens and self.sk is None) else self.kc.shape[2]

    def _reserve_store(self, like_k, like_v, slots) -> None:
        self._reserve_codes(like_k, slots)
        static_address(*self._quant_tensors().values())

    def _quant_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in (*CODE_NAMES, "sk", "sv")}

    # ------------------------------------------------------------------ sinks
    def _sink_rows(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (B, S) of a chunk ``x`` (B, H, n, D): (B, H, S, D)."""
        return x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))

    def _static_sinks(self, n: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`sinks_in_chunk` of a static step's flush of ``flush_unit`` tokens at ``n`` ([1] long; a
        static step's layer has no padding): index inside the chunk (B, S), clamped, and inside (B, S)."""
        j = torch.arange(self.sink_tokens, device=n.device)
        return ((j - n).clamp(0, self.flush_unit - 1).expand(batch, -1),
                ((j >= n) & (j < n + self.flush_unit)).expand(batch, -1))

    def _keep_sinks(self, k_rows: torch.Tensor, v_rows: torch.Tensor, inside: torch.Tensor,
                    commit: torch.Tensor | None = None) -> None:
        """Store ``k_rows`` / ``v_rows`` fp16 (B, H, S, D) as the sinks where ``inside`` (B, S): a row's
        sinks may straddle two flushes, so each flush keeps the ones in its chunk. ``commit`` (a static
        step's (1, 1, 1, 1) bool) writes in place, only where True."""
        here = inside[:, None, :, None]
        if commit is not None:
            self.sk.copy_(torch.where(here & commit, k_rows, self.sk))
            self.sv.copy_(torch.where(here & commit, v_rows, self.sv))
            return
        if self.sk is None:
            self.sk, self.sv = torch.zeros_like(k_rows), torch.zeros_like(v_rows)
        self.sk, self.sv = torch.where(here, k_rows, self.sk), torch.where(here, v_rows, self.sv)

    def _sink_columns(self, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed column of each row's sinks (B, S), clamped into range, and whether it is flushed (B, S)."""
        pos = self.sink_positions(self.sink_tokens, batch, device)
        return pos.clamp(max=self.n_quant - 1), pos < self.n_quant

    def _sink_index(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_sink_columns` for scores or probabilities ``x`` (B, H, M, N): the columns (B, H, M, S)
        and whether each is flushed (B, 1, 1, S)."""
        col, flushed = self._sink_columns(x.shape[0], x.device)
        return col[:, None, None].expand(-1, x.shape[1], x.shape[2], -1), flushed[:, None, None]

    def _flush_state(self):
        return None if self.sk is None else (self.sk.clone(), self.sv.clone())

    def _unflush(self, state) -> None:
        self.sk, self.sv = (None, None) if state is None else state
