"""Whether this Triton's CPU interpreter can run our kernels at all (imported by the tests).

Triton 3.6's interpreter turns a loop bound that is a run-time value (``range(start, n, BLOCK)``,
as every kvpress kernel has) into a Python int with ``int(array)``, which NumPy >= 2.4 refuses for
a one-element 1-d array ("only 0-dimensional arrays can be converted to Python scalars"); Triton
3.9 squeezes the array first. Compiled kernels on a GPU are not affected (tests/kernels/
test_triton_compile.py compiles them with the installed Triton), so the interpreter tests skip
with this reason instead of failing on such an install. (2026-11-22: with Triton 3.6 and NumPy
2.3.5 every interpreter test of tests/kernels passes, and the compile test passes with 3.6 and 3.9.)
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def _count(OUT, n, BLOCK: tl.constexpr):
    acc = 0
    for i in range(0, n, BLOCK):
        acc += 1
    tl.store(OUT, acc)

out = torch.zeros(1, dtype=torch.int32)
_count[(1,)](out, 10, BLOCK=4)
assert out.item() == 3, out
"""


@functools.lru_cache(maxsize=None)
def interpreter_unusable() -> str | None:
    """None when a loop with a run-time bound runs under TRITON_INTERPRET=1, else the reason."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode == 0:
        return None
    import numpy
    import triton

    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return (f"Triton {triton.__version__}'s interpreter cannot run a loop with a run-time bound here "
            f"(NumPy {numpy.__version__}): {last[:200]}")


def run_interpreter_worker(script: str, cases: list) -> list:
    """Run the test module ``script`` as a child process with TRITON_INTERPRET=1 (so the flag never
    leaks into the test session), ``cases`` as JSON on its stdin; its last output line, JSON, is
    returned. Skips where Triton or its interpreter is unusable; a failed child fails the test."""
    import json

    import pytest

    pytest.importorskip("triton")
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, script], input=json.dumps(cases), capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode:
        pytest.fail(f"interpreter worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
