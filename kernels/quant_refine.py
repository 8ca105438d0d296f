"""Refined key channels: per-channel keys with a few channels of each head at twice the bits
(``zipcache``'s ``refine_key_channels``). Re-exported by `kvpress.kernels.quant`; the quantizer
and packing are `kvpress.kernels.quant_format`'s; read by its torch / reference decode,
`kvpress.kernels.native.quant_attend`
(``PackedSegment.refine``) and the fused Triton ``quant_decode`` (``refine=``)."""
from __future__ import annotations

import torch

from .quant_format import _quantize, check_quant_config, pack_codes, unpack_codes


def quantize_refined_keys(x: torch.Tensor, bits: int, group_size: int, channels: torch.Tensor):
    """Per-channel keys at ``bits``, the ``channels`` of each head at ``2 * bits`` (a second code).

    A refined channel is quantized at ``2 * bits`` bits over its token group (code ``c``, scale
    ``s``, zero ``z``) and split: its high ``bits`` bits ``c >> bits`` take the channel's place in
    the ordinary codes with scale ``s * 2**bits`` (exact in fp16) and zero ``z``, so every reader
    of :func:`quantize_per_channel`'s format reads the coarse key unchanged; the low bits go to a
    second packed code with scale ``s`` and no zero. The two dequantized parts add up to the
    ``2 * bits``-bit key exactly.

    Parameters
    ----------
    x : Tensor (B, H, T, D), any float dtype; ``T`` a multiple of ``group_size``.
    channels : long (B, H, R), distinct channel ids per head; ``R * bits`` a multiple of 8; ``bits <= 4``.

    Returns
    -------
    codes : uint8 (B, H, T, D * bits / 8); scale, zero : fp16 (B, H, T / group_size, D)
        the ordinary per-channel format.
    fine_codes : uint8 (B, H, T, R * bits / 8); fine_scale : fp16 (B, H, T / group_size, R)
        the refined channels' low bits: ``key[..., channels] += fine_codes * fine_scale``.
    """
    check_quant_config(bits, group_size)
    if bits > 4:
        raise ValueError(f"refined keys take 2 * bits bits, at most 8: bits={bits} is not allowed; allowed: 2, 4")
    B, H, T, D = x.shape
    R = channels.shape[-1]
    if T % group_size:
        raise ValueError(f"per-channel quantization needs a token count divisible by group_size={group_size}, got {T}")
    if channels.shape[:2] != (B, H) or (R * bits) % 8:
        raise ValueError(f"channels {tuple(channels.shape)} must be (B, H, R) = ({B}, {H}, R) with R * bits % 8 == 0")
    xg = x.float().reshape(B, H, T // group_size, group_size, D)
    codes, scale, zero = _quantize(xg, bits, reduce_dim=3)  # (B, H, NG, G, D), (B, H, NG, 1, D) x2
    idx = channels[:, :, None, None, :]
    fine, f_scale, f_zero = _quantize(xg.gather(4, idx.expand(-1, -1, T // group_size, group_size, -1)),
                                      2 * bits, reduce_dim=3)
    codes.scatter_(4, idx.expand(-1, -1, T // group_size, group_size, -1), fine >> bits)
    scale.scatter_(4, idx.expand(-1, -1, T // group_size, 1, -1), f_scale * (1 << bits))
    zero.scatter_(4, idx.expand(-1, -1, T // group_size, 1, -1), f_zero)
    fine = fine & ((1 << bits) - 1)
    return (pack_codes(codes.reshape(B, H, T, D), bits), scale.squeeze(3), zero.squeeze(3),
            pack_codes(fine.reshape(B, H, T, R), bits), f_scale.squeeze(3))


def dequantize_refinement(codes, scale, bits: int, group_size: int) -> torch.Tensor:
    """fp32 (B, H, T, R): the refined key channels' corrections from :func:`quantize_refined_keys`'
    ``fine_codes`` / ``fine_scale`` (``code * scale``, no zero point)."""
    c = unpack_codes(codes, bits).float()  # (B, H, T, R)
    B, H, T, R = c.shape
    return (c.view(B, H, T // group_size, group_size, R) * scale[:, :, : T // group_size, None].float()).view(B, H, T, R)


def refined_scores(q: torch.Tensor, refine, bits: int, group_size: int) -> torch.Tensor:
    """The refined channels' share of ``q @ k^T``: q fp32 (B, H, M, D); ``refine`` = ``(fine_codes,
    fine_scale, channels)`` of T tokens (:func:`quantize_refined_keys`). fp32 (B, H, M, T)."""
    codes, scale, channels = refine
    qr = q.gather(3, channels[:, :, None, :].expand(-1, -1, q.shape[2], -1))  # (B, H, M, R)
    return qr @ dequantize_refinement(codes, scale, bits, group_size).transpose(-1, -2)
