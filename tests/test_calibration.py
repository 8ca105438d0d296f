"""Corrupt calibration artifacts are one clear ValueError naming the file and the fix."""
from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch

import kvpress
from kvpress.calibration import load_artifact, save_artifact

from conftest import tiny_model


@pytest.fixture(scope="module")
def adapter():
    return kvpress.get_adapter(tiny_model("llama"))


@pytest.fixture
def good(tmp_path, adapter):
    return save_artifact(tmp_path / "good.safetensors", {"layers": torch.tensor([0, 1])}, policy="tidal",
                         version=1, adapter=adapter)


def _corrupt(kind: str, good_bytes: bytes) -> bytes:
    if kind == "empty":
        return b""
    if kind == "truncated":
        return good_bytes[: len(good_bytes) - 5]
    if kind == "truncated_header":
        return good_bytes[:20]
    if kind == "random":
        return os.urandom(4096)
    if kind == "bad_header":
        header = b'{"x": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}'
        return struct.pack("<Q", len(header)) + header + b"\0" * 8
    if kind == "not_json":
        return struct.pack("<Q", 10) + b"not json!!" + b"\0" * 8
    if kind == "pickle":
        return pickle.dumps({"layers": [0, 1]})
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["empty", "truncated", "truncated_header", "random", "bad_header", "not_json",
                                  "pickle"])
def test_corrupt_file_is_a_value_error_naming_file_and_command(tmp_path, good, kind):
    path = tmp_path / f"{kind}.safetensors"
    path.write_bytes(_corrupt(kind, good.read_bytes()))
    with pytest.raises(ValueError) as err:
        load_artifact(path, policy="tidal", version=1)
    message = str(err.value)
    assert str(path) in message and "kvpress calibrate tidal" in message


def test_missing_required_tensor_is_a_value_error(tmp_path, adapter):
    path = save_artifact(tmp_path / "t.safetensors", {"other": torch.zeros(2)}, policy="tidal", version=1,
                         adapter=adapter)
    with pytest.raises(ValueError, match=r"holds no 'layers' tensor.*kvpress calibrate tidal"):
        load_artifact(path, policy="tidal", version=1, required=("layers",))
    tensors, _ = load_artifact(path, policy="tidal", version=1)  # nothing required: read as it is
    assert set(tensors) == {"other"}


def test_wrong_policy_or_version_names_the_command(tmp_path, good):
    with pytest.raises(ValueError, match=r"not a kvpress duo artifact.*kvpress calibrate duo"):
        load_artifact(good, policy="duo", version=1)
    with pytest.raises(ValueError, match=r"version 1; this kvpress reads version 2.*kvpress calibrate tidal"):
        load_artifact(good, policy="tidal", version=2)


def test_corrupt_duo_artifact_through_the_policy(tmp_path, adapter):
    path = tmp_path / "duo.safetensors"
    path.write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match=r"duo\.safetensors is not a readable safetensors file"):
        kvpress.get_policy("duo", artifact=str(path)).check_model(adapter)
