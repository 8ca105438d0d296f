"""Triton `sparse_decode` under TRITON_INTERPRET=1 (fp32) against the reference.

All cases run in ONE child process (see interpret_worker.py): the interpreter flag must be set
before triton is imported and must not leak into the rest of the test session.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpress_kernel_cases import case, case_id
from interpret_probe import interpreter_unusable  # noqa: E402

pytest.importorskip("triton")

HERE = Path(__file__).parent
TOL = 2e-4

CASES = (
    # odd lengths 1 / 13 / 67 / 1000 (capacity > length for some)
    [case(T_cap=1, block_size=1, budget=1), case(T_cap=13, block_size=8, budget=2, sinks=2),
     case(T_cap=80, lens=[67], block_size=16, budget=3, tail=5),
     case(T_cap=1000, block_size=64, mode="topk", budget=3, sinks=4, tail=16, num_splits=3)]
    # every block size, random blocks overlapping sinks / tail / padding
    + [case(B=2, T_cap=150, lens=[150, 97], starts=[0, 11], block_size=bs, budget=budget, sinks=5, tail=9,
            seed=bs, num_splits=2) for bs, budget in ((1, 40), (8, 6), (16, 4), (32, 3), (64, 2))]
    # GQA ratios and head dims
    + [case(H_kv=h, G=g, D=d, T_cap=67, block_size=8, mode="topk", budget=3, sinks=1, tail=3, seed=g)
       for h, g, d in ((2, 1, 64), (1, 3, 128), (2, 4, 64), (1, 8, 128), (2, 12, 64), (1, 16, 128))]
    # empty selections: no blocks at all, cnt = 0, an empty row, sinks/tail only
    + [case(mode="none"), case(mode="cnt0", budget=3),
       case(B=2, T_cap=20, lens=[20, 0], block_size=8, budget=2, sinks=2),
       case(T_cap=67, mode="none", sinks=3, tail=7, num_splits=2)]
    # full selections == dense SDPA (single and split-K), with bs 1 and 64
    + [case(T_cap=67, mode="all", block_size=64, sdpa=True), case(H_kv=1, G=4, D=128, T_cap=130, mode="all",
                                                                 block_size=16, sdpa=True, num_splits=3),
       case(T_cap=13, mode="all", block_size=1, sdpa=True, sinks=3, tail=4)]
    # left padding + sinks/tail overlapping a full selection
    + [case(B=2, T_cap=70, lens=[70, 50], starts=[0, 9], mode="all", block_size=32, sinks=4, tail=6)]
    # fp16 input (the launcher upcasts to fp32 under the interpreter)
    + [case(T_cap=67, block_size=16, mode="topk", budget=2, dtype="fp16", sinks=2, tail=2)]
)


@pytest.fixture(scope="module")
def results():
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(HERE / "interpret_worker.py")], input=json.dumps(CASES),
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        pytest.fail(f"interpreter worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_triton_matches_reference(results, i):
    r, c = results[i], CASES[i]
    tol = 2e-3 if c["dtype"] == "fp16" else TOL
    assert r["dtype_ok"]
    assert r["inf_match"], "empty (row, head) pairs must give lse = -inf exactly where the reference does"
    assert r["empty_out_zero"]
    assert r["out_err"] <= tol, r
    assert r["lse_err"] <= TOL, r
    if c["sdpa"]:
        assert r["sdpa_err"] <= TOL, r
    if c["mode"] in ("none", "cnt0") and not (c["sinks"] or c["tail"]):
        assert r["n_empty"] == c["B"] * c["H_kv"] * c["G"]
