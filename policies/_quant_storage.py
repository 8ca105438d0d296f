"""Buffers of the quantized cache layers (kivi, zipcache, gear), which grow with the tokens seen.

Packed stores (codes, scales, corrections) grow in fixed steps of ``GROW`` tokens
(`append_tokens`); the full-precision window starts at ``WINDOW_STEP`` slots and doubles up to
the most it holds between flushes (`window_slots`), so a short prompt under a large
``residual_length`` or ``flush_size`` holds about what ``full`` holds. With a planned capacity
(``cache.plan_capacity``) the layers with a static decode step size both for the whole generation
instead (`_quant_static.reserve_static`). Unused slots are real memory (zeroed), and
``cache_stats`` counts them.
"""
from __future__ import annotations

import torch

from kvpress.buffers import doubled_slots

GROW = 256  # packed stores grow in steps of this many tokens
WINDOW_STEP = 128  # the fewest window slots a layer allocates; they double up to its limit


def append_tokens(buf: torch.Tensor | None, length: int, x: torch.Tensor, grow: int = GROW) -> torch.Tensor:
    """Write ``x`` (B, H, n, ...) at ``buf[:, :, length:length + n]``, growing ``buf`` in ``grow`` steps."""
    n = x.shape[2]
    if buf is None or length + n > buf.shape[2]:
        buf = resized(buf, length, -(-(length + n) // grow) * grow, like=x)
    buf[:, :, length : length + n] = x
    return buf


def window_slots(tokens: int, limit: int) -> int:
    """Window slots for ``tokens`` tokens: ``WINDOW_STEP`` doubled until they fit, at most ``limit``
    (``residual_length + flush_unit``, the most a window holds between flushes); ``tokens`` itself
    beyond ``limit`` (a long prompt's tokens wait in the window for their flush)."""
    return tokens if tokens >= limit else doubled_slots(tokens, limit, WINDOW_STEP)


def resized(buf: torch.Tensor | None, length: int, slots: int, like: torch.Tensor) -> torch.Tensor:
    """A new buffer of ``slots`` tokens (dim 2) holding ``buf``'s first ``length`` tokens (the
    rest zero: a static decode step reads every slot, masked, and 0 * NaN would be NaN), with the
    other dims, dtype and device of ``like`` (B, H, n, ...)."""
    new = like.new_zeros(*like.shape[:2], slots, *like.shape[3:])
    if buf is not None and length:
        new[:, :, :length] = buf[:, :, :length]
    return new


def fill_with_group_median(x: torch.Tensor, idx: torch.Tensor, inside: torch.Tensor, group_size: int) -> torch.Tensor:
    """Keys ``x`` (B, H, n, D) with the rows ``idx[b, j]`` (where ``inside``) replaced by the
    median of their per-channel quantization group (``group_size`` tokens), so that a sink key
    kept exactly elsewhere does not stretch the range its group is quantized over."""
    B, H, n, D = x.shape
    rows = torch.zeros(B, n, dtype=torch.bool, device=x.device).scatter_(1, idx, inside)
    med = x.view(B, H, n // group_size, group_size, D).median(3, keepdim=True).values
    med = med.expand(-1, -1, -1, group_size, -1).reshape(x.shape)
    return torch.where(rows[:, None, :, None], med, x)
