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
