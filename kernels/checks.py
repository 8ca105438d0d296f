"""Input validation and limits shared by the kernels' backends (clear ValueErrors, never asserts).

A leaf of the kernels' import graph (it imports only `index` and `quant_format`): the public entry
points (`decode`, `rows`, `packed_decode`, ...), their Triton launchers (``triton_*.py``) and
`kvpress.kernels.backend` all check their inputs with the functions here.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .index import SparseIndex
from .quant_format import check_quant_config

ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# largest GQA group (query heads per KV head) the Triton kernels take: a KV head's group is one tile of
# max(16, next_pow2(G)) query rows, so 9..16 cost the same rows as 1..8 (Llama-3.1-405B and Qwen3-235B have 16).
# The compiled CPU kernels (`native`) take up to 8; larger groups run the torch path there. torch: any.
MAX_GROUP = 16
TRITON_HEAD_DIMS = (64, 128)  # head dims of the Triton sparse_decode / attend_rows kernels
TRITON_QUANT_HEAD_DIMS = (64, 128)  # head dims of the Triton quant_decode / quantize kernels
TRITON_MAX_SETS = 4  # row sets one Triton attend_rows launch takes
NATIVE_MAX_GROUP = 8  # query heads per KV head the compiled CPU kernels take
NATIVE_MAX_SETS = 8  # row sets one native attend_rows call takes


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_cuda_or_interpreter(t: torch.Tensor, what: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter (the tests)."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{what} needs CUDA tensors (got {t.device}); use backend='torch' on CPU, "
                         "or set TRITON_INTERPRET=1 before importing triton to test the kernel")


def wrap_kernel(kernel):
    """``torch.library.wrap_triton(kernel)`` for a ``@triton.jit`` kernel, so that a launch inside a
    ``triton_op`` is traced as the kernel itself; anything else (the compile tests' launch
    recorders) is returned as it is."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction) or type(kernel).__name__ == "InterpretedFunction":
        return torch.library.wrap_triton(kernel)
    return kernel


def op_or_body(name: str, body):
    """``torch.ops.kvpress.<name>`` while `torch.compile` traces, else ``body`` (the op's own
    function: the same launches without the op's dispatch, ~25 us of host time a call)."""
    return getattr(torch.ops.kvpress, name) if torch.compiler.is_compiling() else body


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (x - 1).bit_length())


