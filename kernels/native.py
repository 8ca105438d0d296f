"""Compiled CPU decode kernels (``backend="native"``): one C call per layer and decode step.

On a CPU, a query-aware decode step at a small budget is dominated by the fixed cost of ~100
torch operators per layer (scores, top-k, gathers, softmax, the tail estimate), not by the
bytes it reads. The C kernels of ``csrc/`` do a whole step per (row, KV head) in one call:

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
- `shadowkv_select` -- ``shadowkv``'s chunk selection: landmark scores, the shortlist, its keys
  rebuilt from the low-rank factors with RoPE and re-scored exactly, the chosen chunks' ids and
  rebuilt keys (`kvpress.kernels.shadowkv_rebuild`'s math);
- `shadowkv_tail` -- ``shadowkv:tail_chunk``'s estimate of the tokens a ``select="tokens"`` step
  leaves out, from the chunk landmarks and group value sums (`tail_estimate`'s math with ``tokens``);
- `add_residual` -- ``shadowkv:residual_bits``' correction of rebuilt keys: each key plus its
  dequantized residual row (`kvpress.policies._shadowkv_store.add_residual`'s math), one pass;
- `attend_rows` -- exact attention over a few row sets (a prefix of rows per (row, KV head) each)
  under one softmax: ``sparse_decode`` of each set merged by ``merge_states``, in one call;
- `merge_states` -- two attention states over disjoint token sets merged into one
  (`kvpress.kernels.merge.torch_merge_states`' math), for ``shadowkv``'s tail estimate in its
  compiled step (one call instead of ~25 small torch operators);
- `gear_key_extra` / `gear_value_extra` -- ``gear``'s low-rank error (per-chunk right factors,
  token-aligned left factors), exact outliers and sink corrections, added to scores / outputs.

fp32 only (queries, probabilities, outputs; the codes are uint8, the scales fp16). The torch
implementations are the references (`kvpress.kernels.torch_decode`, `kvpress.kernels.tail`,
`kvpress.kernels.scores`, `kvpress.kernels.quant`, ``gear``'s and ``shadowkv``'s torch paths);
``tests/kernels/test_native.py`` and ``tests/kernels/test_native_quant.py`` compare them. The
library is built on first use with the system C compiler (``$CC``, else ``cc`` / ``gcc``;
``-O3 -march=native -fopenmp``, every ``csrc/*.c`` in one invocation) into
``<kvpress cache>/native/<key>/`` (key: the C sources and header, compiler, flags and CPU),
atomically, so parallel processes are safe. No compiler, a failed build, or ``KVPRESS_NATIVE=0``
-> `available()` is False and ``backend="auto"`` uses torch; ``backend="native"`` then raises
with the reason.

Threads: built with ``-fopenmp``, the library shares the OpenMP runtime torch has loaded (same
``libgomp.so.1``), so its kernels run on torch's worker threads and follow
``torch.set_num_threads`` (`threads()`); work is split into pieces fixed by the shapes (spans of
512 packed tokens, (row, KV head) pairs) and combined in a fixed order, so results do not depend
on the thread count. A second OpenMP runtime in the process, or a compiler without OpenMP, leaves
one thread.

Each kernel is a torch op, ``kvpress::native_<name>`` (`kvpress.kernels.native_ops`: the ctypes
call as its body, a fake implementation for its output shapes), so a `torch.compile` trace holds
one opaque node per call and never enters ctypes; the functions here keep their signatures and
call the ops while tracing, their bodies directly in eager (`_call`).

Files: ``_native_lib.py`` builds and loads the library (and holds the input helpers);
``native_sparse.py`` and ``native_quant.py`` wrap the C functions; ``native_ops.py`` registers them
as ops; this module is the public face.
"""
from __future__ import annotations

import torch

