"""One decode step of attention over a packed (KIVI-format) cache: `quant_decode` and its
dequantizing reference and torch implementation. The formats, quantizers and the torch readers
the torch implementation is built from are in `kvpress.kernels.quant`; the Triton kernel in
`kvpress.kernels.triton_quant`.
"""
from __future__ import annotations

import math

import torch

from .quant import (channel_quant_scores, check_quant_config, dequantize_per_channel, dequantize_per_token,
                    token_quant_values)
from .quant_refine import dequantize_refinement, refined_scores


def _check_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size, value_group_size=None,
                  refine=None):
    """Validate a packed decode call; returns (B, H_q, H_kv, T, D, value group size resolved)."""
    value_group_size = group_size if value_group_size is None else value_group_size
    check_quant_config(bits, group_size)  # keys are grouped over tokens: any head_dim
    if q.dim() != 3:
        raise ValueError(f"q must have shape (B, H_q, D), got {tuple(q.shape)}")
    B, H_q, D = q.shape
    check_quant_config(bits, value_group_size, D)
    if k_codes.dim() != 4 or k_codes.dtype != torch.uint8 or v_codes.dtype != torch.uint8:
        raise ValueError("k_codes / v_codes must be uint8 (B, H_kv, T, D * bits / 8)")
    Bk, H_kv, T, Dp = k_codes.shape
    if Bk != B or Dp * 8 != D * bits or v_codes.shape != k_codes.shape:
        raise ValueError(f"codes {tuple(k_codes.shape)} / {tuple(v_codes.shape)} do not match q {tuple(q.shape)} "
                         f"at {bits} bits (expected ({B}, H_kv, T, {D * bits // 8}))")
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"H_q ({H_q}) must be a multiple of H_kv ({H_kv})")
    if T % group_size:
        raise ValueError(f"token count {T} must be a multiple of group_size={group_size}")
    if k_scale.shape != (B, H_kv, T // group_size, D) or k_zero.shape != k_scale.shape:
        raise ValueError(f"k_scale / k_zero must be (B, H_kv, T/group_size, D) = {(B, H_kv, T // group_size, D)}")
    if v_scale.shape != (B, H_kv, T, D // value_group_size) or v_zero.shape != v_scale.shape:
        raise ValueError(f"v_scale / v_zero must be (B, H_kv, T, D/value_group_size) = "
                         f"{(B, H_kv, T, D // value_group_size)}")
    if refine is not None:
        rc, rs, ch = refine
        R = ch.shape[-1] if ch.dim() == 3 else -1
        if (bits > 4 or ch.dtype != torch.int64 or ch.shape[:2] != (B, H_kv) or not 0 < R <= D
                or rc.dtype != torch.uint8 or rc.shape != (B, H_kv, T, R * bits // 8) or (R * bits) % 8
                or rs.dtype != torch.float16 or rs.shape != (B, H_kv, T // group_size, R)):
            raise ValueError(f"refine must be (fine_codes uint8 (B, H_kv, T, R * bits / 8), fine_scale fp16 "
                             f"(B, H_kv, T / group_size, R), channels int64 (B, H_kv, R)) with 0 < R <= {D}, "
                             f"R * bits % 8 == 0 and bits <= 4 (kvpress.kernels.quant.quantize_refined_keys)")
    return B, H_q, H_kv, T, D, value_group_size


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
        takes), "triton", or "torch".
    refine : ``(fine_codes, fine_scale, channels)`` or None: refined key channels whose second
        codes add to the keys (:func:`quantize_refined_keys`; ``bits <= 4``; triton takes a
        power-of-two channel count).

    Returns
    -------
    out : (B, H_q, D) in q's dtype.   lse : fp32 (B, H_q), -inf where nothing is attended.
    """
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"backend must be one of {QUANT_BACKENDS}, got {backend!r}")
    if backend == "auto":
        from .checks import MAX_GROUP
        from .decode import triton_available

        # the triton kernel takes GQA groups up to MAX_GROUP and its head dims; the torch path everything else
        backend = "torch"
        if q.is_cuda and triton_available():
            from .triton_quant import TRITON_QUANT_HEAD_DIMS

            R = 0 if refine is None else refine[2].shape[-1]
            if (q.shape[-1] in TRITON_QUANT_HEAD_DIMS and q.shape[1] // max(1, k_codes.shape[1]) <= MAX_GROUP
                    and not R & (R - 1)):  # refined channels: a power-of-two count
                backend = "triton"
    if backend == "triton":
        from .triton_quant import triton_quant_decode

        return triton_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits=bits,
                                   group_size=group_size, seq_starts=seq_starts, scale=scale,
                                   value_group_size=value_group_size, refine=refine)
    return torch_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits=bits,
                              group_size=group_size, seq_starts=seq_starts, scale=scale,
                              value_group_size=value_group_size, refine=refine)
