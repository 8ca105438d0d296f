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
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from .index import SparseIndex

SOURCE = pathlib.Path(__file__).with_name("csrc") / "cpu_decode.c"
ABI_VERSION = 4
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11")
_SERIAL = tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in FLAGS)  # no OpenMP runtime: one thread
# tried in order, so a compiler without -march=native or without OpenMP still gets a build
BUILDS = (FLAGS, tuple(f for f in FLAGS if f != "-march=native"),
          _SERIAL, tuple(f for f in _SERIAL if f != "-march=native"))
REDUCTION_CODES = {"max": 0, "mean": 1, "softmax_max": 2, "softmax_mean": 3}

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "kvp_abi_version": ([], _INT),
    "kvp_max_threads": ([], _INT),
    "kvp_set_max_threads": ([_INT], None),
    "kvp_label_select": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64,
                          _I64, _I64, _I64, _I64, _F32, _INT, _P], _INT),
    "kvp_sparse_decode": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64,
                           _P, _P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _F32, _P, _P], _INT),
    "kvp_channel_scores": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _INT, _I64, _P],
                           _INT),
    "kvp_token_values": ([_P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _INT, _I64,
                          _P], _INT),
    "kvp_gear_extra": ([_INT, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P], _INT),
    "kvp_quant_attend": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _P], _INT),
}


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU model and flags (Linux), else the platform."""
    info = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(sorted({line for line in f if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    return info


def _build_dir(cc: str) -> pathlib.Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in (
        SOURCE.read_bytes(), cc, version, " ".join(FLAGS), _cpu_key()))).hexdigest()[:16]
    from kvpress.smollm2_cache import cache_root

    root = cache_root() / "native"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:  # read-only home: a per-user temp folder
        root = pathlib.Path(tempfile.gettempdir()) / f"kvpress-native-{os.getuid() if hasattr(os, 'getuid') else 0}"
    return root / key


def _build() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library and '' , or None and why not."""
    if os.environ.get("KVPRESS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by KVPRESS_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    try:
        folder = _build_dir(cc)
        lib = folder / "libkvpress_cpu.so"
        if not lib.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f"libkvpress_cpu.{os.getpid()}.tmp.so"
            for flags in BUILDS:
                done = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True,
                                      text=True, timeout=300)
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                return None, f"building {SOURCE.name} with {cc} failed: {done.stderr.strip()[-600:]}"
            os.replace(tmp, lib)
        handle = ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not build or load the native kernels: {exc}"
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = args, res
    if handle.kvp_abi_version() != ABI_VERSION:
        return None, f"{lib} has ABI {handle.kvp_abi_version()}, expected {ABI_VERSION}"
    if len(openmp_runtimes()) > 1:  # ours is not torch's: two thread pools would spin against each other
        handle.kvp_set_max_threads(1)
    return handle, ""


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime libraries mapped into this process (Linux; [] elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if line.count(" ") >= 5}
    except OSError:
        return []
    names = ("libgomp", "libomp", "libiomp")
    return sorted(p for p in paths if os.path.basename(p).startswith(names) and ".so" in os.path.basename(p))


def threads() -> int:
    """Threads a native kernel may use now: torch's (``torch.set_num_threads``), or 1 when the
    library was built without OpenMP or found a second OpenMP runtime beside torch's."""
    return _lib().kvp_max_threads()


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return _build()


def available() -> bool:
    """Whether the native CPU kernels are built and loaded (built on the first call)."""
    return _library()[0] is not None


def _lib() -> ctypes.CDLL:
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"backend='native' is not available: {why}; use backend='torch' (or 'auto')")
    return lib


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """(B, H, T, D) with rows of D contiguous and consecutive (the last two dims dense)."""
    return t.stride(3) == 1 and (t.shape[2] <= 1 or t.stride(2) == t.shape[3])


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


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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


QUANT_MAX_ROWS = 8  # query rows per KV head the packed-store kernels take (a decode step's GQA group)


