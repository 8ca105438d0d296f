"""``gear``'s static decode store, as functions of a `kvpress.policies.gear.GearLayer` (its store
hooks for `kvpress.policies._quant_static`: GEAR's codes, block factors ``krb`` / ``vrb``,
outliers and sinks), and the helpers they share with the eager paths: the power iteration's start
matrix and the positions of the stored outliers."""
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


def store_slots(layer) -> int:
    """``GearLayer._store_slots``: the packed tokens every store holds room for, in whole flush
    blocks; 0 when they do not agree (stores grown by eager flushes, no block factors yet):
    `reserve_store` aligns them."""
    p, g, F = layer.p, layer.p.group_size, layer.flush_unit
    if layer.kc is None or (p.rank and layer.krb is None) or (p.sink_tokens and layer.sk is None):
        return 0
    sizes = {layer.kc.shape[2], layer.vc.shape[2], layer.ks.shape[2] * g, layer.vs.shape[2]}
    if p.rank:
        sizes |= {layer.kl.shape[2], layer.krb.shape[2] * F}
    if p.outliers_per_group:
        sizes |= {layer.ko.shape[2] * g, layer.vo.shape[2]}
    size = sizes.pop()
    return size if not sizes and size % F == 0 else 0


def reserve_store(layer, like_k, like_v, slots) -> None:
    """``GearLayer._reserve_store``: every store at ``slots`` packed tokens, block factors included."""
    p, g, F = layer.p, layer.p.group_size, layer.flush_unit
    B, H, _, D = like_k.shape
    n, half = layer.n_quant, torch.float16

    def like(*tail, dtype=half):  # (B, H, 0, *tail): what `resized` copies the other dims from
        return like_k.new_empty(B, H, 0, *tail, dtype=dtype)

    codes = like(D * p.bits // 8, dtype=torch.uint8)
    layer.kc, layer.vc = resized(layer.kc, n, slots, codes), resized(layer.vc, n, slots, codes)
    layer.ks, layer.kz = resized(layer.ks, n // g, slots // g, like(D)), resized(layer.kz, n // g, slots // g, like(D))
    layer.vs, layer.vz = resized(layer.vs, n, slots, like(D // g)), resized(layer.vz, n, slots, like(D // g))
    if p.rank:
        layer.kl, layer.vl = resized(layer.kl, n, slots, like(p.rank)), resized(layer.vl, n, slots, like(p.rank))
        blocks = like(D, p.rank)
        if layer.krb is None:  # from the chunks flushed so far (no static step has run yet)
            layer.krb, layer.vrb = resized(None, 0, slots // F, blocks), resized(None, 0, slots // F, blocks)
            for c, (a, b) in enumerate(zip(layer.chunk_starts, layer.chunk_starts[1:] + [n])):
                layer.krb[:, :, a // F : b // F] = layer.kr[:, :, c : c + 1]
                layer.vrb[:, :, a // F : b // F] = layer.vr[:, :, c : c + 1]
        else:
            layer.krb = resized(layer.krb, n // F, slots // F, blocks)
            layer.vrb = resized(layer.vrb, n // F, slots // F, blocks)
    if p.outliers_per_group:
        m = p.outliers_per_group
        layer.ko = resized(layer.ko, n // g, slots // g, like(m, D, dtype=torch.uint8))
        layer.kx = resized(layer.kx, n // g, slots // g, like(m, D))
        layer.vo = resized(layer.vo, n, slots, like(D // g * m, dtype=torch.uint8))
        layer.vx = resized(layer.vx, n, slots, like(D // g * m))
    if p.sink_tokens and layer.sk is None:  # zero until flushed, as the eager flush leaves them
        layer.sk = like_k.new_zeros(B, H, p.sink_tokens, D, dtype=half)
        layer.sv = torch.zeros_like(layer.sk)
    if p.rank:
        power_start(D, p.rank, like_k.device)  # drawn here, not in a traced step
    static_address(*(t for t in layer._quant_tensors().values()))


def static_packed(layer, n) -> list:
    """``GearLayer._static_packed``: codes, factors, outliers and sinks dequantized over the store."""
    p, g, F = layer.p, layer.p.group_size, layer.flush_unit
    k = dequantize_per_channel(layer.kc, layer.ks, layer.kz, p.bits, g)  # (B, H, C, D)
    v = dequantize_per_token(layer.vc, layer.vs, layer.vz, p.bits, g)
    B, H, C, D = k.shape
    if p.rank:  # each block's left factors (F tokens) against its right factors
        k = k + (layer.kl.float().view(B, H, C // F, F, p.rank) @ layer.krb.float().transpose(-1, -2)).view(k.shape)
        v = v + (layer.vl.float().view(B, H, C // F, F, p.rank) @ layer.vrb.float().transpose(-1, -2)).view(v.shape)
    if p.outliers_per_group:  # exact corrections at each outlier's (token, channel); zero past n
        rows = (torch.arange(B, device=k.device)[:, None, None], torch.arange(H, device=k.device)[None, :, None])
        tok, chan = outlier_positions(layer.ko.long(), g, True)  # (B, H, O) each
        k = k.index_put((*rows, tok, chan), layer.kx.float().flatten(2), accumulate=True)
        tok, chan = outlier_positions(layer.vo.long().unflatten(3, (D // g, p.outliers_per_group)), g, False)
        v = v.index_put((*rows, tok, chan), layer.vx.float().flatten(2), accumulate=True)
    if layer.sk is not None:  # sink corrections (zero until flushed; a static step's layer has no padding)
        S = min(p.sink_tokens, C)
        k = torch.cat([k[:, :, :S] + layer.sk[:, :, :S].float(), k[:, :, S:]], 2)
        v = torch.cat([v[:, :, :S] + layer.sv[:, :, :S].float(), v[:, :, S:]], 2)
    return [(k, v, torch.arange(C, device=n.device) < n)]


def static_flush(layer, n, due) -> None:
    """``GearLayer._static_flush``: the window's first block compressed and written where ``due``."""
    p, g, F = layer.p, layer.p.group_size, layer.flush_unit
    k, v = layer.k_win[:, :, :F], layer.v_win[:, :, :F]  # (B, H, F, D): what `_flush` gets
    B = k.shape[0]
    sink = None
    if p.sink_tokens:
        j = torch.arange(p.sink_tokens, device=n.device)
        sink = ((j - n).clamp(0, F - 1).expand(B, -1), ((j >= n) & (j < n + F)).expand(B, -1))  # (B, S) each
    kc, ks, kz, kl, kr, ko, kx, k_sink = layer._compress(k, None, True, sink)
    vc, vs, vz, vl, vr, vo, vx, v_sink = layer._compress(v, None, False, sink)
    commit = due.view(1, 1, 1, 1)
    if sink is not None:
        here = k_sink[1][:, None, :, None] & commit
        layer.sk.copy_(torch.where(here, k_sink[0], layer.sk))
        layer.sv.copy_(torch.where(here, v_sink[0], layer.sv))
    cap = layer.kc.shape[2]
    tokens = (n + torch.arange(F, device=n.device)).clamp(max=cap - 1)  # repeats only where not committed
    groups = (n // g + torch.arange(F // g, device=n.device)).clamp(max=cap // g - 1)
    writes = [(layer.kc, kc, tokens), (layer.vc, vc, tokens), (layer.vs, vs, tokens), (layer.vz, vz, tokens),
              (layer.ks, ks, groups), (layer.kz, kz, groups)]
    if p.rank:
        block = (n // F).clamp(max=cap // F - 1)
        writes += [(layer.kl, kl, tokens), (layer.vl, vl, tokens),
                   (layer.krb, kr[:, :, None], block), (layer.vrb, vr[:, :, None], block)]
    if p.outliers_per_group:
        writes += [(layer.ko, ko, groups), (layer.kx, kx, groups), (layer.vo, vo, tokens), (layer.vx, vx, tokens)]
    for buf, x, index in writes:
        masked_write(buf, 2, index, x, commit)
