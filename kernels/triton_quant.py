"""Launchers of the Triton quantization kernels: validate, allocate, pick the grid, launch.

The launches are the torch ops ``kvpress::triton_quant_decode`` and ``kvpress::triton_quantize_pack``
(`torch.library.triton_op`, kernels launched through `torch.library.wrap_triton`), so `torch.compile`
traces the kernels, not this Python. Triton is imported lazily here, so ``import kvpress.kernels``
works without it. CPU tensors run only under ``TRITON_INTERPRET=1`` (the tests); there inputs are
upcast to fp32 first, because the interpreter silently mishandles bf16.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.library import triton_op

from .checks import (MAX_GROUP, TRITON_QUANT_HEAD_DIMS, check_quant_decode as _check_decode,  # noqa: F401
                     interpreting, next_pow2 as _next_pow2, op_or_body, require_cuda_or_interpreter, wrap_kernel)
from .quant_format import check_quant_config
from .triton_decode import MAX_SPLITS, _sm_count
# decode launch configuration, from H200 sweeps (``benchmarks/gpu/tune_quant.py``) with PTX_CODES: one warp per
# 32 tokens of a tile was the best warp count at every tile size; 64-token tiles were fastest for one row of 8 KV
# heads, 32-token tiles for 2, 4 and 8 rows (more, smaller programs); 16 split-K programs per multiprocessor
FEW_PAIRS = 8  # launches of at most this many (row, KV head) pairs take the larger tiles
TILE_FEW, TILE_MANY = 64, 32  # tokens per decode tile (at least the key token group)
NUM_STAGES = 3
PROGRAMS_PER_SM = 16  # split-K aims at this many decode programs per multiprocessor
OVERRIDE = None  # (tokens per tile, warps, programs per SM) for every decode launch: the GPU sweep's knob
EARLY_LOADS = FP32_SCALES = True  # the kernel's form (its docstring); the sweep's --forms compares the others
PTX_CODES = True  # fp16 tiles unpack codes by PTX bit tricks, not conversions (CUDA only; the interpreter: never)
BLOCK_T = 32  # tokens per quantize tile (per-token format)


def launch_config(pairs: int, group_size: int, bits: int) -> tuple[int, int, int]:
    """(tokens per tile, warps, split-K programs per SM) of a decode launch over ``pairs``
    (row, KV head) pairs whose key token groups hold ``group_size`` tokens (a tile holds whole
    groups). 8-bit codes get a warp per 16 tokens (untimed: at one per 32 they spill registers)."""
    if OVERRIDE is not None:
        block_n, warps, pps = OVERRIDE
        return max(block_n, group_size), warps, pps
    block_n = max(TILE_FEW if pairs <= FEW_PAIRS else TILE_MANY, group_size)
    return block_n, min(8, max(1, block_n // (16 if bits == 8 else 32))), PROGRAMS_PER_SM


def _splits(batch: int, heads: int, tokens: int, device: torch.device, block_n: int, pps: int) -> int:
    tiles = max(1, -(-tokens // block_n))
    target = pps * _sm_count(device) if device.type == "cuda" \
        else 2 * batch * heads
    return max(1, min(tiles, MAX_SPLITS, -(-target // max(1, batch * heads))))


def triton_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, bits: int, group_size: int,
                        seq_starts=None, scale: float | None = None, num_splits: int | None = None,
                        value_group_size: int | None = None, refine=None):
    """Triton implementation of :func:`kvpress.kernels.packed_decode.quant_decode` (same arguments and
    results); ``num_splits`` overrides the split-K count (tests use it to cover the merge)."""
    B, H_q, H_kv, T, D, value_group_size = _check_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                                         bits, group_size, value_group_size, refine)
    if D not in TRITON_QUANT_HEAD_DIMS:
        raise ValueError(f"triton quant_decode supports head_dim in {TRITON_QUANT_HEAD_DIMS}, got {D}; use backend='torch'")
    if H_q // H_kv > MAX_GROUP:
        raise ValueError(f"triton quant_decode supports GQA groups of 1..{MAX_GROUP} query heads per KV head, "
                         f"got {H_q // H_kv}; use backend='torch'")
    require_cuda_or_interpreter(q, "the triton quant_decode kernel")
    for name, t in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        if t.dtype != torch.float16 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be fp16 with a contiguous last dimension")
    for name, t in (("q", q), ("k_codes", k_codes), ("v_codes", v_codes)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if k_scale.stride() != k_zero.stride() or v_scale.stride() != v_zero.stride():
        raise ValueError("scale and zero tensors must share strides")
    R = 0 if refine is None else refine[2].shape[-1]
    if R and (R & (R - 1) or refine[0].stride(-1) != 1 or refine[1].stride(-1) != 1 or refine[2].stride(-1) != 1):
        raise ValueError(f"triton quant_decode reads a power-of-two count of refined key channels with contiguous "
                         f"last dims, got {R}; use backend='torch'")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    rc, rs, ridx = refine if R else (None, None, None)
    launch = op_or_body("triton_quant_decode", _quant_decode_op)
    return launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, seq_starts, rc, rs, ridx, bits, group_size,
                  value_group_size, scale, num_splits or 0)


def _quant_decode_op(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                     v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                     seq_starts: Optional[torch.Tensor], refine_codes: Optional[torch.Tensor],
                     refine_scale: Optional[torch.Tensor], refine_channels: Optional[torch.Tensor], bits: int,
                     group_size: int, value_group_size: int, scale: float,
                     num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches of `triton_quant_decode` (inputs validated): ``(out in q's dtype, fp32 lse)``."""
    import triton.language as tl

    from .triton_decode_kernel import _merge_splits_kernel
    from .triton_quant_kernel import _quant_decode_split_kernel

    B, H_q, D = q.shape
    H_kv, T = k_codes.shape[1], k_codes.shape[2]
    qc = q.float() if (interpreting() and q.dtype != torch.float32) else q
    out = torch.empty_like(qc)
    lse = torch.empty(B, H_q, device=q.device, dtype=torch.float32)
    if B * H_q == 0:
        return out.to(q.dtype), lse
    block_n, warps, pps = launch_config(B * H_kv, group_size, bits)
    splits = num_splits or _splits(B, H_kv, T, q.device, block_n, pps)
    tiles = max(1, -(-T // block_n))
    per_split = -(-tiles // splits)
    splits = -(-tiles // per_split)
    out_part = torch.empty(B, H_q, splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, H_q, splits, device=q.device, dtype=torch.float32)
    starts = seq_starts.to(device=q.device, dtype=torch.int64) if seq_starts is not None else lse  # dummy pointer
    R = 0 if refine_channels is None else refine_channels.shape[-1]
    # dummy pointers when there are no refined channels
    rc, rs, ridx = (refine_codes, refine_scale, refine_channels) if R else (k_codes, k_scale, starts)
    wrap_kernel(_quant_decode_split_kernel)[(B, H_kv, splits)](
        qc, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, out_part, lse_part, rc, rs, ridx,
        qc.stride(0), qc.stride(1),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_codes.stride(0), v_codes.stride(1), v_codes.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        out_part.stride(0), out_part.stride(1), out_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        *(rc.stride(0), rc.stride(1), rc.stride(2), rs.stride(0), rs.stride(1), rs.stride(2), ridx.stride(0),
          ridx.stride(1) if R else 0),
        scale * 1.4426950408889634, T, per_split * block_n,
        GROUP=H_q // H_kv, BLOCK_G=max(16, _next_pow2(H_q // H_kv)), BLOCK_N=block_n, HEAD_DIM=D,
        BITS=bits, GROUP_SIZE=group_size, VALUE_GROUP_SIZE=value_group_size, HAS_STARTS=seq_starts is not None,
        # fp32 queries keep fp32 tiles and exact dots (as the reference); fp16 / bf16 dequantize and dot in fp16
        DT=tl.float32 if qc.dtype == torch.float32 else tl.float16,
        DOT_PRECISION="ieee" if qc.dtype == torch.float32 else "tf32",
        EARLY_LOADS=EARLY_LOADS, FP32_SCALES=FP32_SCALES,
        PTX_CODES=PTX_CODES and qc.dtype != torch.float32 and not interpreting(), REFINE=R, num_warps=warps,
        num_stages=NUM_STAGES,
    )
    wrap_kernel(_merge_splits_kernel)[(B, H_q)](
        out_part, lse_part, out, lse,
        out_part.stride(0), out_part.stride(1), out_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        splits,
        BLOCK_S=_next_pow2(splits), HEAD_DIM=D,
        num_warps=4,
    )
    return out.to(q.dtype), lse


triton_op("kvpress::triton_quant_decode", _quant_decode_op, mutates_args=())


def triton_quantize_pack(x: torch.Tensor, bits: int, group_size: int, *, per_channel: bool):
    """Triton twin of :func:`~kvpress.kernels.quant.quantize_per_channel` (``per_channel=True``)
    and :func:`~kvpress.kernels.quant.quantize_per_token`: same outputs, except that exact
    rounding ties go up here (torch rounds half to even), so a code may differ by one there.

    x : (B, H, T, D) fp16 / bf16 / fp32, last dim contiguous, D in (64, 128).
    """
    check_quant_config(bits, group_size)
    if x.dim() != 4:
        raise ValueError(f"x must have shape (B, H, T, D), got {tuple(x.shape)}")
    B, H, T, D = x.shape
    check_quant_config(bits, group_size, D)
    if D not in TRITON_QUANT_HEAD_DIMS:
        raise ValueError(f"triton quantize supports head_dim in {TRITON_QUANT_HEAD_DIMS}, got {D}; use the torch version")
    if per_channel and T % group_size:
        raise ValueError(f"per-channel quantization needs a token count divisible by group_size={group_size}, got {T}")
    require_cuda_or_interpreter(x, "the triton quantize kernel")
    return op_or_body("triton_quantize_pack", _quantize_pack_op)(x, bits, group_size, per_channel)


def _quantize_pack_op(x: torch.Tensor, bits: int, group_size: int,
                      per_channel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch of `triton_quantize_pack` (inputs validated): codes, scale, zero."""
    from .triton_quant_kernel import _quantize_pack_kernel

    B, H, T, D = x.shape
    xc = x.float() if (interpreting() and x.dtype != torch.float32) else x
    xc = xc.reshape(B * H, T, D)
    if xc.stride(-1) != 1:
        xc = xc.contiguous()
    codes = torch.empty(B * H, T, D * bits // 8, dtype=torch.uint8, device=x.device)
    ps = (B * H, T // group_size, D) if per_channel else (B * H, T, D // group_size)
    scale = torch.empty(ps, dtype=torch.float16, device=x.device)
    zero = torch.empty(ps, dtype=torch.float16, device=x.device)
    block_t = group_size if per_channel else BLOCK_T
    if B * H * T:
        wrap_kernel(_quantize_pack_kernel)[(B * H, -(-T // block_t))](
            xc, codes, scale, zero,
            xc.stride(0), xc.stride(1), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
            T, BLOCK_T=block_t, HEAD_DIM=D, BITS=bits, GROUP_SIZE=group_size, PER_CHANNEL=per_channel,
            num_warps=4,
        )
    return codes.view(B, H, T, -1), scale.view(B, H, *ps[1:]), zero.view(B, H, *ps[1:])


triton_op("kvpress::triton_quantize_pack", _quantize_pack_op, mutates_args=())
