"""The quantizers' static decode step (`QuantWindowLayer`'s ``plan.static`` path) in pure torch,
as functions of the layer: fixed shapes over the preallocated stores, positions and the flush
decision on the device. The window ``k_win`` / ``v_win`` and the counts ``seen``, ``n_quant``,
``win_len`` are the layer's; so are its store hooks (``_store_slots``, ``_reserve_store``,
``_static_packed``, ``_static_flush``, ``_static_after_attend``), implemented by each policy with
``static_decode = True``.

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


def static_sizes(layer, tokens) -> tuple:
    """``(window slots, packed slots)`` a static step of quantized ``layer`` needs while a row holds
    at most ``tokens`` tokens: the window never holds more than ``residual_length + flush_unit`` of
    them, nor the store more than `packed_count` of them (no store at all while the window never
    fills)."""
    limit = layer.residual_length + layer.flush_unit
    packed = torch.sym_max(tokens - layer.residual_length, 0) // layer.flush_unit * layer.flush_unit
    return torch.sym_min(tokens, limit), packed


def reserve_planned(layer, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
    """With a planned capacity, size ``layer``'s storage for every decode step of the generation now
    (after an eager forward), so that its static steps keep one shape. A cache never planned keeps
    the eager sizes (no block factors for gear) until a traced step reserves a bucket: one more
    graph for that step."""
    if layer.static_decode and layer.cache.capacity:
        reserve_static(layer, like_k, like_v, layer.cache.capacity)


def reserve_static(layer, like_k: torch.Tensor, like_v: torch.Tensor, tokens: int) -> None:
    """Storage of static steps for ``tokens`` tokens at least (the planned capacity, else a
    `capacity_bucket`): the window and the packed store (``layer._reserve_store``) at
    `static_sizes`. Unused slots are zero, so masked slots never turn an output into NaN. The bytes
    are real and counted."""
    window, packed = static_sizes(layer, max(capacity_bucket(tokens), layer.cache.capacity or 0))
    if layer.k_win is None or layer.k_win.shape[2] < window:
        layer.k_win = resized(layer.k_win, layer.win_len, window, like=like_k)
        layer.v_win = resized(layer.v_win, layer.win_len, window, like=like_v)
    static_address(layer.k_win, layer.v_win)  # (also a window the prompt already sized)
    if layer._store_slots() != packed and packed >= layer.n_quant:  # (a cache outgrowing its plan grows eagerly)
        layer._reserve_store(like_k, like_v, packed)


def static_attend(layer, q, k_new, v_new, scaling, pos: torch.Tensor) -> torch.Tensor:
    """`attend` of a static decode step of quantized ``layer`` whose token sits at sequence index
    ``pos`` ([1] long) of that layer (a row of a padded batch counts from its first real token)."""
    if layer.v_basis is None:
        return _static_step(layer, q, k_new, v_new, scaling, pos)
    return layer.from_stored_values(_static_step(layer, q, k_new, layer.to_stored_values(v_new), scaling, pos))


def _static_step(layer, q, k_new, v_new, scaling, pos):
    """One decode token with fixed shapes and no host count read into a tensor: written at window
    slot ``pos - n`` (``n`` = `packed_count`), attended with the packed store dequantized over its
    whole capacity (``layer._static_packed``: the slots past ``n`` masked) and the window under one
    softmax, then the window's first ``flush_unit`` tokens packed at ``n`` (``layer._static_flush``)
    and the window shifted, committed only when the window is full (the eager path's flush point)."""
    window, packed = static_sizes(layer, layer.seen + 1)
    if layer.k_win is None or layer.k_win.shape[2] < window or layer._store_slots() < packed:
        reserve_static(layer, k_new, v_new, layer.seen + 1)  # an unplanned cache outgrown: a new shape
    B, H_q, _, D = q.shape
    H, W, F = k_new.shape[1], layer.k_win.shape[2], layer.flush_unit
    n = packed_count(pos, layer.residual_length, F)  # [1]
    slot = pos - n  # [1]: the new token's window slot
    layer.k_win.index_copy_(2, slot, k_new)
    layer.v_win.index_copy_(2, slot, v_new)
    win_visible = torch.arange(W, device=q.device) <= slot  # (W,)
    qg = q[:, :, 0].float().view(B, H, H_q // H, D)
    stored = layer._store_slots() > 0
    parts = layer._static_packed(n) if stored else []
    out, lse = decode_over_parts(qg, scaling, parts + [(layer.k_win.float(), layer.v_win.float(), win_visible)])
    layer._static_after_attend(q, lse.view(B, H_q, 1), pos, scaling)
    if stored:  # (without a store the window never fills)
        due = slot + 1 == layer.residual_length + F  # [1]: the window is full, the eager flush point
        layer._static_flush(n, due)
        for buf in (layer.k_win, layer.v_win):
            buf.copy_(torch.where(due.view(1, 1, 1, 1), buf.roll(-F, 2), buf))
    layer.count_static_step()
    return out.view(B, H_q, 1, D).to(q.dtype)
