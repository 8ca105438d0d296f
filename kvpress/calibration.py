"""Versioned calibration artifacts (safetensors + metadata) and the ``kvpress calibrate`` registry.

An artifact is a safetensors file whose metadata names the format, its version, the policy, and
the model it was calibrated for (model id, layers, heads, KV heads, head_dim, RoPE layout). On
load the metadata is checked against the model's adapter, so an artifact for another model is
a clear error, never a silent wrong answer.
"""

from __future__ import annotations

import json
import pathlib
from typing import Callable

import torch

FORMAT = "kvpress-artifact"
_ROPE_LAYOUT = "rotate_half"  # the RoPE layout of every supported family (see kvpress.adapters)

# policy name -> (help, configure(argparse subparser), run(args) -> int)
CALIBRATORS: dict[str, tuple[str, Callable, Callable]] = {}


def register_calibrator(name: str, help_text: str, configure: Callable | str, run: Callable | str) -> None:
    """Make ``kvpress calibrate <name>`` available (``configure`` adds arguments, ``run`` does it).

    Either may be given as ``"module:function"``, imported when the command runs (a calibration
    module that imports its policy's module, or one too heavy to import with the policy)."""
    CALIBRATORS[name] = (help_text, _resolved_later(configure), _resolved_later(run))


def _resolved_later(function: Callable | str) -> Callable:
    if callable(function):
        return function
    module, _, attr = function.partition(":")

    def call(*args):
        import importlib

        return getattr(importlib.import_module(module), attr)(*args)

    return call


def portable_model_id(model_id: str) -> str:
    """``model_id`` without this machine's paths: kvpress' converted folder of an embedded model
    (e.g. ``<cache>/smollm2-135m-instruct/tf-<version>-<key>``, see `kvpress.models`) becomes the
    model's hub id; any other id is returned as it is."""
    from kvpress.models import EMBEDDED_MODELS

    parts = str(model_id).replace("\\", "/").rstrip("/").split("/")
    if len(parts) >= 2 and parts[-1].startswith("tf-"):
        for spec in EMBEDDED_MODELS.values():
            if parts[-2] == spec.cache_name:
                return spec.hub_id
    return str(model_id)


def model_metadata(adapter) -> dict[str, str]:
    """The fields an artifact records about its model."""
    return {
        "model_id": portable_model_id(adapter.model_id),
        "family": adapter.family,
        "num_layers": str(adapter.num_layers),
        "num_heads": str(adapter.num_heads),
        "num_kv_heads": str(adapter.num_kv_heads),
        "head_dim": str(adapter.head_dim),
        "rope_layout": _ROPE_LAYOUT,
    }


def save_artifact(path, tensors: dict[str, torch.Tensor], *, policy: str, version: int, adapter, extra: dict | None = None) -> pathlib.Path:
    """Write ``tensors`` with metadata for ``adapter``'s model to ``path`` (safetensors)."""
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "policy": policy, "version": str(version), **model_metadata(adapter)}
    if extra:
        meta["extra"] = json.dumps(extra, sort_keys=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def _remake(policy: str, path) -> str:
    return f"remake it with `kvpress calibrate {policy} --model MODEL --out {path}`"


def load_artifact(path, *, policy: str, version: int, adapter=None, check=("num_layers", "num_kv_heads", "head_dim"),
                  required: tuple[str, ...] = ()):
    """Read an artifact; check its policy, version, that it holds the tensors named in
    ``required`` and (with ``adapter``) the model fields in ``check``.

    Returns
    -------
    (tensors, metadata) : (dict[str, Tensor], dict[str, str])

    Raises
    ------
    FileNotFoundError
        No file at ``path`` (the message tells the ``kvpress calibrate`` command).
    ValueError
        A file that is not a readable safetensors file (empty, truncated, random bytes, another
        format), wrong format/policy/version, a missing required tensor, or a model field that
        does not match ``adapter``; each names the file and the command that remakes it.
    """
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no {policy} artifact at {path}; make one with `kvpress calibrate {policy} --model MODEL --out {path}`"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                         f"{_remake(policy, path)}") from None
    if meta.get("format") != FORMAT or meta.get("policy") != policy:
        raise ValueError(f"{path} is not a kvpress {policy} artifact (format={meta.get('format')}, "
                         f"policy={meta.get('policy')}); {_remake(policy, path)}")
    if meta.get("version") != str(version):
        raise ValueError(f"{path} has {policy} artifact version {meta.get('version')}; this kvpress reads version "
                         f"{version}; {_remake(policy, path)}")
    missing = [name for name in required if name not in tensors]
    if missing:
        raise ValueError(f"{path} holds no {', '.join(repr(m) for m in missing)} tensor (it holds "
                         f"{sorted(tensors)}); {_remake(policy, path)}")
    if adapter is not None:
        expected = model_metadata(adapter)
        wrong = {k: (meta.get(k), expected[k]) for k in check if meta.get(k) != expected[k]}
        if wrong:
            detail = ", ".join(f"{k}: artifact {a} vs model {b}" for k, (a, b) in wrong.items())
            raise ValueError(f"{path} was calibrated for another model ({meta.get('model_id')}): {detail}; "
                             f"calibrate this one with `kvpress calibrate {policy} --model MODEL --out FILE.safetensors` "
                             "and pass artifact=FILE")
    return tensors, meta


# the metadata fields that say an artifact fits a model (the model id may name the same model two ways)
MODEL_SHAPE = ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_layout")


def shipped_artifact_for(policy: str, adapter) -> pathlib.Path | None:
    """The artifact of ``policy`` shipped in ``kvpress.policies/artifacts/`` for ``adapter``'s model,
    or None. Files are named ``<policy>-<model>.safetensors``; the one whose recorded model id is the
    model's (:func:`portable_model_id`) wins, else the one recorded for the same shape
    (:data:`MODEL_SHAPE`: family, layers, heads, KV heads, head_dim)."""
    from safetensors import safe_open

    expected = model_metadata(adapter)
    same_shape = None
    for path in sorted(shipped_artifact("").glob(f"{policy}-*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
        if meta.get("format") != FORMAT or meta.get("policy") != policy:
            continue
        if all(meta.get(k) == expected[k] for k in MODEL_SHAPE):
            if meta.get("model_id") == expected["model_id"]:
                return path
            same_shape = same_shape or path
    return same_shape


def shipped_artifact(name: str) -> pathlib.Path:
    """Path of an artifact shipped inside ``kvpress.policies/artifacts/``."""
    import kvpress.policies

    return pathlib.Path(kvpress.policies.__file__).parent / "artifacts" / name
