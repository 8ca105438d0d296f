"""The compiled CPU kernels registered as torch ops (``kvpress::native_*``).

Each op's body is the ctypes call (`native_sparse`, `native_quant`); each has a fake
implementation giving its outputs' shapes and dtypes, so `torch.compile` traces a call as one
opaque node and never enters ctypes. The ops copy inputs whose strides the C code does not take
(the compiler may hand them other layouts than eager would). Call them through the public
functions of `kvpress.kernels.native`, which keep their Python signatures (dataclasses, tuples)
and flatten them into the ops' tensors and ints; in eager they call the bodies directly (the
functions below: the op's dispatch costs ~25 us per call, more than some kernels take).
"""
import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ._native_lib import _rows_contiguous
from .index import SparseIndex
from .native_quant import (GearParts, PackedSegment, channel_scores, gear_key_extra, gear_value_extra, quant_attend,
                           token_values)
from .native_sparse import (add_residual, attend_rows, label_select, merge_states, shadowkv_select, shadowkv_tail,
                            sparse_decode)

# ----------------------------------------------------------------------------- flattening
GEAR_FIELDS = ("bounds", "k_low", "v_low", "k_out", "v_out", "sinks", "sink_start")
GEAR_SLOTS = 12  # bounds, k_low x2, v_low x2, k_out x2, v_out x2, sinks x2, sink_start
SEGMENT_SLOTS = 11 + GEAR_SLOTS  # kc ks kz vc vs vz starts value_scale rc rs ridx, then the GEAR slots
SEGMENT_INTS = 4  # bits, group_size, value_group_size, has GEAR parts


def flatten_gear(parts) -> list:
    """`GearParts` (or None) as `GEAR_SLOTS` optional tensors."""
    if parts is None:
        return [None] * GEAR_SLOTS
    out = [parts.bounds]
    for pair in (parts.k_low, parts.v_low, parts.k_out, parts.v_out, parts.sinks):
        out += [None, None] if pair is None else list(pair)
    return out + [parts.sink_start]


def unflatten_gear(t: list):
    pairs = [None if t[i] is None else (t[i], t[i + 1]) for i in (1, 3, 5, 7, 9)]
    return GearParts(t[0], *pairs, sink_start=t[11])


def flatten_segments(segments) -> tuple[list, list]:
    """`PackedSegment` s as `SEGMENT_SLOTS` optional tensors and `SEGMENT_INTS` ints each."""
    tensors, ints = [], []
    for seg in segments:
        refine = [None, None, None] if seg.refine is None else list(seg.refine)
        tensors += [*seg.k, *seg.v, seg.starts, seg.value_scale, *refine, *flatten_gear(seg.gear)]
        ints += [int(seg.bits), int(seg.group_size), int(seg.value_group_size), int(seg.gear is not None)]
    return tensors, ints


def unflatten_segments(tensors: list, ints: list) -> list:
    segs = []
    for i in range(len(ints) // SEGMENT_INTS):
        t = tensors[i * SEGMENT_SLOTS:(i + 1) * SEGMENT_SLOTS]
        bits, g, gv, has_gear = ints[i * SEGMENT_INTS:(i + 1) * SEGMENT_INTS]
        segs.append(PackedSegment(tuple(t[0:3]), tuple(t[3:6]), bits, g, gv, starts=t[6], value_scale=t[7],
                                     refine=None if t[10] is None else tuple(t[8:11]),
                                     gear=unflatten_gear(t[11:]) if has_gear else None))
    return segs


def _register(body, mutates=()):
    """``body`` as the op ``kvpress::<its name>``."""
    return torch.library.custom_op(f"kvpress::{body.__name__}", body, mutates_args=mutates)


def _dense(t: Tensor) -> Tensor:
    return t if _rows_contiguous(t) else t.contiguous()


def _rows_out(q: Tensor) -> tuple[Tensor, Tensor]:
    B, H_q, D = q.shape
    return q.new_empty(B, H_q, D, dtype=torch.float32), q.new_empty(B, H_q, dtype=torch.float32)


# ----------------------------------------------------------------------------- sparse decode
def native_sparse_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_idx: Tensor, block_cnt: Tensor,
                         seq_lens: Tensor, seq_starts: Optional[Tensor], block_size: int, sinks: int, dense_tail: int,
                         id_range: Optional[list[int]], k_sum: Optional[Tensor], v_sum: Optional[Tensor],
                         count: Optional[Tensor], chunk_size: int, scale: float) -> tuple[Tensor, Tensor]:
    """`native_sparse.sparse_decode` of the index these tensors describe (`sparse_decode_index`)."""
    index = SparseIndex(block_size, block_idx, block_cnt, seq_lens, seq_starts, sinks, dense_tail,
                        None if id_range is None else (int(id_range[0]), int(id_range[1])))
    return sparse_decode_index(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size, scale)


