"""``zipcache``'s packed stores: one precision's keys (per channel, optionally with refined
channels) and normalised values (per token), in flush order; the layer's eager reads of both
stores (the fused GPU decode step, the fp32 copy of a multi-token forward); and the slicing its
probe bookkeeping uses."""
from __future__ import annotations

import torch

from kvpress.kernels.merge import merge_states
from kvpress.kernels.packed_decode import quant_decode
from kvpress.kernels.quant import (channel_quant_scores, dequantize_per_channel, dequantize_per_token,
                                   dequantize_refinement, quantize_per_channel, quantize_per_token,
                                   quantize_refined_keys, refined_scores, token_quant_values)

from ._quant_storage import append_tokens


class _Store:
    """Packed tokens of one precision, in flush order (sequence order within a flush): keys
    per channel over groups of ``group_size`` store tokens, normalised values per token. Left
    padding tokens (``pad`` per (row, head), int32 (B, H)) always come first: they precede every
    real token in sequence order and a flush never mixes orders across stores."""

    def __init__(self, bits: int, group_size: int, value_group_size: int, backend: str = "auto", refine: int = 0):
        self.bits, self.group_size, self.value_group_size = bits, group_size, value_group_size
        self.backend = backend  # the packed-code reader (kvpress.kernels.quant.READ_BACKENDS)
        self.refine = refine  # key channels per KV head at 2 * bits (ZipCachePolicy.refine_key_channels)
        self.ridx = None  # long (B, H, refine): those channels, chosen at the store's first flush
        self.n = 0
        self.t = dict.fromkeys(("kc", "ks", "kz", "vc", "vs", "vz") + (("rc", "rs") if refine else ()))
        self.pad = None

    @property
    def refined(self) -> bool:
        return self.ridx is not None

    def add(self, k, v, pad_count):
        """k, v (B, H, m, D) with m a multiple of ``group_size``; v already channel-normalised."""
        g = self.group_size
        if self.refined:
            kc, ks, kz, rc, rs = quantize_refined_keys(k, self.bits, g, self.ridx)
            self.t["rc"] = append_tokens(self.t["rc"], self.n, rc)
            self.t["rs"] = append_tokens(self.t["rs"], self.n // g, rs, grow=max(1, 256 // g))
        else:
            kc, ks, kz = quantize_per_channel(k, self.bits, g)
        vc, vs, vz = quantize_per_token(v, self.bits, self.value_group_size)
        for name, x in zip(("kc", "vc", "vs", "vz"), (kc, vc, vs, vz)):
            self.t[name] = append_tokens(self.t[name], self.n, x)
        for name, x in zip(("ks", "kz"), (ks, kz)):
            self.t[name] = append_tokens(self.t[name], self.n // g, x, grow=max(1, 256 // g))
        self.pad = pad_count if self.pad is None else self.pad + pad_count
        self.n += k.shape[2]

    def views(self):
        """``((kc, ks, kz), (vc, vs, vz))``: the store's tokens as views of its buffers."""
        n, g, t = self.n, self.group_size, self.t
        return ((t["kc"][:, :, :n], t["ks"][:, :, : n // g], t["kz"][:, :, : n // g]),
                (t["vc"][:, :, :n], t["vs"][:, :, :n], t["vz"][:, :, :n]))

    def refine_views(self):
        """``(codes, scale, channels)`` of the refined key channels' second codes, or None."""
        if not self.refined:
            return None
        n, g = self.n, self.group_size
        return self.t["rc"][:, :, :n], self.t["rs"][:, :, : n // g], self.ridx

    def scores(self, q):
        """q (B, H, M, D) fp32, already scaled -> (B, H, M, n), -inf on padding."""
        n = self.n
        s = channel_quant_scores(q, *self.views()[0], self.bits, self.group_size, backend=self.backend)
        if self.refined:
            s = s + refined_scores(q, self.refine_views(), self.bits, self.group_size)
        pad = torch.arange(n, device=q.device)[None, None, :] < self.pad[:, :, None]  # (B, H, n)
        return s.masked_fill(pad[:, :, None], float("-inf"))

    def dequantized(self):
        """The store's keys and normalised values, fp32 (B, H, n, D) each."""
        (kc, ks, kz), (vc, vs, vz) = self.views()
        k = dequantize_per_channel(kc, ks, kz, self.bits, self.group_size)
        if self.refined:
            rc, rs, ridx = self.refine_views()
            k.scatter_add_(3, ridx[:, :, None, :].expand(-1, -1, self.n, -1),
                           dequantize_refinement(rc, rs, self.bits, self.group_size))
        return k, dequantize_per_token(vc, vs, vz, self.bits, self.value_group_size)

    def output(self, p):
        """p (B, H, M, n) -> normalised-value output fp32 (B, H, M, D)."""
        return token_quant_values(p, *self.views()[1], self.bits, self.value_group_size, backend=self.backend)


def fused_decode(layer, q, k_new, v_new, scaling):
    """``ZipCacheLayer``'s GPU decode step: each store through the fused dequantize-attention
    kernel (`quant_decode`), the window through `window_rows`, merged by log-sum-exp. A store's
    left padding is its first ``pad`` rows, the same count in every head (padding has -inf
    saliency in all of them, so every flush sends the same number of padding tokens to each
    store): ``pad[:, 0]`` is the kernel's per-row start."""
    B, H_q, _, D = q.shape
    H = k_new.shape[1]
    q_start = layer.seen
    layer._append(k_new, v_new)
    layer.seen += 1
    out, lse = layer.window_rows(q[:, :, 0], scaling)
    if layer._vn_q is None or layer._vn_q[0] is not layer.vn:  # a new normaliser (first flush, batch_select)
        layer._vn_q = (layer.vn, layer.vn.float().repeat_interleave(H_q // H, dim=1))
    vn = layer._vn_q[1]  # (B, H_q, D): query head h reads KV head h // G
    for st in (layer.hi, layer.lo):
        if st.n:
            (kc, ks, kz), (vc, vs, vz) = st.views()
            o, l = quant_decode(q[:, :, 0], kc, ks, kz, vc, vs, vz, bits=st.bits, group_size=st.group_size,
                                seq_starts=st.pad[:, 0], scale=scaling, backend=layer.decode_backend,
                                value_group_size=st.value_group_size, refine=st.refine_views())
            out, lse = merge_states(out, lse, o.float() * vn, l)
    layer._after_attend(q, lse.view(B, H_q, 1), q_start, scaling)
    layer._maybe_flush()
    return out.to(q.dtype)[:, :, None]


def dequantize_into(layer, k_out, v_out) -> bool:
    """``ZipCacheLayer._dequantize_into``: both stores' keys and values (normaliser undone) into
    ``k_out`` / ``v_out`` fp32 (B, H, N, D). Column of each store row: every padding row first
    (the high store's, then the low store's), then the high store's real rows, then the low
    store's."""
    stores = [st for st in (layer.hi, layer.lo) if st.n]
    vn = layer.vn.float()[:, :, None]  # undo the value channel normalisation
    if layer.row_start is None:  # no padding: the stores one after the other
        i = 0
        for st in stores:
            k, v = st.dequantized()
            k_out[:, :, i : i + st.n] = k
            torch.mul(v, vn, out=v_out[:, :, i : i + st.n])
            i += st.n
        return True
    pads = [st.pad.long()[..., None] for st in stores]  # (B, H, 1) each
    pad_total, real_before = sum(pads), 0
    pad_before = torch.zeros_like(pad_total)
    for st, pad in zip(stores, pads):
        k, v = st.dequantized()
        i = torch.arange(st.n, device=k.device)  # (n,) row of the store
        col = torch.where(i < pad, pad_before + i, pad_total + real_before + i - pad)  # (B, H, n)
        col = col[..., None].expand(-1, -1, -1, k.shape[-1])
        k_out.scatter_(2, col, k)
        v_out.scatter_(2, col, v * vn)
        pad_before, real_before = pad_before + pad, real_before + (st.n - pad)
    return True


def _runs(keep: list[bool], start: int, stop: int) -> list[tuple[int, int]]:
    """(a, b) of each maximal run of True in ``keep[start:stop]``, as indices into ``keep``."""
    runs: list[tuple[int, int]] = []
    for i in range(start, stop):
        if keep[i]:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    return runs


def _joined(parts, pieces, i: int, dim: int) -> torch.Tensor:
    """Tensor ``i`` of ``parts`` cut to ``pieces`` (``(part, first row, rows)``) along ``dim`` and
    joined; a single piece that is a whole contiguous part is returned as it is (nothing copied)."""
    views = [part[i].narrow(dim, a, n) for part, a, n in pieces]
    if len(views) == 1 and views[0].shape == pieces[0][0][i].shape:
        return pieces[0][0][i].contiguous()
    return torch.cat(views or [parts[0][i].narrow(dim, 0, 0)], dim)
