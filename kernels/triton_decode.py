"""Launcher for the Triton `sparse_decode` kernels: validate, allocate, pick splits, launch.

The launch is the torch op ``kvpress::triton_sparse_decode`` (`torch.library.triton_op`, each
kernel launched through `torch.library.wrap_triton`), so `torch.compile` traces the kernels
themselves, never this launcher's Python. Triton is imported lazily inside the op, so ``import
kvpress.kernels`` works without it. CPU tensors run only under ``TRITON_INTERPRET=1`` (the tests);
there every input is upcast to fp32 first, because the interpreter silently mishandles bf16.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.library import triton_op

from .checks import (MAX_GROUP, TRITON_HEAD_DIMS, check_decode_inputs, interpreting,  # noqa: F401
                     next_pow2 as _next_pow2, op_or_body, require_cuda_or_interpreter, wrap_kernel)
from .index import SparseIndex

BLOCK_N = 64  # tokens per tile: one 64-token block, or several smaller blocks gathered together
MAX_SPLITS = 64


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: the launchers ask on every call)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def choose_num_splits(batch_size: int, num_kv_heads: int, max_virtual: int, device: torch.device) -> int:
    """Split count so that about two programs run per SM, each on at least one tile."""
    tiles = max(1, -(-max_virtual // BLOCK_N))
    if device.type == "cuda":
        target = 2 * _sm_count(device)
    else:  # interpreter: exercise the split-K path, but keep the program count small
        target = 2 * batch_size * num_kv_heads
    return max(1, min(tiles, MAX_SPLITS, -(-target // max(1, batch_size * num_kv_heads))))


def triton_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         index: SparseIndex, *, scale: float | None = None,
                         out: torch.Tensor | None = None, validate_index: bool = True,
                         num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `kvpress.kernels.sparse_decode` (same arguments and results).

    ``num_splits`` overrides the split-K count (tests use it to cover the merge).
    """
    B, H_q, H_kv, G, T_cap, D = check_decode_inputs(q, k_cache, v_cache, index, out, validate_index)
    if D not in TRITON_HEAD_DIMS:
        raise ValueError(f"triton backend supports head_dim in {TRITON_HEAD_DIMS}, got {D}; "
                         "use backend='torch' (or 'auto', which falls back to it)")
    if G > MAX_GROUP:
        raise ValueError(f"triton backend supports GQA groups of 1..{MAX_GROUP} query heads per KV head, got {G}; "
                         "use backend='torch' (or 'auto', which falls back to it)")
    require_cuda_or_interpreter(q, "the triton sparse_decode backend")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    res, lse = op_or_body("triton_sparse_decode", _sparse_decode_op)(
        q, k_cache, v_cache, index.block_idx, index.block_cnt, index.seq_lens, index.seq_starts, index.block_size,
        index.sinks, index.dense_tail, index.max_blocks, scale, num_splits or 0)
    if out is not None:
        out.copy_(res)
        res = out
    return res, lse


def _sparse_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_idx: torch.Tensor,
                      block_cnt: torch.Tensor, seq_lens: torch.Tensor, seq_starts: Optional[torch.Tensor],
                      block_size: int, sinks: int, dense_tail: int, max_blocks: int, scale: float,
                      num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches of `triton_sparse_decode` (inputs validated): ``(out in q's dtype, fp32 lse)``."""
    from .triton_decode_kernel import _merge_splits_kernel, _sparse_decode_split_kernel

    B, H_q, D = q.shape
    H_kv = k_cache.shape[1]
    G = H_q // H_kv
    out = torch.empty_like(q)
    qc, kc, vc = q, k_cache, v_cache
    if interpreting() and q.dtype != torch.float32:
        qc, kc, vc = q.float(), k_cache.float(), v_cache.float()
    out_buf = out if out.dtype == qc.dtype else torch.empty_like(qc)

    max_virtual = sinks + dense_tail + max_blocks * block_size
    splits = num_splits or choose_num_splits(B, H_kv, max_virtual, q.device)
    tiles = max(1, -(-max_virtual // BLOCK_N))
    tiles_per_split = -(-tiles // splits)
    splits = -(-tiles // tiles_per_split)  # drop splits that would own no tile
    out_part = torch.empty(B, H_q, splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, H_q, splits, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H_q, device=q.device, dtype=torch.float32)
    # an empty block table can have a null data pointer; block_cnt == 0 means it is never read
    if not max_blocks:
        block_idx = torch.full((B, H_kv, 1), -1, dtype=torch.int32, device=q.device)
    starts = seq_starts if seq_starts is not None else seq_lens
    if B * H_q == 0:
        return out, lse

    wrap_kernel(_sparse_decode_split_kernel)[(B, H_kv, splits)](
        qc, kc, vc, block_idx, block_cnt, seq_lens, starts, out_part, lse_part,
        qc.stride(0), qc.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        block_idx.stride(0), block_idx.stride(1),
        block_cnt.stride(0), block_cnt.stride(1),
        out_part.stride(0), out_part.stride(1), out_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        scale * 1.4426950408889634, sinks, dense_tail, tiles_per_split * BLOCK_N,
        GROUP=G, BLOCK_G=max(16, _next_pow2(G)), BLOCK_N=BLOCK_N, HEAD_DIM=D,
        BLOCK_SIZE=block_size, HAS_STARTS=seq_starts is not None,
        DOT_PRECISION="ieee" if qc.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    wrap_kernel(_merge_splits_kernel)[(B, H_q)](
        out_part, lse_part, out_buf, lse,
        out_part.stride(0), out_part.stride(1), out_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out_buf.stride(0), out_buf.stride(1),
        lse.stride(0), lse.stride(1),
        splits,
        BLOCK_S=_next_pow2(splits), HEAD_DIM=D,
        num_warps=4,
    )
    if out_buf is not out:
        out.copy_(out_buf)
    return out, lse


triton_op("kvpress::triton_sparse_decode", _sparse_decode_op, mutates_args=())
