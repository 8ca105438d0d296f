"""Input validation shared by every `sparse_decode` backend (clear ValueErrors, never asserts)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .index import SparseIndex

ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# largest GQA group (query heads per KV head) the Triton kernels take: a KV head's group is one tile of
# max(16, next_pow2(G)) query rows, so 9..16 cost the same rows as 1..8 (Llama-3.1-405B and Qwen3-235B have 16).
# The compiled CPU kernels (`native`) take up to 8; larger groups run the torch path there. torch: any.
MAX_GROUP = 16


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
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
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
