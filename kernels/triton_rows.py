"""Launcher for the Triton `attend_rows` kernel: validate, allocate, launch (one program per
(row, KV head)). The launch is the torch op ``kvpress::triton_attend_rows`` (`torch.library.triton_op`),
so `torch.compile` traces the kernel, not this Python. Triton is imported lazily; CPU tensors run
only under ``TRITON_INTERPRET=1``, upcast to fp32 there (the interpreter mishandles bf16)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .checks import (MAX_GROUP, TRITON_HEAD_DIMS, TRITON_MAX_SETS, check_row_sets, interpreting,
                     next_pow2 as _next_pow2, op_or_body, require_cuda_or_interpreter, wrap_kernel)
from .triton_decode import BLOCK_N


def triton_attend_rows(q: torch.Tensor, sets, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `kvpress.kernels.rows.attend_rows` (same arguments and results)."""
    B, H_q, H, G, D = check_row_sets(q, sets)
    if D not in TRITON_HEAD_DIMS or G > MAX_GROUP or len(sets) > TRITON_MAX_SETS:
        raise ValueError(f"the triton attend_rows takes head_dim in {TRITON_HEAD_DIMS}, GQA groups up to {MAX_GROUP} "
                         f"and up to {TRITON_MAX_SETS} row sets, got head_dim {D}, group {G}, {len(sets)} sets; "
                         "use backend='torch' (or 'auto', which falls back to it)")
    require_cuda_or_interpreter(q, "the triton attend_rows backend")
    return op_or_body("triton_attend_rows", _attend_rows_op)(q, [s[0] for s in sets], [s[1] for s in sets],
                                                [s[2] for s in sets], [int(s[3]) for s in sets], float(scale))


def _attend_rows_op(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                    cnts: list[Optional[torch.Tensor]], ns: list[int],
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch of `triton_attend_rows` (inputs validated): fp32 ``(out, lse)``."""
    from .triton_rows_kernel import _attend_rows_kernel

    sets = list(zip(ks, vs, cnts, ns))
    B, H_q, D = q.shape
    H = ks[0].shape[1]
    G = H_q // H
    dtype = torch.float32 if interpreting() else q.dtype
    qc = q.to(dtype).contiguous()
    out = torch.empty(B, H_q, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H_q, device=q.device, dtype=torch.float32)
    if B * H_q == 0:
        return out, lse
    ptrs, sizes, strides, has_cnt = [], [], [], []
    for i in range(TRITON_MAX_SETS):
        if i < len(sets):
            k, v, cnt, n = sets[i]
            k = k.to(dtype) if k.dtype != dtype else k
            v = v.to(dtype) if v.dtype != dtype else v
            k = k if k.stride(-1) == 1 else k.contiguous()
            v = v if v.stride(-1) == 1 else v.contiguous()
            c = cnt.to(torch.int32) if cnt is not None else k  # k: a pointer never read (CNT* is False)
        else:  # unused slot: the first set's tensors, never read (NUM_SETS stops before it)
            k, v, c, n, cnt = ptrs[0], ptrs[1], ptrs[2], 0, None
        ptrs += [k, v, c]
        sizes.append(n)
        strides += [k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                    c.stride(0) if cnt is not None else 0, c.stride(1) if cnt is not None else 0]
        has_cnt.append(cnt is not None)
    wrap_kernel(_attend_rows_kernel)[(B, H)](
        qc, out, lse, *ptrs, *sizes,
        qc.stride(0), qc.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        *strides,
        scale * 1.4426950408889634,
        NUM_SETS=len(sets), CNT0=has_cnt[0], CNT1=has_cnt[1], CNT2=has_cnt[2], CNT3=has_cnt[3],
        GROUP=G, BLOCK_G=max(16, _next_pow2(G)), BLOCK_N=BLOCK_N, HEAD_DIM=D,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    return out, lse


triton_op("kvpress::triton_attend_rows", _attend_rows_op, mutates_args=())
