"""``gear``'s static decode step (`GearStaticSteps`, mixed into `kvpress.policies.gear.GearLayer`)
and the helpers it shares with the eager paths: the power iteration's start matrix and the
positions of the stored outliers."""
from __future__ import annotations

import torch

from kvpress.kernels.quant import dequantize_per_channel, dequantize_per_token
from kvpress.plan import static_address

from ._quant_static import masked_write
from ._quant_storage import resized

_STARTS: dict = {}


def power_start(dim: int, rank: int, device) -> torch.Tensor:
    """The start matrix of `low_rank` (dim, rank) fp32, drawn once from a fixed seed (a traced
    static step reads it from here rather than drawing it)."""
    key = (dim, rank, torch.device(device))
    if key not in _STARTS:
        _STARTS[key] = torch.randn(dim, rank, generator=torch.Generator().manual_seed(0)).to(device)
    return _STARTS[key]


def outlier_positions(offset: torch.Tensor, group_size: int, per_channel: bool, group_start: int = 0):
    """(token, channel) int64 of each outlier, both shaped like ``offset`` flattened to (B, H, O);
    ``group_start``: index of the first group (keys) / token (values) of ``offset``."""
    if per_channel:  # offset (B, H, ng, m, D): token = (group_start + g) * G + offset
        B, H, ng, m, D = offset.shape
        g = torch.arange(group_start, group_start + ng, device=offset.device).view(1, 1, ng, 1, 1)
        tok = g * group_size + offset
        chan = torch.arange(D, device=offset.device).expand_as(offset)
    else:  # offset (B, H, n, ngd, m): channel = gd * G + offset
        B, H, n, ngd, m = offset.shape
        tok = torch.arange(group_start, group_start + n, device=offset.device).view(1, 1, n, 1, 1).expand_as(offset)
        chan = torch.arange(ngd, device=offset.device).view(1, 1, 1, ngd, 1) * group_size + offset
    return tok.reshape(B, H, -1), chan.reshape(B, H, -1)


