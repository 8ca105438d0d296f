"""Where ``duo``'s gates come from: the ``gates`` override, a kvpress artifact (``kvpress calibrate
duo``), an upstream ``full_attention_heads.tsv`` (or the directory holding it), or the artifact
shipped for the model; checked as a field (`check_gates`) and against the model (`load_gates`)."""

from __future__ import annotations

import math
import pathlib

import torch

from kvpress.calibration import load_artifact, shipped_artifact, shipped_artifact_for
from kvpress.policies._duo_calibrate import ARTIFACT_VERSION

SHIPPED = "duo-smollm2.safetensors"
UPSTREAM_FILE = "full_attention_heads.tsv"
_CHECK = ("num_layers", "num_heads", "num_kv_heads", "head_dim")


def check_gates(gates, artifact) -> None:
    """ValueError unless the field ``gates`` (None, or an override [layers][KV heads] of finite
    numbers) is well formed and not given with ``artifact``."""
    if gates is None:
        return
    if not gates or not all(isinstance(r, (tuple, list)) and len(r) == len(gates[0]) > 0 for r in gates):
        raise ValueError("gates must be a non-empty rectangular tuple of tuples [layers][KV heads]")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for r in gates for x in r):
        raise ValueError("gates must hold numbers")
    if not all(math.isfinite(x) for r in gates for x in r):
        raise ValueError("gates must hold finite numbers (no NaN or inf)")
    if artifact is not None:
        raise ValueError("give either gates or artifact, not both")


def load_gates(policy, adapter) -> torch.Tensor:
    """Gate per (layer, KV head) of a ``duo`` policy for ``adapter``'s model, fp32 [num_layers,
    num_kv_heads]; higher = retrieval.

    Raises
    ------
    FileNotFoundError
        No artifact (the message names ``kvpress calibrate duo``).
    ValueError
        The gates were made for another layer / head count (or another model), or hold NaN / inf.
    """
    if policy.gates is not None:
        gates = torch.tensor(policy.gates, dtype=torch.float32)
        source = "gates override"
    elif policy.artifact is None and policy.random_heads_seed is not None and policy.sparsity is not None:
        # a random split of a given size needs no calibration (any model, e.g. speed runs on
        # random weights); the split is the one the shipped gates' shape would give
        return torch.zeros(adapter.num_layers, adapter.num_kv_heads)
    else:
        path = (pathlib.Path(policy.artifact) if policy.artifact is not None
                else shipped_artifact_for(policy.name, adapter) or shipped_artifact(SHIPPED))
        if path.is_dir():
            path = path / UPSTREAM_FILE
        source = str(path)
        if path.suffix == ".tsv":
            gates = read_upstream_pattern(path)
        else:
            tensors, _ = load_artifact(path, policy=policy.name, version=ARTIFACT_VERSION, adapter=adapter,
                                       check=_CHECK, required=("gates",))
            gates = tensors["gates"].to(torch.float32)
    if not bool(torch.isfinite(gates).all()):
        raise ValueError(f"duo gates from {source} hold NaN or inf; every gate must be a finite number "
                         "(remake the pattern with `kvpress calibrate duo`)")
    expected = (adapter.num_layers, adapter.num_kv_heads)
    if tuple(gates.shape) != expected:
        raise ValueError(
            f"duo gates from {source} have shape {tuple(gates.shape)} [layers, KV heads]; this model needs "
            f"{expected}: the pattern was made for another model"
        )
    return gates


def read_upstream_pattern(path) -> torch.Tensor:
    """Read DuoAttention's published ``full_attention_heads.tsv``: one row per layer, one column
    per KV head, tab-separated gate values (~[0, 1], higher = full attention). fp32 [L, H]."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no duo pattern at {path}; make one with `kvpress calibrate duo --model MODEL --out FILE.safetensors`"
        )
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    if not rows or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"{path} is not a rectangular layers x KV heads table")
    try:
        return torch.tensor([[float(x) for x in r] for r in rows], dtype=torch.float32)
    except ValueError as exc:
        raise ValueError(f"{path} holds a non-numeric gate: {exc}") from None