def sparse_decode_index(q: Tensor, k_cache: Tensor, v_cache: Tensor, index: SparseIndex, k_sum: Optional[Tensor],
                        v_sum: Optional[Tensor], count: Optional[Tensor], chunk_size: int,
                        scale: float) -> tuple[Tensor, Tensor]:
    """`native_sparse.sparse_decode` (merged with the tail estimate when ``k_sum`` is given); an index
    the kernel does not take (not clean) runs the torch path. New fp32 ``out`` and ``lse``."""
    from .torch_fast import clean_rows

    if clean_rows(index) is None:
        if k_sum is None:
            from .torch_decode import torch_sparse_decode

            return torch_sparse_decode(q, k_cache, v_cache, index, scale=scale, validate_index=False)
        from .torch_tail import _estimate

        return _estimate(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size, scale, None, with_exact=True)
    if not index.block_idx.is_contiguous():
        index = dataclasses.replace(index, block_idx=index.block_idx.contiguous())
    tail = None
    if k_sum is not None:
        k_sum = _dense(k_sum)
        v_sum = v_sum if v_sum.stride() == k_sum.stride() else v_sum.contiguous()
        tail = (k_sum, v_sum, count if count.stride(-1) == 1 else count.contiguous())
    return sparse_decode(q.contiguous(), _dense(k_cache), _dense(v_cache), index, scale=scale, tail=tail,
                         chunk_size=chunk_size)


native_sparse_decode_op = _register(native_sparse_decode)


@native_sparse_decode_op.register_fake
def _(q, k_cache, v_cache, block_idx, block_cnt, seq_lens, seq_starts, block_size, sinks, dense_tail, id_range,
      k_sum, v_sum, count, chunk_size, scale):
    return _rows_out(q)


def native_label_select(q: Tensor, channels: Tensor, labels: Tensor, k_cache: Optional[Tensor], lo: int, hi: int,
                        keep: int, shortlist: int, scale: float, reduction: str) -> Tensor:
    """`native_sparse.label_select`: int32 (B, H_kv, keep) token ids."""
    if labels.stride(3) != 1:
        labels = labels.contiguous()
    return label_select(q.contiguous(), channels.contiguous(), labels, None if k_cache is None else _dense(k_cache),
                           lo=lo, hi=hi, keep=keep, shortlist=shortlist, scale=scale, reduction=reduction)


native_label_select_op = _register(native_label_select)


@native_label_select_op.register_fake
def _(q, channels, labels, k_cache, lo, hi, keep, shortlist, scale, reduction):
    return q.new_empty(q.shape[0], channels.shape[0], keep, dtype=torch.int32)


def native_shadowkv_select(q: Tensor, landmarks: Tensor, selectable: Tensor, factor: Tensor, basis: Tensor,
                           inv_freq: Tensor, rope_start: Tensor, allow: Tensor, k: int, shortlist: int,
                           chunk_size: int, scale: float, reduction: str, tokens: bool) -> tuple[Tensor, Tensor]:
    """`native_sparse.shadowkv_select`: int32 ids and fp32 rebuilt keys."""
    return shadowkv_select(q, landmarks, selectable, factor, basis, inv_freq, rope_start, allow, k=k,
                              shortlist=shortlist, chunk_size=chunk_size, scale=scale, reduction=reduction,
                              tokens=tokens)


native_shadowkv_select_op = _register(native_shadowkv_select)


@native_shadowkv_select_op.register_fake
def _(q, landmarks, selectable, factor, basis, inv_freq, rope_start, allow, k, shortlist, chunk_size, scale,
      reduction, tokens):
    B, H, D = q.shape[0], landmarks.shape[1], q.shape[2]
    ids = q.new_empty(B, H, k * chunk_size if tokens else k, dtype=torch.int32)
    return ids, q.new_empty(B, H, k * chunk_size, D, dtype=torch.float32)


def native_attend_rows(q: Tensor, ks: list[Tensor], vs: list[Tensor], cnts: list[Optional[Tensor]], ns_: list[int],
                       scale: float) -> tuple[Tensor, Tensor]:
    """`native_sparse.attend_rows` over the sets ``zip(ks, vs, cnts, ns_)``."""
    sets = []
    for k, v, c, n in zip(ks, vs, cnts, ns_):
        if not (_rows_contiguous(k) and k.stride() == v.stride()):
            k, v = k.contiguous(), v.contiguous()
        sets.append((k, v, c, n))
    return attend_rows(q, sets, scale=scale)


native_attend_rows_op = _register(native_attend_rows)


@native_attend_rows_op.register_fake
def _(q, ks, vs, cnts, ns_, scale):
    return _rows_out(q)


def native_add_residual(keys: Tensor, table: Tensor, bits: int, group_size: int) -> Tensor:
    """`native_sparse.add_residual`: a new fp32 tensor of ``keys``' shape."""
    return add_residual(keys, table, bits, group_size)


