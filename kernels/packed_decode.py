"""One decode step of attention over a packed (KIVI-format) cache: `quant_decode` and its
dequantizing reference and torch implementation. The formats, quantizers and the torch readers
the torch implementation is built from are in `kvpress.kernels.quant`; the Triton kernel in
`kvpress.kernels.triton_quant`.
"""
from __future__ import annotations

import math

import torch

from .backend import quant_decode_backend
from .checks import check_quant_decode
from .quant_format import check_quant_config  # noqa: F401  (importable from here, as before)
from .quant import (channel_quant_scores, dequantize_per_channel, dequantize_per_token,
                    token_quant_values)
from .quant_refine import dequantize_refinement, refined_scores
from .triton_quant import triton_quant_decode


_check_decode = check_quant_decode  # the name the launchers and tests used


def _finish(scores: torch.Tensor, seq_starts) -> tuple[torch.Tensor, torch.Tensor]:
    if seq_starts is not None:
        t = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(t < seq_starts.view(-1, 1, 1, 1).long(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, M)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - safe[..., None]), lse


def reference_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, bits: int, group_size: int,
                           seq_starts=None, scale: float | None = None, value_group_size: int | None = None,
                           refine=None):
    """Dequantize everything to fp32, then plain softmax attention: the definition of
    :func:`quant_decode` (tests only; it materialises the cache)."""
    B, H_q, H_kv, T, D, value_group_size = _check_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                                         bits, group_size, value_group_size, refine)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = dequantize_per_channel(k_codes, k_scale, k_zero, bits, group_size)
    if refine is not None:
        k.scatter_add_(3, refine[2][:, :, None, :].expand(-1, -1, T, -1),
                       dequantize_refinement(refine[0], refine[1], bits, group_size))
    v = dequantize_per_token(v_codes, v_scale, v_zero, bits, value_group_size)
    qg = q.float().view(B, H_kv, H_q // H_kv, D)
    p, lse = _finish(qg @ k.transpose(-1, -2) * scale, seq_starts)
    return (p @ v).view(B, H_q, D).to(q.dtype), lse.view(B, H_q)


def torch_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, bits: int, group_size: int,
                       seq_starts=None, scale: float | None = None, value_group_size: int | None = None,
                       refine=None):
    """Torch implementation of :func:`quant_decode` (chunked, no dequantized cache)."""
    B, H_q, H_kv, T, D, value_group_size = _check_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                                         bits, group_size, value_group_size, refine)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.float().view(B, H_kv, H_q // H_kv, D) * scale
    s = channel_quant_scores(qg, k_codes, k_scale, k_zero, bits, group_size)
    if refine is not None:
        s = s + refined_scores(qg, refine, bits, group_size)
    p, lse = _finish(s, seq_starts)
    out = token_quant_values(p, v_codes, v_scale, v_zero, bits, value_group_size)
    return out.view(B, H_q, D).to(q.dtype), lse.view(B, H_q)


QUANT_BACKENDS = ("auto", "triton", "torch")


def quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, bits: int, group_size: int,
                 seq_starts: torch.Tensor | None = None, scale: float | None = None, backend: str = "auto",
                 value_group_size: int | None = None, refine=None):
    """One decode step of attention over a KIVI-format packed cache, dequantizing inside the loop.

    Parameters
    ----------
    q : Tensor (B, H_q, D), fp16 / bf16 / fp32; query head h reads KV head h // (H_q / H_kv).
    k_codes, v_codes : uint8 (B, H_kv, T, D * bits / 8)
        Keys per-channel (groups of ``group_size`` tokens), values per-token (groups of
        ``value_group_size`` channels); ``T`` a multiple of ``group_size``.
    k_scale, k_zero : fp16 (B, H_kv, T / group_size, D)
    v_scale, v_zero : fp16 (B, H_kv, T, D / value_group_size)
    bits : 2, 4 or 8.  group_size, value_group_size : in ``ALLOWED_GROUP_SIZES``; the value
        group divides D (``value_group_size=None`` means ``group_size``, KIVI's single group).
    seq_starts : int (B,) or None
        Tokens before ``seq_starts[b]`` are not attended (left padding).
    scale : float, default ``D ** -0.5``.
    backend : "auto" (triton on CUDA when importable, for the head dims and GQA groups (<= 16) it
        takes; `kvpress.kernels.backend.quant_decode` decides), "triton", or "torch".
    refine : ``(fine_codes, fine_scale, channels)`` or None: refined key channels whose second
        codes add to the keys (:func:`quantize_refined_keys`; ``bits <= 4``; triton takes a
        power-of-two channel count).

    Returns
    -------
    out : (B, H_q, D) in q's dtype.   lse : fp32 (B, H_q), -inf where nothing is attended.
    """
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"backend must be one of {QUANT_BACKENDS}, got {backend!r}")
    if quant_decode_backend(q, k_codes, refine, backend) == "triton":
        return triton_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits=bits,
                                   group_size=group_size, seq_starts=seq_starts, scale=scale,
                                   value_group_size=value_group_size, refine=refine)
    return torch_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits=bits,
                              group_size=group_size, seq_starts=seq_starts, scale=scale,
                              value_group_size=value_group_size, refine=refine)
