"""Compiled readers of packed low-bit K/V (`kvpress.kernels.quant`'s format), re-exported by
`kvpress.kernels.native` (see its docstring): `channel_scores`, `token_values`, `quant_attend`
over `PackedSegment` s (with `GearParts`), `gear_key_extra` / `gear_value_extra`. References:
`kvpress.kernels.quant` and ``gear``'s torch path; tests: ``tests/kernels/test_native_quant.py``.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ._native_lib import _I64, _P, _fp32_cpu, _lib, _ptr, _rows_contiguous

QUANT_MAX_ROWS = 8  # query rows per KV head one call of the packed-store kernels takes (a decode step's GQA group)
# `channel_scores`, `token_values` and GEAR's extras take more rows in blocks of QUANT_MAX_ROWS, one
# call each (every call reads the packed store again); `kvpress.kernels.quant.reads_natively`
# sends reads of up to this many rows per KV head to them under backend="auto" (a verification
# forward of a few tokens), more to torch
QUANT_NATIVE_READ_ROWS = 64


def _row_blocks(m: int) -> list[tuple[int, int]]:
    return [(a, min(m, a + QUANT_MAX_ROWS)) for a in range(0, m, QUANT_MAX_ROWS)]


def quant_unsupported(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> str | None:
    """Why `channel_scores` / `token_values` cannot read this packed store with these query rows
    or probabilities ``x`` (B, H, M, *), or None when they can."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 4 or x.stride(3) != 1:
        return "it needs fp32 CPU queries / probabilities (B, H, M, *) with a contiguous last dim"
    if x.shape[2] < 1:
        return "it needs at least one query row"
    if codes.dtype != torch.uint8 or codes.device.type != "cpu" or not _rows_contiguous(codes):
        return "it needs uint8 CPU codes (B, H, T, D * bits / 8) with dense (T, bytes) dims"
    if (scale.dtype != torch.float16 or zero.dtype != torch.float16 or not _rows_contiguous(scale)
            or zero.stride() != scale.stride()):
        return "it needs fp16 scales and zero points with dense last two dims and equal strides"
    return None


