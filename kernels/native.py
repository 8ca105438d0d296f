"""Compiled CPU decode kernels (``backend="native"``): one C call per layer and decode step.

On a CPU, a query-aware decode step at a small budget is dominated by the fixed cost of ~100
torch operators per layer (scores, top-k, gathers, softmax, the tail estimate), not by the
bytes it reads. ``csrc/cpu_decode.c`` does a whole step per (row, KV head) in one call:

- `sparse_decode` -- attention over a *clean* `SparseIndex` (no padding slots, every row long
  enough; `kvpress.kernels.torch_fast.clean_rows`), optionally merged with the chunk-mean
  estimate of the tokens left out (`kvpress.kernels.sparse_decode_tail`'s math);
- `label_select` -- Double Sparsity's selection: label scores over a token range, the top
  ``shortlist`` by label score, re-scored on exact keys when the shortlist is longer than
  ``keep``, the top ``keep`` returned as ascending token ids;
- `channel_scores` / `token_values` -- the two reads of a packed low-bit store
  (`kvpress.kernels.quant`'s format: per-channel keys, per-token values, fp16 scales and zero
  points) for a few query rows: each packed row is unpacked in registers once for the whole GQA
  group and never written out (``kivi``, ``zipcache`` and ``gear`` decode through them);
- `quant_attend` -- a whole decode step of a quantized policy: packed segments (`PackedSegment`:
  ``kivi``'s store, ``zipcache``'s two, ``gear``'s with its corrections, `GearParts`), exact rows
  (``kivi``'s sinks) and the full-precision window under one softmax;
- `gear_key_extra` / `gear_value_extra` -- ``gear``'s low-rank error (per-chunk right factors,
  token-aligned left factors), exact outliers and sink corrections, added to scores / outputs.

fp32 only (queries, probabilities, outputs; the codes are uint8, the scales fp16). The torch
implementations are the references (`kvpress.kernels.torch_decode`, `kvpress.kernels.tail`,
`kvpress.kernels.scores`, `kvpress.kernels.quant`, ``gear``'s torch path);
``tests/kernels/test_native.py`` and ``tests/kernels/test_native_quant.py`` compare them. The
library is built on first use with the system C compiler (``$CC``, else ``cc`` / ``gcc``;
``-O3 -march=native -fopenmp``, ~1 s) into ``<kvpress cache>/native/<key>/`` (key: source,
compiler, flags and CPU), atomically, so parallel processes are safe. No compiler, a failed
build, or ``KVPRESS_NATIVE=0`` -> `available()` is False and ``backend="auto"`` uses torch;
``backend="native"`` then raises with the reason.

Threads: built with ``-fopenmp``, the library shares the OpenMP runtime torch has loaded (same
``libgomp.so.1``), so its kernels run on torch's worker threads and follow
``torch.set_num_threads`` (`threads()`); work is split into pieces fixed by the shapes (spans of
512 packed tokens, (row, KV head) pairs) and combined in a fixed order, so results do not depend
on the thread count. A second OpenMP runtime in the process, or a compiler without OpenMP, leaves
one thread.

Files: ``_native_lib.py`` builds and loads the library (and holds the input helpers);
``native_quant.py`` holds the packed-store readers, re-exported here; this module the sparse ones.
"""
from __future__ import annotations

import torch

from ._native_lib import (ABI_VERSION, BUILDS, FLAGS, SOURCE, _fp32_cpu, _lib, _ptr, _rows_contiguous,  # noqa: F401
                          available, openmp_runtimes, threads)
from .index import SparseIndex
from .native_quant import (MAX_SEGMENTS, QUANT_MAX_ROWS, GearParts, PackedSegment, channel_scores,  # noqa: F401
                           gear_key_extra, gear_value_extra, quant_attend, quant_unsupported, token_values)

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
