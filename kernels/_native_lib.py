"""Builds and loads ``csrc/`` (the compiled CPU kernels of `kvpress.kernels.native`) as one library.

``csrc/kvp.h`` holds what the C files share (inline helpers, the hidden internal functions);
``common.c`` the ABI version, thread cap and top-k selection; ``sparse.c``, ``quant.c``,
``quant_attend.c`` and ``shadowkv.c`` the kernels (their ``kvp_*`` functions are `_SIGNATURES`,
the only symbols the library exports). Built on first use with the system C compiler (``$CC``,
else ``cc`` / ``gcc``; ``-O3 -march=native -fopenmp``, every ``.c`` file in one invocation) into
``<kvpress cache>/native/<key>/`` (key: every source file and header, compiler, flags and CPU),
atomically, so parallel processes are safe. No compiler, a failed build, or ``KVPRESS_NATIVE=0``
-> `available()` is False.

Threads: built with ``-fopenmp``, the library shares the OpenMP runtime torch has loaded (same
``libgomp.so.1``), so its kernels run on torch's worker threads and follow
``torch.set_num_threads`` (`threads()`). A second OpenMP runtime in the process, or a compiler
without OpenMP, leaves one thread. Also the small input helpers the wrappers share.
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

import torch

CSRC = pathlib.Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.c")))  # compiled together into one library
HEADERS = tuple(sorted(CSRC.glob("*.h")))
# KVP_ABI_VERSION of csrc/kvp.h (7: kvp_shadowkv_select takes `tokens`; 8: kvp_add_residual, kvp_shadowkv_tail;
# 9: kvp_merge_states; 10: kvp_segment's refined key channels)
ABI_VERSION = 10
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11")
_SERIAL = tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in FLAGS)  # no OpenMP runtime: one thread
# tried in order, so a compiler without -march=native or without OpenMP still gets a build
BUILDS = (FLAGS, tuple(f for f in FLAGS if f != "-march=native"),
          _SERIAL, tuple(f for f in _SERIAL if f != "-march=native"))

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
    "kvp_shadowkv_select": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _P, _P, _P, _I64, _P,
                             _I64, _I64, _F32, _INT, _INT, _P, _P], _INT),
    "kvp_attend_rows": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _F32, _P, _P], _INT),
    "kvp_add_residual": ([_P, _P, _I64, _I64, _I64, _INT, _I64, _P], _INT),
    "kvp_merge_states": ([_P, _P, _P, _P, _I64, _I64, _P, _P], _INT),
    "kvp_shadowkv_tail": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _F32,
                           _P, _P], _INT),
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
    files = sorted(SOURCES + HEADERS, key=lambda p: p.name)  # an edit to any of them rebuilds
    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in (
        *(f.name.encode() + b"\0" + f.read_bytes() for f in files), cc, version, " ".join(FLAGS),
        _cpu_key()))).hexdigest()[:16]
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
                done = subprocess.run([cc, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"], capture_output=True,
                                      text=True, timeout=300)
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                return None, f"building {CSRC.name}/*.c with {cc} failed: {done.stderr.strip()[-600:]}"
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

def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
