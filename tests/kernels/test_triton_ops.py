"""The Triton kernels as torch ops (``kvpress::triton_*``, `torch.library.triton_op`): each registered
op, called directly under TRITON_INTERPRET=1 on tiny fp32 inputs, gives its torch reference's result.

Tracing them with `torch.compile` needs real Triton kernels: under the interpreter ``@triton.jit``
returns an ``InterpretedFunction``, which `torch.library.wrap_triton` passes through untraced, so
the fake-tensor run of the op calls it on fake tensors and fails ("Cannot access data pointer of
Tensor"). The compiled path is exercised on a GPU only.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from interpret_probe import interpreter_unusable

pytest.importorskip("triton")

HERE = Path(__file__).parent
OPS = ("triton_attend_rows", "triton_merge_states", "triton_quant_decode", "triton_quantize_pack",
       "triton_sparse_decode")


@pytest.fixture(scope="module")
def errors():
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(HERE / "triton_ops_worker.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    if proc.returncode:
        pytest.fail(f"worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("op", OPS)
def test_registered_triton_op_gives_the_reference_result(errors, op):
    assert errors[op] <= 2e-4, errors
