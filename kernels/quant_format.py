"""The packed low-bit format's basics: allowed bits and group sizes, packing codes into bytes and
back, and the min/max quantizer (`kvpress.kernels.quant` documents the format and re-exports all
of these). A leaf module: `quant`, `quant_refine` and the input checks of every packed-store
kernel import it, it imports nothing of kvpress."""
from __future__ import annotations

import torch

ALLOWED_BITS = (2, 4, 8)
ALLOWED_GROUP_SIZES = (8, 16, 32, 64, 128)


def check_quant_config(bits: int, group_size: int, head_dim: int | None = None) -> None:
    """Raise ValueError unless ``bits`` and ``group_size`` are supported (and divide ``head_dim``)."""
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {list(ALLOWED_BITS)}")
    if group_size not in ALLOWED_GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r} is not supported; allowed: {list(ALLOWED_GROUP_SIZES)}")
    if head_dim is not None and head_dim % group_size:
        fits = [g for g in ALLOWED_GROUP_SIZES if head_dim % g == 0]
        hint = (f"pick a group_size in {fits}" if fits else
                f"no supported group size ({list(ALLOWED_GROUP_SIZES)}) divides it, so this model's KV cache "
                "cannot be quantized in channel groups; use a policy that does not quantize")
        raise ValueError(f"head_dim={head_dim} is not divisible by group_size={group_size}; {hint}")


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)  # (8 / bits,)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``(..., N)`` (values < 2^bits) into uint8 ``(..., N * bits / 8)``."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last dim {codes.shape[-1]} must be a multiple of {per} to pack {bits}-bit codes")
    if per == 1:
        return codes.to(torch.uint8).contiguous()
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per)  # (..., N/per, per)
    packed = grouped[..., 0].clone()
    for i in range(1, per):
        packed |= grouped[..., i] << (i * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``(..., N * bits / 8)`` -> uint8 ``(..., N)``."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    out = (packed[..., None] >> _shifts(bits, packed.device)) & mask  # (..., N/per, per)
    return out.reshape(*packed.shape[:-1], -1)


def _quantize(x: torch.Tensor, bits: int, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantize ``x`` (fp32) over ``reduce_dim``; scale and zero are rounded to fp16 first
    so that the codes are optimal for the parameters actually stored."""
    levels = (1 << bits) - 1
    mn = x.amin(dim=reduce_dim, keepdim=True)
    mx = x.amax(dim=reduce_dim, keepdim=True)
    scale = ((mx - mn) / levels).to(torch.float16)
    zero = mn.to(torch.float16)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: every code 0, exact
    codes = torch.clamp(torch.round((x - zero.float()) / s), 0, levels).to(torch.uint8)
    return codes, scale, zero