def quant_unsupported(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> str | None:
    """Why `channel_scores` / `token_values` cannot read this packed store with these query rows
    or probabilities ``x`` (B, H, M, *), or None when they can."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 4 or x.stride(3) != 1:
        return "it needs fp32 CPU queries / probabilities (B, H, M, *) with a contiguous last dim"
    if not 1 <= x.shape[2] <= QUANT_MAX_ROWS:
        return f"it takes 1 to {QUANT_MAX_ROWS} query rows per KV head (a decode step), got {x.shape[2]}"
    if codes.dtype != torch.uint8 or codes.device.type != "cpu" or not _rows_contiguous(codes):
        return "it needs uint8 CPU codes (B, H, T, D * bits / 8) with dense (T, bytes) dims"
    if (scale.dtype != torch.float16 or zero.dtype != torch.float16 or not _rows_contiguous(scale)
            or zero.stride() != scale.stride()):
        return "it needs fp16 scales and zero points with dense last two dims and equal strides"
    return None


def channel_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   group_size: int) -> torch.Tensor:
    """``q @ dequant(k)^T`` for per-channel-quantized keys (`kvpress.kernels.quant.channel_quant_scores`).

    q : fp32 (B, H, M, D), M <= 8; codes (B, H, T, D * bits / 8); scale / zero fp16 (B, H, T / G, D).
    Returns fp32 (B, H, M, T), unscaled. Inputs checked with `quant_unsupported` by the caller.
    """
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

    p : fp32 (B, H, M, T) with a contiguous last dim (a slice of wider scores is fine), M <= 8;
    codes (B, H, T, D * bits / 8); scale / zero fp16 (B, H, T, D / group_size).
    Returns fp32 (B, H, M, D). Inputs checked with `quant_unsupported` by the caller.
    """
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
    """``kvp_segment`` of csrc/cpu_decode.c (field order and types must match)."""

    _fields_ = [(name, _P) for name in ("kc", "ks", "kz", "vc", "vs", "vz")] + \
        [(name, _I64) for name in ("kc_sb", "kc_sh", "ks_sb", "ks_sh", "vc_sb", "vc_sh", "vs_sb", "vs_sh",
                                   "n", "bits", "G", "Gv")] + \
        [("starts", _P), ("st_sb", _I64), ("st_sh", _I64), ("vmul", _P), ("vm_sb", _I64), ("vm_sh", _I64),
         ("gear", _P)]


class _Gear(ctypes.Structure):
    """``kvp_gear`` of csrc/cpu_decode.c (field order and types must match)."""

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
    """

    k: tuple
    v: tuple
    bits: int
    group_size: int
    value_group_size: int
    starts: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    gear: GearParts | None = None


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
    if segments is None:
        segments = [PackedSegment((k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero), bits, group_size,
                                  value_group_size, starts)]
    elif k_codes is not None or starts is not None:
        raise ValueError("quant_attend takes one packed store or `segments`, not both")
    if len(segments) > MAX_SEGMENTS:
        raise ValueError(f"quant_attend takes at most {MAX_SEGMENTS} segments, got {len(segments)}")
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
        for name, value in fields.items():
            setattr(st, name, value)
    out = torch.empty(B, H, M, D, dtype=torch.float32)
    lse = torch.empty(B, H, M, dtype=torch.float32)
    win_starts = None if win_starts is None else win_starts.to(torch.int32).contiguous()
    rc = lib.kvp_quant_attend(q.data_ptr(), B, H, M, D, ctypes.addressof(structs), len(segments),
                              k_win.data_ptr(), v_win.data_ptr(), k_win.stride(0), k_win.stride(1), k_win.shape[2],
                              _ptr(win_starts), out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise RuntimeError(f"kvp_quant_attend refused its inputs (code {rc})")
    return out, lse


def gear_key_extra(s: torch.Tensor, q: torch.Tensor, group_size: int, parts: GearParts) -> torch.Tensor:
    """Adds GEAR's key corrections (``parts``' ``k_low``, ``k_out``, ``sinks``) to the scores of
    its N packed tokens, in place: ``q . (l_t rf_c(t)^T)``, ``q[d] * corr`` at each outlier's
    token, ``q . sk_i`` at each sink's column (the torch reference is
    `kvpress.policies.gear.GearLayer._quant_scores`).

    s : fp32 (B, H, M, N) contiguous, the packed codes' scores; q : fp32 (B, H, M, D), scaled, M <= 8.
    Returns ``s``.
    """
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
    with a contiguous last dim, M <= 8. Returns ``out``.
    """
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