def channel_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   group_size: int) -> torch.Tensor:
    """``q @ dequant(k)^T`` for per-channel-quantized keys (`kvpress.kernels.quant.channel_quant_scores`).

    q : fp32 (B, H, M, D); codes (B, H, T, D * bits / 8); scale / zero fp16 (B, H, T / G, D).
    Returns fp32 (B, H, M, T), unscaled. Inputs checked with `quant_unsupported` by the caller.
    More than `QUANT_MAX_ROWS` rows run in blocks of that many.
    """
    if q.shape[2] > QUANT_MAX_ROWS:
        return torch.cat([channel_scores(q[:, :, a:b], codes, scale, zero, bits, group_size)
                          for a, b in _row_blocks(q.shape[2])], dim=2)
    lib = _lib()
    q = q.contiguous()
    B, H, M, D = q.shape
    T = codes.shape[2]
    out = torch.empty(B, H, M, T, dtype=torch.float32)
    rc = lib.kvp_channel_scores(q.data_ptr(), B, H, M, D, codes.data_ptr(), codes.stride(0), codes.stride(1),
                                scale.data_ptr(), zero.data_ptr(), scale.stride(0), scale.stride(1),
                                T, int(bits), int(group_size), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_channel_scores refused its inputs (code {rc})")
    return out


def token_values(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                 group_size: int) -> torch.Tensor:
    """``p @ dequant(v)`` for per-token-quantized values (`kvpress.kernels.quant.token_quant_values`).

    p : fp32 (B, H, M, T) with a contiguous last dim (a slice of wider scores is fine);
    codes (B, H, T, D * bits / 8); scale / zero fp16 (B, H, T, D / group_size).
    Returns fp32 (B, H, M, D). Inputs checked with `quant_unsupported` by the caller.
    More than `QUANT_MAX_ROWS` rows run in blocks of that many.
    """
    if p.shape[2] > QUANT_MAX_ROWS:
        return torch.cat([token_values(p[:, :, a:b], codes, scale, zero, bits, group_size)
                          for a, b in _row_blocks(p.shape[2])], dim=2)
    lib = _lib()
    B, H, M, T = p.shape
    if p.stride(0) != H * M * p.stride(2) or p.stride(1) != M * p.stride(2):
        p = p.contiguous()
    D = codes.shape[3] * 8 // bits
    out = torch.empty(B, H, M, D, dtype=torch.float32)
    rc = lib.kvp_token_values(p.data_ptr(), B, H, M, p.stride(2), D, codes.data_ptr(), codes.stride(0),
                              codes.stride(1), scale.data_ptr(), zero.data_ptr(), scale.stride(0), scale.stride(1),
                              T, int(bits), int(group_size), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_token_values refused its inputs (code {rc})")
    return out


class _Segment(ctypes.Structure):
    """``kvp_segment`` of csrc/quant_attend.c (field order and types must match)."""

    _fields_ = [(name, _P) for name in ("kc", "ks", "kz", "vc", "vs", "vz")] + \
        [(name, _I64) for name in ("kc_sb", "kc_sh", "ks_sb", "ks_sh", "vc_sb", "vc_sh", "vs_sb", "vs_sh",
                                   "n", "bits", "G", "Gv")] + \
        [("starts", _P), ("st_sb", _I64), ("st_sh", _I64), ("vmul", _P), ("vm_sb", _I64), ("vm_sh", _I64),
         ("gear", _P), ("rc", _P), ("rs", _P), ("ridx", _P)] + \
        [(name, _I64) for name in ("rc_sb", "rc_sh", "rs_sb", "rs_sh", "ri_sb", "ri_sh", "R")]


class _Gear(ctypes.Structure):
    """``kvp_gear`` of csrc/quant_attend.c (field order and types must match)."""

    _fields_ = [("R", _I64), ("bounds", _P), ("C", _I64)] + [(n, _P) for n in ("kl", "kr", "vl", "vr")] + \
        [(n, _I64) for n in ("kl_sb", "kl_sh", "kr_sb", "kr_sh", "vl_sb", "vl_sh", "vr_sb", "vr_sh", "J")] + \
        [(n, _P) for n in ("ko", "vo", "kx", "vx")] + [(n, _I64) for n in ("ko_sb", "ko_sh", "vo_sb", "vo_sh", "S")] + \
        [("sk", _P), ("sv", _P), ("sk_sb", _I64), ("sk_sh", _I64), ("sink_start", _P)]


@dataclass(frozen=True)
class GearParts:
    """GEAR's corrections to a packed store of ``n`` tokens (each part optional):

    bounds : int64 (C + 1,), the flushed chunks' first tokens then ``n`` (with the low-rank parts)
    k_low / v_low : (left fp16 (B, H, >=n, R), right fp16 (B, H, >=C, D, R)) of the keys' / values' error
    k_out : (offsets uint8, corrections fp16), (B, H, >=n/G, J, D); v_out : (B, H, >=n, D/Gv * J)
    sinks : (sk, sv) fp16 (B, H, S, D), the corrections of each row's first S real tokens, which
        start at ``sink_start`` (B,) int (None: 0)
    """

    bounds: torch.Tensor | None = None
    k_low: tuple | None = None
    v_low: tuple | None = None
    k_out: tuple | None = None
    v_out: tuple | None = None
    sinks: tuple | None = None
    sink_start: torch.Tensor | None = None

    def struct(self, B: int, H: int, D: int, n: int, G: int, Gv: int, keep: list) -> _Gear:
        """The checked ctypes struct (tensors it points into appended to ``keep``)."""
        x = _Gear()
        lows = [t for t in (self.k_low, self.v_low) if t is not None]
        if lows:
            bounds = self.bounds
            if (bounds is None or bounds.dtype != torch.int64 or not bounds.is_contiguous() or bounds.dim() != 1
                    or int(bounds[0]) != 0 or int(bounds[-1]) != n):
                raise ValueError(f"GEAR low-rank parts need int64 contiguous chunk bounds (C + 1,) from 0 to n={n}")
            x.R, x.bounds, x.C = lows[0][0].shape[-1], bounds.data_ptr(), bounds.numel() - 1
            for left, right in lows:
                ok = (left.dtype == right.dtype == torch.float16 and _rows_contiguous(left)
                      and right[0, 0].is_contiguous() and left.shape[:2] == right.shape[:2] == (B, H) and left.shape[2] >= n
                      and right.shape[2] >= x.C and right.shape[3] == D and left.shape[3] == right.shape[4] == x.R)
                if not ok:
                    raise ValueError(f"GEAR low-rank factors must be fp16 left (B, H, >=n, R) and right "
                                     f"(B, H, >=C, D={D}, R) with dense inner dims, one R for keys and values")
        for name, low in (("k", self.k_low), ("v", self.v_low)):
            if low is not None:
                left, right = low
                setattr(x, f"{name}l", left.data_ptr()), setattr(x, f"{name}r", right.data_ptr())
                setattr(x, f"{name}l_sb", left.stride(0)), setattr(x, f"{name}l_sh", left.stride(1))
                setattr(x, f"{name}r_sb", right.stride(0)), setattr(x, f"{name}r_sh", right.stride(1))
        J = {}
        for name, out, rows, last in (("k", self.k_out, n // G, D), ("v", self.v_out, n, None)):
            if out is None:
                continue
            off, corr = out
            ok = (off.dtype == torch.uint8 and corr.dtype == torch.float16 and off.shape == corr.shape
                  and off.stride() == corr.stride() and off[0, 0].is_contiguous() and off.shape[:2] == (B, H)
                  and off.shape[2] >= rows and off.dim() == (5 if name == "k" else 4))
            ok = ok and (off.shape[4] == D if name == "k" else off.shape[3] % (D // Gv) == 0)
            if not ok:
                raise ValueError("GEAR outliers must be uint8 offsets and fp16 corrections of one shape and strides, "
                                 f"dense after the head dim: keys (B, H, n/G, J, D={D}), values (B, H, n, D/Gv * J)")
            J[name] = off.shape[3] if name == "k" else off.shape[3] // (D // Gv)
            setattr(x, f"{name}o", off.data_ptr()), setattr(x, f"{name}x", corr.data_ptr())
            setattr(x, f"{name}o_sb", off.stride(0)), setattr(x, f"{name}o_sh", off.stride(1))
        if len(set(J.values())) > 1:
            raise ValueError(f"GEAR keys and values must keep the same outliers per group, got {J}")
        x.J = next(iter(J.values()), 0)
        if self.sinks is not None:
            sk, sv = self.sinks
            if not (sk.dtype == sv.dtype == torch.float16 and sk.shape == sv.shape and sk.stride() == sv.stride()
                    and sk.dim() == 4 and sk.shape[:2] == (B, H) and sk.shape[3] == D and sk[0, 0].is_contiguous()):
                raise ValueError(f"GEAR sink corrections must be fp16 (B, H, S, D={D}) pairs of one layout")
            x.S, x.sk, x.sv, x.sk_sb, x.sk_sh = sk.shape[2], sk.data_ptr(), sv.data_ptr(), sk.stride(0), sk.stride(1)
            if self.sink_start is not None:
                st = self.sink_start.to(torch.int32).contiguous()
                if st.shape != (B,):
                    raise ValueError(f"GEAR sink_start must be (B,), got {tuple(self.sink_start.shape)}")
                keep.append(st)
                x.sink_start = st.data_ptr()
        return x


MAX_SEGMENTS = 8


@dataclass(frozen=True)
class PackedSegment:
    """One packed store for `quant_attend`: per-channel keys ``k = (codes, scale, zero)`` and
    per-token values ``v = (codes, scale, zero)`` of ``n`` tokens (`kvpress.kernels.quant`'s format,
    ``n`` = ``k[0].shape[2]``, a multiple of ``group_size``).

    starts : int (B,) or (B, H), or None: tokens before it (per row, or per row and KV head) are
        not attended (left padding).
    value_scale : fp16 (B, H, D) or None: a per-channel factor on this segment's values.
    gear : `GearParts` or None: GEAR's corrections to this store.
    refine : ``(codes, scale, channels)`` or None: refined key channels
        (`kvpress.kernels.quant.quantize_refined_keys`): second codes uint8 (B, H, >=n, R * bits / 8),
        fp16 scales (B, H, >=n / group_size, R), channel ids int64 (B, H, R); ``bits <= 4``.
    """

    k: tuple
    v: tuple
    bits: int
    group_size: int
    value_group_size: int
    starts: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    gear: GearParts | None = None
    refine: tuple | None = None


def as_segments(segments, keys, values, bits, group_size, value_group_size, starts) -> list:
    """`quant_attend`'s packed stores as a list of `PackedSegment`: ``segments`` as given, or the one
    store ``keys`` / ``values`` (``(codes, scale, zero)`` each) describe; ValueError for both or too many."""
    if segments is None:
        return [PackedSegment(keys, values, bits, group_size, value_group_size, starts)]
    if keys[0] is not None or starts is not None:
        raise ValueError("quant_attend takes one packed store or `segments`, not both")
    if len(segments) > MAX_SEGMENTS:
        raise ValueError(f"quant_attend takes at most {MAX_SEGMENTS} segments, got {len(segments)}")
    return segments


def quant_attend(q: torch.Tensor, k_codes=None, k_scale=None, k_zero=None, v_codes=None, v_scale=None, v_zero=None, *,
                 bits: int = 0, group_size: int = 0, value_group_size: int = 0, k_win: torch.Tensor,
                 v_win: torch.Tensor, starts: torch.Tensor | None = None, win_starts: torch.Tensor | None = None,
                 segments: list[PackedSegment] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step over packed stores and a full-precision window, under one softmax.

    q : fp32 (B, H, M, D), already scaled, M <= 8 (the GQA group of one new token).
    k_codes, k_scale, k_zero / v_codes, v_scale, v_zero : one packed store (``kivi``'s), read with
        ``bits``, ``group_size``, ``value_group_size`` and ``starts`` -- or ``segments``: up to
        `MAX_SEGMENTS` `PackedSegment` (``zipcache``'s two stores), not both.
    k_win, v_win : fp32 (B, H, W, D) with dense (W, D) dims: the window.
    starts, win_starts : int (B,) or None: packed tokens / window rows before these are not
        attended (left padding).

    Returns fp32 ``out`` (B, H, M, D) and ``lse`` (B, H, M) (-inf when nothing is attended).
    Packed inputs checked with `quant_unsupported` (every store) by the caller.
    """
    lib = _lib()
    q = q.contiguous()
    B, H, M, D = q.shape
    segments = as_segments(segments, (k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero), bits, group_size,
                           value_group_size, starts)
    if not (_fp32_cpu(k_win, v_win) and _rows_contiguous(k_win) and v_win.stride() == k_win.stride()):
        raise ValueError("quant_attend needs fp32 CPU windows (B, H, W, D) with dense (W, D) dims and equal strides")
    keep = []  # tensors the structs point into, alive until the call returns
    structs = (_Segment * max(1, len(segments)))()
    for st, seg in zip(structs, segments):
        (kc, ks, kz), (vc, vs, vz) = seg.k, seg.v
        n, G, Gv = kc.shape[2], int(seg.group_size), int(seg.value_group_size)
        if not (kc.shape[:2] == vc.shape[:2] == (B, H) and vc.shape[2] == vs.shape[2] == n
                and ks.shape[2] == n // max(G, 1) and kc.shape[3] * 8 == D * int(seg.bits) == vc.shape[3] * 8 and ks.shape[3] == D
                and vs.shape[3] == D // max(Gv, 1)):
            raise ValueError(f"quant_attend: a segment's codes, scales and zero points do not describe {n} tokens of "
                             f"(B, H, D) = {(B, H, D)} at {seg.bits} bits, groups {G} / {Gv}")
        fields = dict(kc=kc.data_ptr(), ks=ks.data_ptr(), kz=kz.data_ptr(), vc=vc.data_ptr(), vs=vs.data_ptr(),
                      vz=vz.data_ptr(), kc_sb=kc.stride(0), kc_sh=kc.stride(1), ks_sb=ks.stride(0), ks_sh=ks.stride(1),
                      vc_sb=vc.stride(0), vc_sh=vc.stride(1), vs_sb=vs.stride(0), vs_sh=vs.stride(1), n=kc.shape[2],
                      bits=int(seg.bits), G=int(seg.group_size), Gv=int(seg.value_group_size))
        if seg.starts is not None:
            st_t = seg.starts.to(torch.int32).contiguous()
            if st_t.shape not in ((B,), (B, H)):
                raise ValueError(f"segment starts must be (B,) or (B, H), got {tuple(seg.starts.shape)}")
            keep.append(st_t)
            fields.update(starts=st_t.data_ptr(), st_sb=st_t.stride(0), st_sh=st_t.stride(1) if st_t.dim() == 2 else 0)
        if seg.value_scale is not None:
            vm = seg.value_scale
            if vm.dtype != torch.float16 or vm.shape != (B, H, D) or vm.stride(2) != 1:
                raise ValueError("segment value_scale must be fp16 (B, H, D) with a contiguous last dim")
            fields.update(vmul=vm.data_ptr(), vm_sb=vm.stride(0), vm_sh=vm.stride(1))
        if seg.gear is not None:
            gx = seg.gear.struct(B, H, D, n, G, Gv, keep)
            keep.append(gx)
            fields["gear"] = ctypes.addressof(gx)
        if seg.refine is not None:
            rc, rs, ridx = seg.refine
            R = ridx.shape[-1]
            if not (rc.dtype == torch.uint8 and rs.dtype == torch.float16 and ridx.dtype == torch.int64
                    and rc.shape[:2] == rs.shape[:2] == ridx.shape[:2] == (B, H) and int(seg.bits) <= 4
                    and rc.shape[2] >= n and rc.shape[3] * 8 == R * int(seg.bits) and rs.shape[2] >= n // max(G, 1)
                    and rs.shape[3] == R and rc.stride(3) == 1 and rc.stride(2) == rc.shape[3] and rs.stride(3) == 1
                    and rs.stride(2) == R and ridx.stride(2) == 1 and 0 < R <= D):
                raise ValueError(f"quant_attend: a segment's refined key channels must be uint8 codes (B, H, >=n, "
                                 f"R * bits / 8), fp16 scales (B, H, >=n / G, R) with dense rows and int64 channel "
                                 f"ids (B, H, R) in [0, {D}), bits <= 4")
            fields.update(rc=rc.data_ptr(), rs=rs.data_ptr(), ridx=ridx.data_ptr(), rc_sb=rc.stride(0),
                          rc_sh=rc.stride(1), rs_sb=rs.stride(0), rs_sh=rs.stride(1), ri_sb=ridx.stride(0),
                          ri_sh=ridx.stride(1), R=R)
        for name, value in fields.items():
            setattr(st, name, value)
    out = torch.empty(B, H, M, D, dtype=torch.float32)
    lse = torch.empty(B, H, M, dtype=torch.float32)
    win_starts = None if win_starts is None else win_starts.to(torch.int32).contiguous()
    rc = lib.kvp_quant_attend(q.data_ptr(), B, H, M, D, ctypes.addressof(structs), len(segments),
                              k_win.data_ptr(), v_win.data_ptr(), k_win.stride(0), k_win.stride(1), k_win.shape[2],
                              _ptr(win_starts), out.data_ptr(), lse.data_ptr())
    if rc == -5:  # checked in C, where it is free: the same check in torch took 15-30 us per call
        raise ValueError(f"quant_attend: a segment's refined key channel ids must lie in [0, {D})")
    if rc != 0:
        raise RuntimeError(f"kvp_quant_attend refused its inputs (code {rc})")
    return out, lse


def gear_key_extra(s: torch.Tensor, q: torch.Tensor, group_size: int, parts: GearParts) -> torch.Tensor:
    """Adds GEAR's key corrections (``parts``' ``k_low``, ``k_out``, ``sinks``) to the scores of
    its N packed tokens, in place: ``q . (l_t rf_c(t)^T)``, ``q[d] * corr`` at each outlier's
    token, ``q . sk_i`` at each sink's column (the torch reference is
    `kvpress.policies.gear.GearLayer._quant_scores`).

    s : fp32 (B, H, M, N) contiguous, the packed codes' scores; q : fp32 (B, H, M, D), scaled
    (more than `QUANT_MAX_ROWS` rows in blocks of that many). Returns ``s``.
    """
    if q.shape[2] > QUANT_MAX_ROWS and s.shape[2] == q.shape[2]:
        for a, b in _row_blocks(q.shape[2]):
            s[:, :, a:b] = gear_key_extra(s[:, :, a:b].contiguous(), q[:, :, a:b], group_size, parts)
        return s
    lib = _lib()
    q = q.contiguous()
    B, H, M, D = q.shape
    N = s.shape[3]
    if not (_fp32_cpu(s, q) and s.is_contiguous() and s.shape[:3] == (B, H, M) and 1 <= M <= QUANT_MAX_ROWS):
        raise ValueError(f"gear_key_extra needs fp32 CPU contiguous scores (B, H, M, N) and q (B, H, M, D), "
                         f"M <= {QUANT_MAX_ROWS}")
    keep = []
    x = GearParts(parts.bounds, k_low=parts.k_low, k_out=parts.k_out, sinks=parts.sinks,
                  sink_start=parts.sink_start).struct(B, H, D, N, group_size, group_size, keep)
    rc = lib.kvp_gear_extra(0, q.data_ptr(), B, H, M, D, D, N, ctypes.addressof(x), int(group_size), s.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_gear_extra (keys) refused its inputs (code {rc})")
    return s


def gear_value_extra(out: torch.Tensor, p: torch.Tensor, group_size: int, parts: GearParts) -> torch.Tensor:
    """Adds GEAR's value corrections (``parts``' ``v_low``, ``v_out``, ``sinks``) to ``out`` in
    place: ``sum_c (p_c l_c) rf_c^T``, ``p[t] * corr`` at each outlier's channel, ``p[col] sv_i``
    (the torch reference is `kvpress.policies.gear.GearLayer._quant_output`).

    out : fp32 (B, H, M, D) contiguous; p : fp32 (B, H, M, N) probabilities of the N packed tokens
    with a contiguous last dim (more than `QUANT_MAX_ROWS` rows in blocks of that many). Returns ``out``.
    """
    if p.shape[2] > QUANT_MAX_ROWS and out.shape[2] == p.shape[2]:
        for a, b in _row_blocks(p.shape[2]):
            out[:, :, a:b] = gear_value_extra(out[:, :, a:b].contiguous(), p[:, :, a:b], group_size, parts)
        return out
    lib = _lib()
    B, H, M, N = p.shape
    D = out.shape[3]
    if p.stride(0) != H * M * p.stride(2) or p.stride(1) != M * p.stride(2):
        p = p.contiguous()
    if not (_fp32_cpu(out, p) and out.is_contiguous() and out.shape[:3] == (B, H, M) and p.stride(3) == 1
            and 1 <= M <= QUANT_MAX_ROWS and D % group_size == 0):
        raise ValueError(f"gear_value_extra needs fp32 CPU outputs (B, H, M, D) contiguous and probabilities "
                         f"(B, H, M, N) with a contiguous last dim, M <= {QUANT_MAX_ROWS}, D divisible by the group")
    keep = []
    x = GearParts(parts.bounds, v_low=parts.v_low, v_out=parts.v_out, sinks=parts.sinks,
                  sink_start=parts.sink_start).struct(B, H, D, N, group_size, group_size, keep)
    rc = lib.kvp_gear_extra(1, p.data_ptr(), B, H, M, p.stride(2), D, N, ctypes.addressof(x), int(group_size),
                            out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_gear_extra (values) refused its inputs (code {rc})")
    return out
