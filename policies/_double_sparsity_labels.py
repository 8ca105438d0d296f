"""Double Sparsity's optional 4-bit label codes (``label_bits=4``): per-token asymmetric
quantization of the label cache, two codes per byte."""
from __future__ import annotations

import torch


def quantize_labels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token asymmetric 4-bit codes of labels x [B, H, T, r].

    Returns packed uint8 codes [B, H, T, ceil(r / 2)] (two per byte, low nibble first) and fp16
    ``scale`` / ``zero`` [B, H, T, 1] with ``x ~= codes * scale + zero``.
    """
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)
    zero = lo.to(torch.float16)
    codes = ((xf - zero.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)  # (B, H, T, r)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale, zero


def dequantize_labels(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, r: int) -> torch.Tensor:
    """Inverse of :func:`quantize_labels`: fp32 labels [B, H, T, r]."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)[..., :r]  # (B, H, T, r)
    return codes.float() * scale.float() + zero.float()