# importing native_ops registers the kvpress::native_* ops; its functions are their bodies
from .native_ops import (flatten_gear, flatten_segments, native_add_residual, native_attend_rows,
                         native_channel_scores, native_gear_key_extra, native_gear_value_extra, native_label_select,
                         native_merge_states, native_quant_attend, native_shadowkv_select, native_shadowkv_tail,
                         native_token_values, sparse_decode_index)
from ._native_lib import (ABI_VERSION, BUILDS, FLAGS, SOURCES, _fp32_cpu, _lib, _ptr, _rows_contiguous,  # noqa: F401
                          available, openmp_runtimes, threads)
from .index import SparseIndex
from .native_quant import (MAX_SEGMENTS, as_segments, QUANT_MAX_ROWS, QUANT_NATIVE_READ_ROWS, GearParts,  # noqa: F401
                           PackedSegment, quant_unsupported)
from .native_sparse import REDUCTION_CODES, decode_unsupported, shadowkv_unsupported  # noqa: F401

_OPS = torch.ops.kvpress


def _call(body, *args):
    """``kvpress::<body's name>(*args)`` while `torch.compile` traces, else ``body(*args)``: the same
    function without the op's dispatch (~25 us a call, more than some kernels take)."""
    if torch.compiler.is_compiling():
        return getattr(_OPS, body.__name__)(*args)
    return body(*args)


