"""Launcher for the fused ShadowKV rebuild kernel: validate, allocate, launch.

Triton is imported lazily. CPU tensors run only under ``TRITON_INTERPRET=1`` (the tests); there the
inputs are upcast to fp32 first, because the interpreter silently mishandles bf16.
"""
from __future__ import annotations

import torch

from .checks import TRITON_REBUILD_HEAD_DIMS, check_rebuild_inputs
from .triton_decode import interpreting, require_cuda_or_interpreter

BLOCK_R = 16  # rank columns per dot step


def triton_shadowkv_rebuild(factor: torch.Tensor, basis: torch.Tensor, chunk_idx: torch.Tensor,
                            inv_freq: torch.Tensor, rope_start: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    """Triton implementation of `kvpress.kernels.shadowkv_rebuild` (same arguments and result).

    Raises
    ------
    ValueError
        Bad shapes / dtypes / devices (see `check_rebuild_inputs`), a head_dim outside
        ``TRITON_REBUILD_HEAD_DIMS`` or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    B, T_pad, R, H_kv, D, K = check_rebuild_inputs(factor, basis, chunk_idx, inv_freq, rope_start, chunk_size)
    if D not in TRITON_REBUILD_HEAD_DIMS:
        raise ValueError(f"triton shadowkv_rebuild supports head_dim in {TRITON_REBUILD_HEAD_DIMS}, got {D}; "
                         "use backend='torch'")
    require_cuda_or_interpreter(factor, "the triton shadowkv_rebuild backend")
    import triton  # noqa: F401  (lazy: only this backend needs it)

    from .triton_shadowkv_kernel import _shadowkv_rebuild_kernel

    out = torch.empty(B, H_kv, K * chunk_size, D, dtype=factor.dtype, device=factor.device)
    if out.numel() == 0:
        return out
    f, w = factor, basis
    if interpreting() and f.dtype != torch.float32:
        f, w = f.float(), w.float()
    f = f if f.stride(-1) == 1 else f.contiguous()
    w = w if w.stride(-1) == 1 and w.stride(2) == D else w.contiguous()  # a head's D values contiguous
    idx = chunk_idx if chunk_idx.stride(-1) == 1 else chunk_idx.contiguous()
    out_buf = out if out.dtype == f.dtype else torch.empty(out.shape, dtype=f.dtype, device=f.device)
    _shadowkv_rebuild_kernel[(B * H_kv, K)](
        f, w, idx, inv_freq.contiguous(), rope_start.to(torch.int64).contiguous(), out_buf,
        f.stride(0), f.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        idx.stride(0), idx.stride(1),
        out_buf.stride(0), out_buf.stride(1), out_buf.stride(2),
        H_kv, R,
        CHUNK=chunk_size, BLOCK_T=max(16, chunk_size), BLOCK_R=BLOCK_R, HALF_D=D // 2,
        DOT_PRECISION="ieee" if f.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if out_buf is not out:
        out.copy_(out_buf)
    return out
