"""The native library's build cache: private folders, hash-checked loads, missing symbols."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import warnings

import pytest
import torch

from kvpress.kernels import _native_lib as nl
from kvpress.kernels import SparseIndex, sparse_decode

pytestmark = pytest.mark.skipif(not nl.available(), reason=f"native kernels unavailable: {nl._library()[1]}")


@pytest.fixture(scope="module")
def genuine_bytes() -> bytes:
    """The bytes of the library this process loaded (built or hash-checked in the real cache)."""
    folder, _ = nl._build_dir(nl._compiler())
    return (folder / nl.LIB_NAME).read_bytes()


@pytest.fixture
def cache(monkeypatch, tmp_path, genuine_bytes):
    """A fresh cache root; `_compile` copies the genuine library (no compiler run), every build
    and every load is recorded."""
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVPRESS_NATIVE", raising=False)
    log = {"compiled": [], "loaded": []}
    real_load = nl._load

    def fake_compile(cc, out):
        log["compiled"].append(out)
        out.write_bytes(genuine_bytes)
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    def spy_load(path):
        log["loaded"].append(path)
        return real_load(path)

    monkeypatch.setattr(nl, "_compile", fake_compile)
    monkeypatch.setattr(nl, "_load", spy_load)
    return log


def _key_dir(tmp_path):
    folders = [p for p in (tmp_path / "cache" / "native").iterdir() if p.is_dir()]
    assert len(folders) == 1
    return folders[0]


def _plant(folder, data: bytes, record: str | None = None):
    (folder / nl.LIB_NAME).unlink(missing_ok=True)  # a new file: the loaded one stays mapped
    (folder / nl.LIB_NAME).write_bytes(data)
    if record is not None:
        (folder / nl.DIGEST_NAME).write_text(record)


def test_fresh_build_is_private_recorded_and_reused(cache, tmp_path, genuine_bytes):
    handle, why = nl._build()
    assert handle is not None, why
    folder = _key_dir(tmp_path)
    assert cache["compiled"] and cache["loaded"] == cache["compiled"]  # the file this process built
    for d in (folder, folder.parent):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    assert (folder / nl.DIGEST_NAME).read_text().strip() == hashlib.sha256(genuine_bytes).hexdigest()
    handle, why = nl._build()  # a second process: the recorded library, no rebuild
    assert handle is not None, why
    assert len(cache["compiled"]) == 1 and cache["loaded"][-1] == folder / nl.LIB_NAME


@pytest.mark.parametrize("level", ["key", "root"])
def test_planted_library_in_a_world_writable_folder_is_never_loaded(cache, tmp_path, genuine_bytes, level):
    nl._build()
    folder = _key_dir(tmp_path)
    cache["compiled"].clear(), cache["loaded"].clear()
    planted = genuine_bytes + b"planted"  # with a matching record: others could have written both
    _plant(folder, planted, hashlib.sha256(planted).hexdigest())
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    os.symlink(victim, folder / f"{nl.DIGEST_NAME}.{os.getpid()}.tmp")  # a trap for the record we write
    os.chmod(folder if level == "key" else folder.parent, 0o777)
    handle, why = nl._build()
    assert handle is not None, why
    assert cache["compiled"] and folder / nl.LIB_NAME not in cache["loaded"]
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700 and stat.S_IMODE(os.lstat(folder.parent).st_mode) == 0o700
    assert (folder / nl.LIB_NAME).read_bytes() == genuine_bytes  # rebuilt over the planted file
    assert victim.read_text() == "untouched"


@pytest.mark.parametrize("record", [None, "0" * 64, "not a hash"])
def test_library_without_its_recorded_hash_is_rebuilt(cache, tmp_path, record):
    nl._build()
    folder = _key_dir(tmp_path)
    (folder / nl.DIGEST_NAME).unlink()
    cache["compiled"].clear(), cache["loaded"].clear()
    _plant(folder, b"\x7fELF garbage that must never reach dlopen", record)
    handle, why = nl._build()
    assert handle is not None, why
    assert cache["compiled"] and folder / nl.LIB_NAME not in cache["loaded"]


@pytest.mark.parametrize("level", ["key", "root"])
def test_symlinked_build_folder_is_refused(cache, tmp_path, genuine_bytes, level):
    nl._build()
    folder = _key_dir(tmp_path)
    link = folder if level == "key" else folder.parent
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(link), str(elsewhere))
    os.symlink(elsewhere, link)
    cache["compiled"].clear(), cache["loaded"].clear()
    with pytest.warns(RuntimeWarning, match="symlink"):
        handle, why = nl._build()
    assert handle is None and "not private" in why and "symlink" in why
    assert not cache["loaded"] and not cache["compiled"]


def test_folder_of_another_user_is_refused(cache, tmp_path, monkeypatch):
    nl._build()
    cache["compiled"].clear(), cache["loaded"].clear()
    real = nl._uid()
    monkeypatch.setattr(nl, "_uid", lambda: (real or 0) + 1)
    with pytest.warns(RuntimeWarning, match="owned by uid"):
        handle, why = nl._build()
    assert handle is None and "owned by uid" in why
    assert not cache["loaded"] and not cache["compiled"]


def test_temp_fallback_of_another_user_is_refused(cache, tmp_path, monkeypatch):
    """A read-only cache root falls back to $TMPDIR/kvpress-native-<uid>, which another user may
    have created first."""
    (tmp_path / "cache").write_text("a file, so the cache root cannot be created")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    handle, why = nl._build()  # ours: created private
    assert handle is not None, why
    uid = nl._uid() or 0
    assert stat.S_IMODE(os.lstat(tmp_path / "tmp" / f"kvpress-native-{uid}").st_mode) == 0o700
    monkeypatch.setattr(nl, "_uid", lambda: uid + 1)  # the same folder, seen by another user
    os.rename(tmp_path / "tmp" / f"kvpress-native-{uid}", tmp_path / "tmp" / f"kvpress-native-{uid + 1}")
    cache["loaded"].clear()
    with pytest.warns(RuntimeWarning, match="not private"):
        handle, why = nl._build()
    assert handle is None and not cache["loaded"]


def test_missing_symbol_makes_native_unavailable_and_wrappers_use_torch(cache, monkeypatch):
    monkeypatch.setitem(nl._SIGNATURES, "kvp_not_in_this_build", ([], nl._INT))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = nl._build()
    assert result[0] is None and "kvp_not_in_this_build" in result[1]
    monkeypatch.setattr(nl, "_library", lambda: result)
    assert not nl.available()
    q, k = torch.randn(1, 2, 8), torch.randn(1, 2, 10, 8)
    index = SparseIndex(1, torch.zeros(1, 2, 0, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                        torch.tensor([10], dtype=torch.int32), None, 2, 2)
    out, _ = sparse_decode(q, k, k, index)  # backend="auto": the torch kernels
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="kvp_not_in_this_build"):
        sparse_decode(q, k, k, index, backend="native")