def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: SparseIndex, *,
                  scale: float, tail: tuple | None = None, chunk_size: int = 0,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Native attention over ``index`` (fp32 CPU), merged with the tail estimate when ``tail =
    (k_sum, v_sum, count)`` is given (`kvpress.kernels.sparse_decode_tail`'s math). An index that
    is not clean (`kvpress.kernels.torch_fast.clean_rows`) runs the torch path inside the op.

    Returns fp32 ``out`` (B, H_q, D) (copied into ``out`` when given) and ``lse`` (B, H_q).
    """
    k_sum, v_sum, count = (None, None, None) if tail is None else tail
    if not torch.compiler.is_compiling():
        res, lse = sparse_decode_index(q, k_cache, v_cache, index, k_sum, v_sum, count, int(chunk_size), float(scale))
        if out is not None:
            out.copy_(res)
            res = out
        return res, lse
    res, lse = _OPS.native_sparse_decode(q, k_cache, v_cache, index.block_idx, index.block_cnt, index.seq_lens,
                                         index.seq_starts, index.block_size, index.sinks, index.dense_tail,
                                         None if index.id_range is None else list(index.id_range),
                                         k_sum, v_sum, count, int(chunk_size), float(scale))
    if out is not None:
        out.copy_(res)
        res = out
    return res, lse


def label_select(q: torch.Tensor, channels: torch.Tensor, labels: torch.Tensor, k_cache: torch.Tensor | None, *,
                 lo: int, hi: int, keep: int, shortlist: int, scale: float, reduction: str) -> torch.Tensor:
    """Double Sparsity's selection of one unpadded decode step: int32 (B, H_kv, keep) ascending
    token ids (`kvpress.kernels.native_sparse.label_select` documents the arguments)."""
    return _call(native_label_select, q, channels, labels, k_cache, lo, hi, keep, shortlist, float(scale), reduction)


def shadowkv_select(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, factor: torch.Tensor,
                    basis: torch.Tensor, inv_freq: torch.Tensor, rope_start: torch.Tensor, allow: torch.Tensor, *,
                    k: int, shortlist: int, chunk_size: int, scale: float,
                    reduction: str, tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ShadowKV's chunk selection of one decode step: int32 ids and fp32 rebuilt keys
    (`kvpress.kernels.native_sparse.shadowkv_select` documents the arguments)."""
    return _call(native_shadowkv_select, q, landmarks, selectable, factor, basis, inv_freq, rope_start, allow, k,
                                       shortlist, chunk_size, float(scale), reduction, bool(tokens))


def attend_rows(q: torch.Tensor, sets: list[tuple], *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of ``q`` (B, H_q, D) fp32 over the union of up to 8 row sets ``(k, v, cnt, n)``,
    one softmax (`kvpress.kernels.native_sparse.attend_rows` documents the arguments)."""
    sets = list(sets)
    return _call(native_attend_rows, q, [s[0] for s in sets], [s[1] for s in sets], [s[2] for s in sets],
                                   [int(s[3]) for s in sets], float(scale))


def add_residual(keys: torch.Tensor, table: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp32 ``keys`` (..., n, D) plus the residual rows ``table`` (..., n, W) uint8 carry: a new
    fp32 tensor (`kvpress.kernels.native_sparse.add_residual` documents the format)."""
    return _call(native_add_residual, keys, table, int(bits), int(group_size))


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kvpress.kernels.merge_states` of fp32 CPU states in one call: new fp32 ``out`` and ``lse``."""
    return _call(native_merge_states, out_a, lse_a, out_b, lse_b)


def shadowkv_tail(q: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, v_sum: torch.Tensor,
                  ids: torch.Tensor | None, values: torch.Tensor | None, *, chunk_size: int, tail_chunk: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``shadowkv:tail_chunk``'s estimate in one call: fp32 out (B, H_q, D), lse (B, H_q)
    (`kvpress.kernels.native_sparse.shadowkv_tail` documents the arguments)."""
    return _call(native_shadowkv_tail, q, landmarks, selectable, v_sum, ids, values, int(chunk_size), int(tail_chunk),
                                     float(scale))


def channel_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   group_size: int) -> torch.Tensor:
    """``q @ dequant(k)^T`` for per-channel-quantized keys: fp32 (B, H, M, T), unscaled
    (`kvpress.kernels.native_quant.channel_scores` documents the arguments)."""
    return _call(native_channel_scores, q, codes, scale, zero, int(bits), int(group_size))


def token_values(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                 group_size: int) -> torch.Tensor:
    """``p @ dequant(v)`` for per-token-quantized values: fp32 (B, H, M, D)
    (`kvpress.kernels.native_quant.token_values` documents the arguments)."""
    return _call(native_token_values, p, codes, scale, zero, int(bits), int(group_size))


def quant_attend(q: torch.Tensor, k_codes=None, k_scale=None, k_zero=None, v_codes=None, v_scale=None, v_zero=None, *,
                 bits: int = 0, group_size: int = 0, value_group_size: int = 0, k_win: torch.Tensor,
                 v_win: torch.Tensor, starts: torch.Tensor | None = None, win_starts: torch.Tensor | None = None,
                 segments: list[PackedSegment] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step over packed stores and a full-precision window, under one softmax: fp32 ``out``
    (B, H, M, D) and ``lse`` (B, H, M) (`kvpress.kernels.native_quant.quant_attend` documents the
    arguments: one packed store, or up to `MAX_SEGMENTS` `PackedSegment` s, not both)."""
    segments = as_segments(segments, (k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero), bits, group_size,
                           value_group_size, starts)
    tensors, ints = flatten_segments(segments)
    return _call(native_quant_attend, q, k_win, v_win, win_starts, tensors, ints)


def gear_key_extra(s: torch.Tensor, q: torch.Tensor, group_size: int, parts: GearParts) -> torch.Tensor:
    """Adds GEAR's key corrections to the scores ``s`` (fp32 (B, H, M, N) contiguous) in place and
    returns ``s`` (`kvpress.kernels.native_quant.gear_key_extra` documents the arguments)."""
    _call(native_gear_key_extra, s, q, int(group_size), flatten_gear(parts))
    return s


def gear_value_extra(out: torch.Tensor, p: torch.Tensor, group_size: int, parts: GearParts) -> torch.Tensor:
    """Adds GEAR's value corrections to ``out`` (fp32 (B, H, M, D) contiguous) in place and returns
    it (`kvpress.kernels.native_quant.gear_value_extra` documents the arguments)."""
    _call(native_gear_value_extra, out, p, int(group_size), flatten_gear(parts))
    return out
