"""Builds and loads ``csrc/`` (the compiled CPU kernels of `kvpress.kernels.native`) as one library.

``csrc/kvp.h`` holds what the C files share (inline helpers, the hidden internal functions);
``common.c`` the ABI version, thread cap and top-k selection; ``sparse.c``, ``quant.c``,
``quant_attend.c`` and ``shadowkv.c`` the kernels (their ``kvp_*`` functions are `_SIGNATURES`,
the only symbols the library exports). Built on first use with the system C compiler (``$CC``,
else ``cc`` / ``gcc``; ``-O3 -march=native -fopenmp``, every ``.c`` file in one invocation) into
``<kvpress cache>/native/<key>/`` (key: every source file and header, compiler, flags and CPU),
atomically, so parallel processes are safe; a read-only cache root falls back to
``$TMPDIR/kvpress-native-<uid>/<key>/``. No compiler, a failed build, a library without every
symbol of `_SIGNATURES`, or ``KVPRESS_NATIVE=0`` -> `available()` is False (with the reason).

The build folders are private: each is created with mode 0700, and one reused must be a real
folder (not a symlink) owned by this user; one open to others is tightened to 0700 and what it
held is rebuilt, one owned by someone else is refused (`available()` False, a warning; the
torch kernels run). A library is loaded only when this process built it or its sha256 matches
the one recorded beside it (``libkvpress_cpu.so.sha256``) by the build that wrote it; otherwise
it is rebuilt.

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
import stat
import subprocess
import tempfile
import warnings

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


LIB_NAME = "libkvpress_cpu.so"
DIGEST_NAME = LIB_NAME + ".sha256"  # the sha256 of the library's bytes, written by the process that built it


class UnsafeCacheError(OSError):
    """A build folder that is not private to this user (another owner, a symlink, not a folder)."""


def _uid() -> int | None:
    """This process's user id (None where the platform has none: no owner checks there)."""
    return os.getuid() if hasattr(os, "getuid") else None


def _private_dir(path: pathlib.Path) -> bool:
    """Create ``path`` (mode 0700) or reuse it when it is a real folder owned by this user.

    A folder we own that others could enter or write is tightened to 0700; returns True when it
    was writable by others (its files may have been planted: the caller must not trust them).
    Raises `UnsafeCacheError` for a symlink, a non-folder or a folder owned by someone else.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheError(f"{path} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"{path} is not a folder")
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        raise UnsafeCacheError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return bool(st.st_mode & 0o022)


def _native_root() -> pathlib.Path:
    from kvpress.smollm2_cache import cache_root

    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return root / "native"
    except OSError:  # read-only home: a per-user temp folder
        return pathlib.Path(tempfile.gettempdir()) / f"kvpress-native-{_uid() or 0}"


def _build_dir(cc: str) -> tuple[pathlib.Path, bool]:
    """The private build folder ``<root>/<key>`` and whether its contents are untrusted (it or
    its parent was writable by others before we tightened it)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    files = sorted(SOURCES + HEADERS, key=lambda p: p.name)  # an edit to any of them rebuilds
    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in (
        *(f.name.encode() + b"\0" + f.read_bytes() for f in files), cc, version, " ".join(FLAGS),
        _cpu_key()))).hexdigest()[:16]
    root = _native_root()
    exposed = _private_dir(root)
    exposed = _private_dir(root / key) or exposed
    return root / key, exposed


def _regular_file_of_ours(path: pathlib.Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    uid = _uid()
    return stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid)


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(folder: pathlib.Path) -> bool:
    """Whether ``folder``'s library is the one whose hash a build of ours recorded beside it."""
    lib, record = folder / LIB_NAME, folder / DIGEST_NAME
    if not (_regular_file_of_ours(lib) and _regular_file_of_ours(record)):
        return False
    return record.read_text().strip() == _digest(lib)


def _compile(cc: str, out: pathlib.Path) -> subprocess.CompletedProcess:
    """Compile every ``csrc/*.c`` into ``out`` with the first flag set of `BUILDS` that works."""
    for flags in BUILDS:
        done = subprocess.run([cc, *flags, "-o", str(out), *map(str, SOURCES), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode == 0:
            break
    return done


def _load(path: pathlib.Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


def _build() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library and '' , or None and why not.

    Loads ``<build folder>/libkvpress_cpu.so`` only when its sha256 matches the one recorded
    beside it at build time, in a folder private to this user; else builds it anew (and loads
    the file this process built).
    """
    if os.environ.get("KVPRESS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by KVPRESS_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    try:
        folder, exposed = _build_dir(cc)
    except UnsafeCacheError as exc:
        why = f"the native kernels' build folder is not private ({exc}); using the torch kernels"
        warnings.warn(why, RuntimeWarning, stacklevel=3)
        return None, why
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not prepare the native kernels' build folder: {exc}"
    lib = folder / LIB_NAME
    try:
        if not exposed and _trusted(folder):
            handle = _load(lib)
        else:
            if exposed:  # whatever others could have put here (files, symlinks) goes before we write
                for entry in folder.iterdir():
                    if not stat.S_ISDIR(os.lstat(entry).st_mode):
                        entry.unlink()
            tmp = folder / f"libkvpress_cpu.{os.getpid()}.tmp.so"
            done = _compile(cc, tmp)
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                return None, f"building {CSRC.name}/*.c with {cc} failed: {done.stderr.strip()[-600:]}"
            digest = _digest(tmp)
            handle = _load(tmp)  # the bytes this process built, whatever lands at `lib` meanwhile
            record = folder / f"{DIGEST_NAME}.{os.getpid()}.tmp"
            record.write_text(digest + "\n")
            os.replace(record, folder / DIGEST_NAME)
            os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not build or load the native kernels: {exc}"
    missing = [name for name in _SIGNATURES if not hasattr(handle, name)]
    if missing:
        return None, f"{lib} lacks the symbols {', '.join(missing)} (a stale or foreign build)"
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


def unavailable_reason() -> str:
    """Why the library is not available ("" when it is)."""
    return _library()[1]


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