class GearStaticSteps:
    """The store hooks of `kvpress.policies._quant_static.StaticDecodeSteps` for GEAR's codes,
    block factors (``krb`` / ``vrb``), outliers and sinks; the stores, ``p`` and ``_compress`` are
    `GearLayer`'s."""

    def _store_slots(self) -> int:
        """The packed tokens every store holds room for, in whole flush blocks; 0 when they do not
        agree (stores grown by eager flushes, no block factors yet): `_reserve_store` aligns them."""
        p, g, F = self.p, self.p.group_size, self.flush_unit
        if self.kc is None or (p.rank and self.krb is None) or (p.sink_tokens and self.sk is None):
            return 0
        sizes = {self.kc.shape[2], self.vc.shape[2], self.ks.shape[2] * g, self.vs.shape[2]}
        if p.rank:
            sizes |= {self.kl.shape[2], self.krb.shape[2] * F}
        if p.outliers_per_group:
            sizes |= {self.ko.shape[2] * g, self.vo.shape[2]}
        size = sizes.pop()
        return size if not sizes and size % F == 0 else 0

    def _reserve_store(self, like_k, like_v, slots):
        p, g, F = self.p, self.p.group_size, self.flush_unit
        B, H, _, D = like_k.shape
        n, half = self.n_quant, torch.float16

        def like(*tail, dtype=half):  # (B, H, 0, *tail): what `resized` copies the other dims from
            return like_k.new_empty(B, H, 0, *tail, dtype=dtype)

        codes = like(D * p.bits // 8, dtype=torch.uint8)
        self.kc, self.vc = resized(self.kc, n, slots, codes), resized(self.vc, n, slots, codes)
        self.ks, self.kz = resized(self.ks, n // g, slots // g, like(D)), resized(self.kz, n // g, slots // g, like(D))
        self.vs, self.vz = resized(self.vs, n, slots, like(D // g)), resized(self.vz, n, slots, like(D // g))
        if p.rank:
            self.kl, self.vl = resized(self.kl, n, slots, like(p.rank)), resized(self.vl, n, slots, like(p.rank))
            blocks = like(D, p.rank)
            if self.krb is None:  # from the chunks flushed so far (no static step has run yet)
                self.krb, self.vrb = resized(None, 0, slots // F, blocks), resized(None, 0, slots // F, blocks)
                for c, (a, b) in enumerate(zip(self.chunk_starts, self.chunk_starts[1:] + [n])):
                    self.krb[:, :, a // F : b // F] = self.kr[:, :, c : c + 1]
                    self.vrb[:, :, a // F : b // F] = self.vr[:, :, c : c + 1]
            else:
                self.krb = resized(self.krb, n // F, slots // F, blocks)
                self.vrb = resized(self.vrb, n // F, slots // F, blocks)
        if p.outliers_per_group:
            m = p.outliers_per_group
            self.ko = resized(self.ko, n // g, slots // g, like(m, D, dtype=torch.uint8))
            self.kx = resized(self.kx, n // g, slots // g, like(m, D))
            self.vo = resized(self.vo, n, slots, like(D // g * m, dtype=torch.uint8))
            self.vx = resized(self.vx, n, slots, like(D // g * m))
        if p.sink_tokens and self.sk is None:  # zero until flushed, as the eager flush leaves them
            self.sk = like_k.new_zeros(B, H, p.sink_tokens, D, dtype=half)
            self.sv = torch.zeros_like(self.sk)
        if p.rank:
            power_start(D, p.rank, like_k.device)  # drawn here, not in a traced step
        static_address(*(t for t in self._quant_tensors().values()))

    def _static_packed(self, n):
        p, g, F = self.p, self.p.group_size, self.flush_unit
        k = dequantize_per_channel(self.kc, self.ks, self.kz, p.bits, g)  # (B, H, C, D)
        v = dequantize_per_token(self.vc, self.vs, self.vz, p.bits, g)
        B, H, C, D = k.shape
        if p.rank:  # each block's left factors (F tokens) against its right factors
            k = k + (self.kl.float().view(B, H, C // F, F, p.rank) @ self.krb.float().transpose(-1, -2)).view(k.shape)
            v = v + (self.vl.float().view(B, H, C // F, F, p.rank) @ self.vrb.float().transpose(-1, -2)).view(v.shape)
        if p.outliers_per_group:  # exact corrections at each outlier's (token, channel); zero past n
            rows = (torch.arange(B, device=k.device)[:, None, None], torch.arange(H, device=k.device)[None, :, None])
            tok, chan = outlier_positions(self.ko.long(), g, True)  # (B, H, O) each
            k = k.index_put((*rows, tok, chan), self.kx.float().flatten(2), accumulate=True)
            tok, chan = outlier_positions(self.vo.long().unflatten(3, (D // g, p.outliers_per_group)), g, False)
            v = v.index_put((*rows, tok, chan), self.vx.float().flatten(2), accumulate=True)
        if self.sk is not None:  # sink corrections (zero until flushed; a static step's layer has no padding)
            S = min(p.sink_tokens, C)
            k = torch.cat([k[:, :, :S] + self.sk[:, :, :S].float(), k[:, :, S:]], 2)
            v = torch.cat([v[:, :, :S] + self.sv[:, :, :S].float(), v[:, :, S:]], 2)
        return [(k, v, torch.arange(C, device=n.device) < n)]

    def _static_flush(self, n, due):
        p, g, F = self.p, self.p.group_size, self.flush_unit
        k, v = self.k_win[:, :, :F], self.v_win[:, :, :F]  # (B, H, F, D): what `_flush` gets
        B = k.shape[0]
        sink = None
        if p.sink_tokens:
            j = torch.arange(p.sink_tokens, device=n.device)
            sink = ((j - n).clamp(0, F - 1).expand(B, -1), ((j >= n) & (j < n + F)).expand(B, -1))  # (B, S) each
        kc, ks, kz, kl, kr, ko, kx, k_sink = self._compress(k, None, True, sink)
        vc, vs, vz, vl, vr, vo, vx, v_sink = self._compress(v, None, False, sink)
        commit = due.view(1, 1, 1, 1)
        if sink is not None:
            here = k_sink[1][:, None, :, None] & commit
            self.sk.copy_(torch.where(here, k_sink[0], self.sk))
            self.sv.copy_(torch.where(here, v_sink[0], self.sv))
        cap = self.kc.shape[2]
        tokens = (n + torch.arange(F, device=n.device)).clamp(max=cap - 1)  # repeats only where not committed
        groups = (n // g + torch.arange(F // g, device=n.device)).clamp(max=cap // g - 1)
        writes = [(self.kc, kc, tokens), (self.vc, vc, tokens), (self.vs, vs, tokens), (self.vz, vz, tokens),
                  (self.ks, ks, groups), (self.kz, kz, groups)]
        if p.rank:
            block = (n // F).clamp(max=cap // F - 1)
            writes += [(self.kl, kl, tokens), (self.vl, vl, tokens),
                       (self.krb, kr[:, :, None], block), (self.vrb, vr[:, :, None], block)]
        if p.outliers_per_group:
            writes += [(self.ko, ko, groups), (self.kx, kx, groups), (self.vo, vo, tokens), (self.vx, vx, tokens)]
        for buf, x, index in writes:
            masked_write(buf, 2, index, x, commit)

    undoable_flush = True  # a flush appends codes, factors and outliers at n_quant and one chunk start

    def _flush_state(self):
        return len(self.chunk_starts), None if self.sk is None else (self.sk.clone(), self.sv.clone())

    def _unflush(self, state) -> None:
        chunks, sinks = state
        del self.chunk_starts[chunks:]
        self._chunked_to = self.n_quant
        self._chunk_ids = self._chunk_bounds = None
        self.sk, self.sv = (None, None) if sinks is None else sinks
