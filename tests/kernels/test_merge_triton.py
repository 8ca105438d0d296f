"""`merge_states`' Triton launch against its torch path: under the interpreter (one child process:
this file run as a script with TRITON_INTERPRET=1), compiled for sm_90 (test_triton_compile.py)
and on CUDA; the backend argument's errors."""
import json
import os
import sys

import pytest
import torch

from kvpress.kernels import merge_states
from kvpress.kernels.merge import torch_merge_states
from interpret_probe import run_interpreter_worker  # noqa: E402


def make_case(shape=(2, 9), D=64, seed=0, dtype_a=torch.float32, dtype_b=torch.float32, device="cpu"):
    """Two partial states with every emptiness pattern: a empty, b empty, both, neither; the empty
    parts' outputs are NaN (never to leak)."""
    gen = torch.Generator().manual_seed(seed)
    out_a, out_b = torch.randn(*shape, D, generator=gen), torch.randn(*shape, D, generator=gen)
    lse_a, lse_b = torch.randn(*shape, generator=gen) * 3, torch.randn(*shape, generator=gen) * 3
    pattern = torch.randint(0, 4, shape, generator=gen)
    lse_a[pattern == 1] = float("-inf")
    lse_b[pattern == 2] = float("-inf")
    lse_a[pattern == 3] = lse_b[pattern == 3] = float("-inf")
    out_a[torch.isneginf(lse_a)] = float("nan")
    out_b[torch.isneginf(lse_b)] = float("nan")
    return (out_a.to(device, dtype_a), lse_a.to(device), out_b.to(device, dtype_b), lse_b.to(device))


def test_backend_errors_are_clear():
    args = make_case()
    with pytest.raises(ValueError, match="backend must be one of"):
        merge_states(*args, backend="cuda")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.importorskip("triton")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            merge_states(*args, backend="triton")


def test_auto_on_cpu_is_the_torch_path():
    args = make_case(seed=1)
    out, lse = merge_states(*args)
    ref_out, ref_lse = torch_merge_states(*args)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


# odd head_dims (masked columns), rows not a multiple of the block, 1-d and 3-d leading shapes
INTERPRET_CASES = [dict(), dict(shape=(3,), D=80, seed=1), dict(shape=(2, 4, 5), D=128, seed=2),
                   dict(shape=(1, 17), D=16, seed=3)]


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreter_worker(__file__, INTERPRET_CASES)


@pytest.mark.parametrize("i", range(len(INTERPRET_CASES)))
def test_triton_interpreter_matches_torch_path(interpreted, i):
    r = interpreted[i]
    assert r["shapes_ok"] and r["no_nan"] and r["minus_inf_ok"], r
    assert r["out_err"] <= 1e-6 and r["lse_err"] <= 1e-6, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float32)])
def test_triton_gpu_matches_torch_path(dtypes):
    args = make_case(shape=(4, 32), D=128, seed=4, dtype_a=dtypes[0], dtype_b=dtypes[1], device="cuda")
    out, lse = merge_states(*args)  # auto: triton on CUDA
    ref_out, ref_lse = torch_merge_states(*args)
    assert out.dtype == ref_out.dtype == dtypes[0] and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def _worker():  # pragma: no cover - runs in the child process
    from kvpress.kernels.triton_merge import triton_merge_states

    results = []
    for c in json.load(sys.stdin):
        args = make_case(**c)
        out, lse = triton_merge_states(*args)
        ref_out, ref_lse = torch_merge_states(*args)
        both_empty = torch.isneginf(ref_lse)
        results.append({
            "shapes_ok": out.shape == ref_out.shape and lse.shape == ref_lse.shape and out.dtype == ref_out.dtype,
            "no_nan": not bool(out.isnan().any() or lse.isnan().any()),
            "minus_inf_ok": bool(torch.isneginf(lse[both_empty]).all() and (out[both_empty] == 0).all()),
            "out_err": (out - ref_out).abs().max().item(),
            "lse_err": (lse[~both_empty] - ref_lse[~both_empty]).abs().max().item(),
        })
    print(json.dumps(results))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    _worker()
