"""ctypes wrappers of the compiled sparse-attention kernels (``csrc/sparse.c``, ``csrc/shadowkv.c``):
the bodies of the ``kvpress::native_*`` torch ops (`kvpress.kernels.native_ops`). Call them through
`kvpress.kernels.native`, whose docstring describes each kernel; inputs are fp32 CPU tensors.
"""
from __future__ import annotations

import ctypes

import torch

from ._native_lib import _fp32_cpu, _lib, _ptr, _rows_contiguous
from .index import SparseIndex

REDUCTION_CODES = {"max": 0, "mean": 1, "softmax_max": 2, "softmax_mean": 3}


def decode_unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex,
                       tail: tuple | None = None) -> str | None:
    """Why the native `sparse_decode` cannot run these (validated) inputs, or None when it can."""
    from .torch_fast import clean_rows

    if not _fp32_cpu(q, k_cache, v_cache):
        return "it needs fp32 CPU tensors"
    if not (q.is_contiguous() and _rows_contiguous(k_cache) and _rows_contiguous(v_cache)):
        return "it needs a contiguous q and caches whose (T, D) dims are dense"
    if index.block_idx.dtype != torch.int32 or not index.block_idx.is_contiguous():
        return "it needs int32 contiguous block ids"
    if clean_rows(index) is None:
        return "it needs a clean index (no padding slots; every row holds its sinks, tail and blocks)"
    if tail is not None:
        k_sum, v_sum, count = tail
        if not (_fp32_cpu(k_sum, v_sum, count) and _rows_contiguous(k_sum) and v_sum.stride() == k_sum.stride()
                and count.stride(-1) == 1):
            return "it needs fp32 chunk sums with dense (N, D) dims"
    return None