class DecodeDims(NamedTuple):
    batch_size: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    capacity: int
    head_dim: int


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        index: SparseIndex, out: torch.Tensor | None = None,
                        validate_index: bool = True) -> DecodeDims:
    """Validate `sparse_decode` arguments and return their sizes.

    Raises
    ------
    ValueError
        Naming the argument and what is allowed, for wrong ranks, shapes, dtypes, devices,
        a non-contiguous last dimension, query heads not a multiple of the KV heads, or (with
        ``validate_index``) index values out of range for the cache.
    """
    if not isinstance(index, SparseIndex):
        raise ValueError(f"index must be a SparseIndex, got {type(index).__name__}")
    for name, t, ndim, layout in (("q", q, 3, "(B, H_q, D)"), ("k_cache", k_cache, 4, "(B, H_kv, T_cap, D)"),
                                  ("v_cache", v_cache, 4, "(B, H_kv, T_cap, D)")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
        if t.dtype not in ALLOWED_DTYPES:
            raise ValueError(f"{name} dtype must be one of float16, bfloat16, float32; got {t.dtype}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head_dim) dimension, got strides {t.stride()}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device == index.device):
        raise ValueError(f"q, k_cache, v_cache and index must be on one device, got {q.device}, "
                         f"{k_cache.device}, {v_cache.device}, {index.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    B, H_q, D = q.shape
    B_k, H_kv, T_cap, D_k = k_cache.shape
    if B_k != B:
        raise ValueError(f"k_cache batch size {B_k} != q batch size {B}")
    if D_k != D:
        raise ValueError(f"k_cache head_dim {D_k} != q head_dim {D}")
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(f"H_q ({H_q}) must be a multiple G * H_kv of the KV heads ({H_kv})")
    if index.batch_size != B or index.num_kv_heads != H_kv:
        raise ValueError(f"index is for (B, H_kv) = {(index.batch_size, index.num_kv_heads)}, "
                         f"cache has {(B, H_kv)}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype \
                or out.device != q.device:
            raise ValueError(f"out must be a tensor of shape {tuple(q.shape)}, dtype {q.dtype} on {q.device}")
        if out.stride(-1) != 1:
            raise ValueError("out must have a contiguous last dimension")
    if validate_index:
        index.validate(num_kv_heads=H_kv, capacity=T_cap, batch_size=B)
    return DecodeDims(B, H_q, H_kv, H_q // H_kv, T_cap, D)


class RowDims(NamedTuple):
    batch_size: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int


def check_row_sets(q: torch.Tensor, sets) -> RowDims:
    """Validate `attend_rows` arguments; a ValueError names the set and what is allowed."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in ALLOWED_DTYPES:
        raise ValueError(f"q must be a (B, H_q, D) tensor of {ALLOWED_DTYPES}, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    sets = list(sets)
    if not sets:
        raise ValueError("attend_rows needs at least one row set (k, v, cnt, n)")
    B, H_q, D = q.shape
    H = None
    for i, s in enumerate(sets):
        if len(s) != 4:
            raise ValueError(f"row set {i} must be (k, v, cnt, n), got {len(s)} items")
        k, v, cnt, n = s
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
            raise ValueError(f"row set {i}: k and v must both be (B={B}, H_kv, n_cap, D={D}), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.device != q.device or v.device != q.device or k.dtype not in ALLOWED_DTYPES or v.dtype != k.dtype:
            raise ValueError(f"row set {i}: k and v must share q's device ({q.device}) and one dtype of "
                             f"{ALLOWED_DTYPES}, got {k.device}/{k.dtype} and {v.device}/{v.dtype}")
        if H is None:
            H = k.shape[1]
        if k.shape[1] != H:
            raise ValueError(f"row set {i} has {k.shape[1]} KV heads, the first set {H}: every set must have the same")
        if not isinstance(n, int) or not 0 <= n <= k.shape[2]:
            raise ValueError(f"row set {i}: n must be an int in 0..n_cap={k.shape[2]}, got {n!r}")
        if cnt is not None and (not isinstance(cnt, torch.Tensor) or cnt.shape != (B, H) or cnt.is_floating_point()
                                or cnt.device != q.device):
            raise ValueError(f"row set {i}: cnt must be None or an integer (B, H_kv) = {(B, H)} tensor on "
                             f"{q.device}, got {tuple(cnt.shape) if isinstance(cnt, torch.Tensor) else cnt!r}")
    if H == 0 or H_q % H:
        raise ValueError(f"query heads ({H_q}) must be a multiple of the sets' KV heads ({H})")
    return RowDims(B, H_q, H, H_q // H, D)


def check_quant_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size,
                       value_group_size=None, refine=None):
    """Validate a packed `quant_decode` call; returns (B, H_q, H_kv, T, D, value group size resolved)."""
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


# ShadowKV's key rebuild (`kvpress.kernels.shadowkv_rebuild`)
SHADOWKV_CHUNK_SIZES = (8, 16, 32, 64)
TRITON_REBUILD_HEAD_DIMS = (32, 64, 128, 256)
_REBUILD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_rebuild_inputs(factor: torch.Tensor, basis: torch.Tensor, chunk_idx: torch.Tensor,
                         inv_freq: torch.Tensor, rope_start: torch.Tensor, chunk_size: int) -> tuple[int, ...]:
    """Validate `shadowkv_rebuild` arguments; return ``(B, T_pad, R, H_kv, D, K)``.

    Raises
    ------
    ValueError
        Naming the argument and what is allowed (shapes, dtypes, devices, chunk size).
    """
    if isinstance(chunk_size, bool) or chunk_size not in SHADOWKV_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SHADOWKV_CHUNK_SIZES}, got {chunk_size!r}")
    named = (("factor", factor, 3, "(B, T_pad, R)"), ("basis", basis, 4, "(B, R, H_kv, D)"),
             ("chunk_idx", chunk_idx, 3, "(B, H_kv, K)"), ("inv_freq", inv_freq, 1, "(D / 2,)"),
             ("rope_start", rope_start, 1, "(B,)"))
    for name, t, ndim, layout in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
        if t.device != factor.device:
            raise ValueError(f"{name} is on {t.device} but factor is on {factor.device}; use one device")
    if factor.dtype not in _REBUILD_DTYPES or basis.dtype != factor.dtype:
        raise ValueError(f"factor and basis must share one float dtype (fp16/bf16/fp32), got "
                         f"{factor.dtype} and {basis.dtype}")
    if chunk_idx.dtype != torch.int32:
        raise ValueError(f"chunk_idx must be int32, got {chunk_idx.dtype}")
    if inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32, got {inv_freq.dtype}")
    if rope_start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_start must be int32 or int64, got {rope_start.dtype}")
    B, T_pad, R = factor.shape
    _, R_b, H_kv, D = basis.shape
    if basis.shape[0] != B or R_b != R:
        raise ValueError(f"basis must have shape (B, R, H_kv, D) = ({B}, {R}, H_kv, D), got {tuple(basis.shape)}")
    if D % 2 or inv_freq.shape[0] != D // 2:
        raise ValueError(f"inv_freq must have head_dim / 2 = {D // 2} entries (head_dim even), got "
                         f"{inv_freq.shape[0]} for head_dim {D}")
    if chunk_idx.shape[:2] != (B, H_kv):
        raise ValueError(f"chunk_idx must have shape (B, H_kv, K) = ({B}, {H_kv}, K), got {tuple(chunk_idx.shape)}")
    if rope_start.shape[0] != B:
        raise ValueError(f"rope_start must have shape (B,) = ({B},), got {tuple(rope_start.shape)}")
    if T_pad % chunk_size:
        raise ValueError(f"factor's token axis ({T_pad}) must be a multiple of chunk_size={chunk_size}")
    return B, T_pad, R, H_kv, D, chunk_idx.shape[2]