native_add_residual_op = _register(native_add_residual)


@native_add_residual_op.register_fake
def _(keys, table, bits, group_size):
    return torch.empty_like(keys, memory_format=torch.contiguous_format)


def native_merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """`native_sparse.merge_states`: new fp32 ``out`` and ``lse``."""
    return merge_states(out_a, lse_a, out_b, lse_b)


native_merge_states_op = _register(native_merge_states)


@native_merge_states_op.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return (torch.empty_like(out_a, memory_format=torch.contiguous_format),
            torch.empty_like(lse_a, memory_format=torch.contiguous_format))


def native_shadowkv_tail(q: Tensor, landmarks: Tensor, selectable: Tensor, v_sum: Tensor, ids: Optional[Tensor],
                         values: Optional[Tensor], chunk_size: int, tail_chunk: int,
                         scale: float) -> tuple[Tensor, Tensor]:
    """`native_sparse.shadowkv_tail`: fp32 out (B, H_q, D) and lse (B, H_q)."""
    return shadowkv_tail(q, landmarks, selectable, v_sum, ids, values, chunk_size=chunk_size,
                            tail_chunk=tail_chunk, scale=scale)


native_shadowkv_tail_op = _register(native_shadowkv_tail)


@native_shadowkv_tail_op.register_fake
def _(q, landmarks, selectable, v_sum, ids, values, chunk_size, tail_chunk, scale):
    return _rows_out(q)


# ----------------------------------------------------------------------------- packed stores
def native_channel_scores(q: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, bits: int,
                          group_size: int) -> Tensor:
    """`native_quant.channel_scores`: fp32 (B, H, M, T)."""
    if not _rows_contiguous(codes):
        codes = codes.contiguous()
    if not (_rows_contiguous(scale) and scale.stride() == zero.stride()):
        scale, zero = scale.contiguous(), zero.contiguous()
    return channel_scores(q, codes, scale, zero, bits, group_size)


native_channel_scores_op = _register(native_channel_scores)


@native_channel_scores_op.register_fake
def _(q, codes, scale, zero, bits, group_size):
    B, H, M, _ = q.shape
    return q.new_empty(B, H, M, codes.shape[2], dtype=torch.float32)


def native_token_values(p: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, bits: int,
                        group_size: int) -> Tensor:
    """`native_quant.token_values`: fp32 (B, H, M, D)."""
    if p.stride(3) != 1:
        p = p.contiguous()
    if not _rows_contiguous(codes):
        codes = codes.contiguous()
    if not (_rows_contiguous(scale) and scale.stride() == zero.stride()):
        scale, zero = scale.contiguous(), zero.contiguous()
    return token_values(p, codes, scale, zero, bits, group_size)


native_token_values_op = _register(native_token_values)


@native_token_values_op.register_fake
def _(p, codes, scale, zero, bits, group_size):
    B, H, M, _ = p.shape
    return p.new_empty(B, H, M, codes.shape[3] * 8 // bits, dtype=torch.float32)


def native_quant_attend(q: Tensor, k_win: Tensor, v_win: Tensor, win_starts: Optional[Tensor],
                        segment_tensors: list[Optional[Tensor]], segment_ints: list[int]) -> tuple[Tensor, Tensor]:
    """`native_quant.quant_attend` over segments flattened by `flatten_segments`."""
    if not (_rows_contiguous(k_win) and v_win.stride() == k_win.stride()):
        k_win, v_win = k_win.contiguous(), v_win.contiguous()
    return quant_attend(q, k_win=k_win, v_win=v_win, win_starts=win_starts,
                           segments=unflatten_segments(segment_tensors, segment_ints))


native_quant_attend_op = _register(native_quant_attend)


@native_quant_attend_op.register_fake
def _(q, k_win, v_win, win_starts, segment_tensors, segment_ints):
    B, H, M, D = q.shape
    return q.new_empty(B, H, M, D, dtype=torch.float32), q.new_empty(B, H, M, dtype=torch.float32)


def native_gear_key_extra(s: Tensor, q: Tensor, group_size: int, gear: list[Optional[Tensor]]) -> None:
    """`native_quant.gear_key_extra`, in place on the contiguous scores ``s``."""
    gear_key_extra(s, q, group_size, unflatten_gear(gear))


native_gear_key_extra_op = _register(native_gear_key_extra, ("s",))


@native_gear_key_extra_op.register_fake
def _(s, q, group_size, gear):
    return None


def native_gear_value_extra(out: Tensor, p: Tensor, group_size: int, gear: list[Optional[Tensor]]) -> None:
    """`native_quant.gear_value_extra`, in place on the contiguous output ``out``."""
    gear_value_extra(out, p, group_size, unflatten_gear(gear))


native_gear_value_extra_op = _register(native_gear_value_extra, ("out",))


@native_gear_value_extra_op.register_fake
def _(out, p, group_size, gear):
    return None
