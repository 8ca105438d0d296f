"""Launcher of the Triton `merge_states` (one launch instead of the torch path's ~25 small ops:
on a host-bound GPU machine a decode step's time is its launches). The launch is the torch op
``kvpress::triton_merge_states`` (`torch.library.triton_op`), so `torch.compile` traces the kernel,
not this Python. Triton is imported lazily; CPU tensors run only under ``TRITON_INTERPRET=1``
(the tests), upcast to fp32 there."""
from __future__ import annotations

import torch
from torch.library import triton_op

from .checks import interpreting, next_pow2 as _next_pow2, op_or_body, require_cuda_or_interpreter, wrap_kernel

BLOCK_R = 16  # rows (query heads x batch) per program


def triton_merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kvpress.kernels.merge_states` on CUDA (shapes already checked by the caller)."""
    require_cuda_or_interpreter(out_a, "the triton merge_states")
    return op_or_body("triton_merge_states", _merge_states_op)(out_a, lse_a, out_b, lse_b)


def _merge_states_op(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch of `triton_merge_states`: ``(out in out_a's dtype, fp32 lse)``."""
    from .triton_merge_kernel import _merge_two_kernel

    D = out_a.shape[-1]
    n = lse_a.numel()
    dtype = torch.float32 if interpreting() else out_a.dtype
    out = torch.empty(out_a.shape, dtype=dtype, device=out_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    if n and D:
        flat = lambda t: (t.float() if interpreting() else t).contiguous()  # noqa: E731
        wrap_kernel(_merge_two_kernel)[(-(-n // BLOCK_R),)](
            flat(out_a), flat(lse_a), flat(out_b), flat(lse_b), out, lse, n,
            HEAD_DIM=D, BLOCK_R=BLOCK_R, BLOCK_D=max(16, _next_pow2(D)), num_warps=4)
    return (out if out.dtype == out_a.dtype else out.to(out_a.dtype)), lse


triton_op("kvpress::triton_merge_states", _merge_states_op, mutates_args=())