def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex, *,
                  scale: float, tail: tuple | None = None, chunk_size: int = 0,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Native attention over a clean ``index`` (checked by the caller with `decode_unsupported`),
    merged with the tail estimate when ``tail = (k_sum, v_sum, count)`` is given.

    Returns fp32 ``out`` (B, H_q, D) (written into ``out`` when that is an fp32 contiguous tensor)
    and ``lse`` (B, H_q).
    """
    lib = _lib()
    B, H_q, D = q.shape
    H = k_cache.shape[1]
    res = out if out is not None and out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(q)
    lse = torch.empty(B, H_q, dtype=torch.float32)
    starts = None if index.seq_starts is None else index.seq_starts.to(torch.int32).contiguous()
    lens = index.seq_lens.to(torch.int32).contiguous()
    if tail is None:
        k_sum = v_sum = count = None
        s_sb = s_sh = c_sb = n_chunks = 0
    else:
        k_sum, v_sum, count = tail
        s_sb, s_sh, c_sb, n_chunks = k_sum.stride(0), k_sum.stride(1), count.stride(0), k_sum.shape[2]
    rc = lib.kvp_sparse_decode(
        q.data_ptr(), B, H_q, H, D,
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1),
        index.block_idx.data_ptr(), index.max_blocks, index.block_size,
        lens.data_ptr(), _ptr(starts), index.sinks, index.dense_tail,
        _ptr(k_sum), _ptr(v_sum), s_sb, s_sh, _ptr(count), c_sb, n_chunks, int(chunk_size),
        float(scale), res.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_sparse_decode refused its inputs (code {rc})")
    if out is not None and res is not out:
        out.copy_(res)
        res = out
    return res, lse

def label_select(q: torch.Tensor, channels: torch.Tensor, labels: torch.Tensor, k_cache: torch.Tensor | None, *,
                 lo: int, hi: int, keep: int, shortlist: int, scale: float, reduction: str) -> torch.Tensor:
    """Double Sparsity's selection of one unpadded decode step (see the module docstring).

    Parameters
    ----------
    q : (B, H_q, D) fp32 contiguous
    channels : (H_kv, r) int64, the label channels of each KV head
    labels : (B, H_kv, r, T_cap) fp32, token-last, the last dim contiguous
    k_cache : (B, H_kv, T_cap, D) fp32 with dense (T, D) dims; read only when ``shortlist > keep``
    lo, hi : the candidate tokens ``[lo, hi)`` (the same for every row)
    keep, shortlist : ``keep <= shortlist <= hi - lo``
    reduction : one of ``kvpress.kernels.REDUCTIONS``

    Returns
    -------
    int32 (B, H_kv, keep): absolute token ids, ascending per (row, KV head).
    """
    lib = _lib()
    B, H_q, D = q.shape
    H, r = channels.shape
    if not (0 < keep <= shortlist <= hi - lo) or lo < 0 or hi > labels.shape[3]:
        raise ValueError(f"label_select needs 0 < keep <= shortlist <= hi - lo and [lo, hi) inside the labels; got "
                         f"keep={keep}, shortlist={shortlist}, lo={lo}, hi={hi}, labels {tuple(labels.shape)}")
    if reduction not in REDUCTION_CODES:
        raise ValueError(f"reduction must be one of {tuple(REDUCTION_CODES)}, got {reduction!r}")
    if (not _fp32_cpu(q, labels) or not q.is_contiguous() or labels.stride(3) != 1 or channels.dtype != torch.int64
            or not channels.is_contiguous() or labels.shape[:3] != (B, H, r)):
        raise ValueError("label_select needs fp32 CPU q (B, H_q, D) contiguous, labels (B, H_kv, r, T) with a "
                         "contiguous last dim and int64 contiguous channels (H_kv, r)")
    rerank = shortlist > keep
    if rerank and (k_cache is None or not _fp32_cpu(k_cache) or not _rows_contiguous(k_cache)
                   or k_cache.shape[:2] != (B, H) or k_cache.shape[3] != D or hi > k_cache.shape[2]):
        raise ValueError("label_select with shortlist > keep needs the fp32 K cache (B, H_kv, T_cap, D) with dense (T, D) dims")
    ids = torch.empty(B, H, keep, dtype=torch.int32)
    rc = lib.kvp_label_select(
        q.data_ptr(), B, H_q, H, D, channels.data_ptr(), r,
        labels.data_ptr(), labels.stride(0), labels.stride(1), labels.stride(2),
        _ptr(k_cache) if rerank else None, k_cache.stride(0) if rerank else 0, k_cache.stride(1) if rerank else 0,
        lo, hi, shortlist, keep, float(scale), REDUCTION_CODES[reduction], ids.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_label_select refused its inputs (code {rc})")
    return ids


def shadowkv_unsupported(q: torch.Tensor, landmarks: torch.Tensor, factor: torch.Tensor, basis: torch.Tensor) -> str | None:
    """Why `shadowkv_select` cannot run these tensors, or None when it can."""
    if not _fp32_cpu(q, landmarks, factor, basis):
        return "it needs fp32 CPU tensors"
    if q.shape[-1] % 2 or q.shape[-1] > 512 or q.shape[1] // landmarks.shape[1] > 8:
        return "it needs an even head_dim <= 512 and at most 8 query heads per KV head"
    return None


def shadowkv_select(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, factor: torch.Tensor,
                    basis: torch.Tensor, inv_freq: torch.Tensor, rope_start: torch.Tensor, allow: torch.Tensor, *,
                    k: int, shortlist: int, chunk_size: int, scale: float,
                    reduction: str, tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ShadowKV's chunk selection of one decode step (the math of
    ``kvpress.policies._shadowkv_select.select_chunks``, ``tokens`` included).

    Parameters
    ----------
    q : (B, H_q, D) fp32
    landmarks : (B, H_kv, C, D) fp32 chunk mean keys
    selectable : bool (B, H_kv, C), the chunks each KV head may select
    factor, basis : (B, T_pad, R) and (B, R, H_kv, D) fp32, the low-rank pre-RoPE keys
    inv_freq : (D / 2,) fp32; rope_start : (B,) int, each row's RoPE position 0 (padded index)
    allow : (B, H_kv) int, chunks each (row, KV head) may take (<= ``k``)
    k : slots of the result; shortlist : landmark shortlist size (> ``k``: re-scored on rebuilt keys)
    reduction : one of ``kvpress.kernels.REDUCTIONS``
    tokens : choose the shortlist's (always re-scored) best ``allow * chunk_size`` single tokens

    Returns
    -------
    ids int32 (B, H_kv, k): chosen chunks ascending, -1 after (with ``tokens``: (B, H_kv, k * chunk_size)
    token ids ``chunk * chunk_size + offset``); keys fp32 (B, H_kv, k * chunk_size, D): their rebuilt
    post-RoPE keys, zeros in empty slots.
    """
    lib = _lib()
    B, H_q, D = q.shape
    H, C = landmarks.shape[1], landmarks.shape[2]
    T_pad, R = factor.shape[1], factor.shape[2]
    why = shadowkv_unsupported(q, landmarks, factor, basis)
    if why is not None:
        raise ValueError(f"shadowkv_select cannot run these inputs: {why}")
    if reduction not in REDUCTION_CODES:
        raise ValueError(f"reduction must be one of {tuple(REDUCTION_CODES)}, got {reduction!r}")
    if (landmarks.shape != (B, H, C, D) or selectable.shape != (B, H, C) or factor.shape[0] != B
            or basis.shape != (B, R, H, D) or inv_freq.shape != (D // 2,) or rope_start.shape != (B,)
            or allow.shape != (B, H) or C * chunk_size > T_pad or not 0 <= k <= C or max(k, shortlist) > C):
        raise ValueError(f"shadowkv_select got inconsistent shapes: q {tuple(q.shape)}, landmarks "
                         f"{tuple(landmarks.shape)}, selectable {tuple(selectable.shape)}, factor {tuple(factor.shape)}, "
                         f"basis {tuple(basis.shape)}, k={k}, shortlist={shortlist}, chunk_size={chunk_size}")
    sel = selectable.contiguous() if selectable.dtype == torch.bool else (selectable != 0).contiguous()  # 1 byte each
    ids = torch.empty(B, H, k * chunk_size if tokens else k, dtype=torch.int32)
    keys = torch.empty(B, H, k * chunk_size, D, dtype=torch.float32)
    q, landmarks, factor, basis = (t.contiguous() for t in (q, landmarks, factor, basis))
    inv_freq = inv_freq.to(torch.float32).contiguous()
    rope_start = rope_start.to(torch.int64).contiguous()
    allow = allow.to(torch.int32).contiguous()
    rc = lib.kvp_shadowkv_select(
        q.data_ptr(), B, H_q, H, D, landmarks.data_ptr(), C, sel.data_ptr(),
        factor.data_ptr(), T_pad, R, basis.data_ptr(), inv_freq.data_ptr(), rope_start.data_ptr(), chunk_size,
        allow.data_ptr(), k, shortlist, float(scale), REDUCTION_CODES[reduction], int(tokens), ids.data_ptr(),
        keys.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_shadowkv_select refused its inputs (code {rc})")
    return ids, keys


class _Rows(ctypes.Structure):
    """``kvp_rows`` of csrc/sparse.c (field order and types must match)."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("sb", ctypes.c_int64), ("sh", ctypes.c_int64),
                ("cnt", ctypes.c_void_p), ("n", ctypes.c_int64)]


def attend_rows(q: torch.Tensor, sets: list[tuple], *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of ``q`` (B, H_q, D) fp32 over the union of up to 8 row sets, one softmax.

    Each set is ``(k, v, cnt, n)``: fp32 (B, H_kv, n_cap, D) keys and values with dense (n, D) dims
    and the same strides, and the rows in use -- the first ``cnt[b, h]`` (int32 (B, H_kv)) or, with
    ``cnt=None``, the first ``n`` of every (row, KV head); ``n <= n_cap``. Returns fp32 out
    (B, H_q, D) and lse (B, H_q) (zeros / -inf where no row is in use), as `sparse_decode` of each
    set merged with `merge_states`.
    """
    lib = _lib()
    B, H_q, D = q.shape
    if not sets or len(sets) > 8:
        raise ValueError(f"attend_rows takes 1 to 8 row sets, got {len(sets)}")
    rows, keep = (_Rows * len(sets))(), []
    for i, (k, v, cnt, n) in enumerate(sets):
        H = k.shape[1]
        if (not _fp32_cpu(q, k, v) or k.shape != v.shape or k.stride() != v.stride() or not _rows_contiguous(k)
                or k.shape[0] != B or k.shape[3] != D or H_q % H or H_q // H > 8 or not 0 <= n <= k.shape[2]):
            raise ValueError(f"attend_rows set {i}: needs fp32 CPU k / v (B={B}, H_kv, n_cap >= n={n}, D={D}) of one "
                             f"shape and strides with dense (n, D) dims, at most 8 query heads per KV head; got "
                             f"k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)}")
        if cnt is not None:
            cnt = cnt.to(torch.int32).contiguous()
            if cnt.shape != (B, H):
                raise ValueError(f"attend_rows set {i}: cnt must have shape (B, H_kv) = {(B, H)}, got {tuple(cnt.shape)}")
            keep.append(cnt)
        rows[i] = _Rows(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), _ptr(cnt), int(n))
    if len({s[0].shape[1] for s in sets}) != 1:
        raise ValueError("attend_rows: every set must have the same number of KV heads")
    q = q.contiguous()
    out = torch.empty(B, H_q, D, dtype=torch.float32)
    lse = torch.empty(B, H_q, dtype=torch.float32)
    rc = lib.kvp_attend_rows(q.data_ptr(), B, H_q, sets[0][0].shape[1], D, ctypes.addressof(rows), len(sets),
                             float(scale), out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_attend_rows refused its inputs (code {rc})")
    return out, lse


def add_residual(keys: torch.Tensor, table: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp32 ``keys`` (..., n, D) plus the residual whose `residual_table` rows ``table`` (..., n, W)
    uint8 carries (codes, then fp16 scales and zero points per ``group_size`` channels): a new
    fp32 tensor; the torch reference is ``kvpress.policies._shadowkv_store.add_residual``."""
    lib = _lib()
    D, W = keys.shape[-1], table.shape[-1]
    if (not _fp32_cpu(keys) or table.dtype != torch.uint8 or table.device.type != "cpu"
            or keys.shape[:-1] != table.shape[:-1]):
        raise ValueError(f"add_residual needs fp32 CPU keys (..., n, D) and uint8 CPU rows (..., n, W) of the same "
                         f"leading shape; got keys {tuple(keys.shape)} {keys.dtype}, table {tuple(table.shape)} "
                         f"{table.dtype}")
    keys, table = keys.contiguous(), table.contiguous()
    out = torch.empty_like(keys)
    rc = lib.kvp_add_residual(keys.data_ptr(), table.data_ptr(), keys.numel() // max(D, 1), D, W, int(bits),
                              int(group_size), out.data_ptr())
    if rc != 0:
        raise ValueError(f"add_residual: bits={bits}, group_size={group_size}, head_dim={D} and row width {W} do not "
                         f"fit (bits 2 / 4 / 8, group_size dividing head_dim into at most 64 groups, "
                         f"W = D * bits / 8 + 4 * D / group_size; code {rc})")
    return out


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kvpress.kernels.merge_states` of fp32 CPU states (``out`` (..., D), ``lse`` (...); ``-inf``
    marks an empty part) in one call; `kvpress.kernels.merge.torch_merge_states` is the reference.
    Returns new fp32 ``out`` and ``lse``."""
    lib = _lib()
    if (not _fp32_cpu(out_a, lse_a, out_b, lse_b) or out_a.shape != out_b.shape or lse_a.shape != lse_b.shape
            or out_a.dim() == 0 or out_a.shape[:-1] != lse_a.shape):
        raise ValueError(f"merge_states needs fp32 CPU out (..., D) and lse (...) of matching shapes, got out "
                         f"{tuple(out_a.shape)} {out_a.dtype} / {tuple(out_b.shape)} {out_b.dtype}, lse "
                         f"{tuple(lse_a.shape)} {lse_a.dtype} / {tuple(lse_b.shape)} {lse_b.dtype}")
    oa, ob, la, lb = (t.contiguous() for t in (out_a, out_b, lse_a, lse_b))
    out, lse = torch.empty_like(oa), torch.empty_like(la)
    D = oa.shape[-1]
    rc = lib.kvp_merge_states(oa.data_ptr(), la.data_ptr(), ob.data_ptr(), lb.data_ptr(), la.numel(), D,
                              out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise ValueError(f"kvp_merge_states refused out {tuple(oa.shape)} (code {rc})")
    return out, lse


def shadowkv_tail(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, v_sum: torch.Tensor,
                  ids: torch.Tensor | None, values: torch.Tensor | None, *, chunk_size: int, tail_chunk: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`kvpress.policies._shadowkv_select.tail_estimate` with ``tokens=True`` (the reference) in one
    call: fp32 CPU ``q`` (B, H_q, D), ``landmarks`` (B, H_kv, C, D), bool ``selectable``
    (B, H_kv, C), ``v_sum`` (B, H_kv, N, D), the attended token ``ids`` (B, H_kv, K) (-1 empty)
    and their ``values`` (B, H_kv, K, D), or None for both. Returns fp32 out (B, H_q, D), lse (B, H_q)."""
    lib = _lib()
    B, H_q, D = q.shape
    H, C = landmarks.shape[1], landmarks.shape[2]
    N, m = v_sum.shape[2], tail_chunk // chunk_size
    off = N * m - C
    K = 0 if ids is None else ids.shape[2]
    if (not _fp32_cpu(q, landmarks, v_sum) or (K and not _fp32_cpu(values)) or selectable.dtype != torch.bool
            or tuple(selectable.shape) != (B, H, C) or tuple(v_sum.shape) != (B, H, N, D)
            or landmarks.shape[0] != B or landmarks.shape[3] != D
            or (K and (tuple(values.shape) != (B, H, K, D) or tuple(ids.shape) != (B, H, K)))):
        raise ValueError(f"shadowkv_tail needs fp32 CPU q {tuple(q.shape)}, landmarks (B, H_kv, C, D), bool "
                         f"selectable (B, H_kv, C), v_sum (B, H_kv, N, D), ids (B, H_kv, K) and values "
                         f"(B, H_kv, K, D); got landmarks {tuple(landmarks.shape)}, selectable "
                         f"{tuple(selectable.shape)}, v_sum {tuple(v_sum.shape)}")
    q, landmarks, v_sum = q.contiguous(), landmarks.contiguous(), v_sum.contiguous()
    sel = selectable.contiguous()
    ids = ids.to(torch.int32).contiguous() if K else None
    values = values.contiguous() if K else None
    out = torch.empty(B, H_q, D, dtype=torch.float32)
    lse = torch.empty(B, H_q, dtype=torch.float32)
    rc = lib.kvp_shadowkv_tail(q.data_ptr(), B, H_q, H, D, landmarks.data_ptr(), C, sel.data_ptr(),
                               v_sum.data_ptr(), N, _ptr(ids), _ptr(values), K, int(chunk_size), m, off,
                               float(scale), out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise ValueError(f"kvp_shadowkv_tail refused its inputs (code {rc}): H_q={H_q} must be a multiple of "
                         f"H_kv={H} by at most 8, tail_chunk={tail_chunk} a multiple of chunk_size={chunk_size} "
                         f"with N={N} groups covering C={C} chunks")
    return out, lse
