"""``gear``'s static decode store, as functions of a `kvpress.policies.gear.GearLayer` (its store
hooks for `kvpress.policies._quant_static`: GEAR's codes, block factors ``krb`` / ``vrb``,
outliers and sinks; `sync_chunks`, which brings the eager chunk list up to the blocks static steps
flushed), and the helpers they share with the eager paths: the power iteration's start matrix, the
positions of the stored outliers and their corrections added to dequantized keys and values."""
from __future__ import annotations

import torch

from kvpress.plan import static_address

from ._quant_static import masked_write
from ._quant_storage import append_tokens, resized

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


def add_outliers(layer, k: torch.Tensor, v: torch.Tensor, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k / v fp32 (B, H, N, D) plus the exact corrections of the outliers of the first ``n`` packed
    tokens (None: the whole store, zero past the packed tokens) at each outlier's (token, channel)."""
    g, m = layer.p.group_size, layer.p.outliers_per_group
    B, H, _, D = k.shape
    groups = None if n is None else n // g
    rows = (torch.arange(B, device=k.device)[:, None, None], torch.arange(H, device=k.device)[None, :, None])
    tok, chan = outlier_positions(layer.ko[:, :, :groups].long(), g, True)  # (B, H, O) each
    k = k.index_put((*rows, tok, chan), layer.kx[:, :, :groups].float().flatten(2), accumulate=True)
    tok, chan = outlier_positions(layer.vo[:, :, :n].long().unflatten(3, (D // g, m)), g, False)
    return k, v.index_put((*rows, tok, chan), layer.vx[:, :, :n].float().flatten(2), accumulate=True)


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

    layer._reserve_codes(like_k, slots)  # the codes and the sinks
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
    if p.rank:
        power_start(D, p.rank, like_k.device)  # drawn here, not in a traced step
    static_address(*(t for t in layer._quant_tensors().values()))


def static_packed(layer, n) -> list:
    """``GearLayer._static_packed``: codes, factors, outliers and sinks dequantized over the store."""
    p, F = layer.p, layer.flush_unit
    k, v = layer._dequantized_store()  # (B, H, C, D)
    B, H, C, D = k.shape
    if p.rank:  # each block's left factors (F tokens) against its right factors
        k = k + (layer.kl.float().view(B, H, C // F, F, p.rank) @ layer.krb.float().transpose(-1, -2)).view(k.shape)
        v = v + (layer.vl.float().view(B, H, C // F, F, p.rank) @ layer.vrb.float().transpose(-1, -2)).view(v.shape)
    if p.outliers_per_group:  # zero past n
        k, v = add_outliers(layer, k, v)
    if layer.sk is not None:  # sink corrections (zero until flushed; a static step's layer has no padding)
        S = min(p.sink_tokens, C)
        k = torch.cat([k[:, :, :S] + layer.sk[:, :, :S].float(), k[:, :, S:]], 2)
        v = torch.cat([v[:, :, :S] + layer.sv[:, :, :S].float(), v[:, :, S:]], 2)
    return [(k, v, torch.arange(C, device=n.device) < n)]


def static_flush(layer, n, due) -> None:
    """``GearLayer._static_flush``: the window's first block compressed and written where ``due``."""
    p, g, F = layer.p, layer.p.group_size, layer.flush_unit
    k, v = layer.k_win[:, :, :F], layer.v_win[:, :, :F]  # (B, H, F, D): what `_flush` gets
    sink = layer._static_sinks(n, k.shape[0]) if p.sink_tokens else None  # (B, S) each
    kc, ks, kz, kl, kr, ko, kx, k_sink = layer._compress(k, None, True, sink)
    vc, vs, vz, vl, vr, vo, vx, v_sink = layer._compress(v, None, False, sink)
    commit = due.view(1, 1, 1, 1)
    if sink is not None:
        layer._keep_sinks(k_sink[0], v_sink[0], k_sink[1], commit)
    layer._write_codes(n, (kc, ks, kz), (vc, vs, vz), commit)
    cap = layer.kc.shape[2]
    tokens = (n + torch.arange(F, device=n.device)).clamp(max=cap - 1)  # repeats only where not committed
    groups = (n // g + torch.arange(F // g, device=n.device)).clamp(max=cap // g - 1)
    writes = []
    if p.rank:
        block = (n // F).clamp(max=cap // F - 1)
        writes += [(layer.kl, kl, tokens), (layer.vl, vl, tokens),
                   (layer.krb, kr[:, :, None], block), (layer.vrb, vr[:, :, None], block)]
    if p.outliers_per_group:
        writes += [(layer.ko, ko, groups), (layer.kx, kx, groups), (layer.vo, vo, tokens), (layer.vx, vx, tokens)]
    for buf, x, index in writes:
        masked_write(buf, 2, index, x, commit)


def sync_chunks(layer) -> None:
    """Give the blocks that static steps flushed (``_chunked_to .. n_quant``, one chunk each) their
    chunk starts and right factors, as eager flushes would have left them (before an eager forward
    reads or extends the chunks)."""
    F = layer.flush_unit
    if layer._chunked_to >= layer.n_quant:
        return
    for start in range(layer._chunked_to, layer.n_quant, F):
        nc = len(layer.chunk_starts)
        if layer.p.rank:
            layer.kr = append_tokens(layer.kr, nc, layer.krb[:, :, start // F][:, :, None], 16)
            layer.vr = append_tokens(layer.vr, nc, layer.vrb[:, :, start // F][:, :, None], 16)
        layer.chunk_starts.append(start)
    layer._chunked_to = layer.n_quant
    layer._chunk_ids = layer._chunk_bounds = None
