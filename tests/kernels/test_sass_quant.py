"""``benchmarks/gpu/sass_quant.py``: the fused quantized decode compiled for sm_90 as a CUDA launch
would compile it (divisibility hints included), read from its SASS on this machine."""
import os
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
    pytest.skip("Triton's NVIDIA backend ships no cuobjdump here", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))

import sass_quant  # noqa: E402


def test_ptx_codes_leave_no_conversions_and_loads_are_pipelined():
    """The default launch (4-bit, one row: 64-token tiles, 2 warps, 3 stages) has no int -> float
    conversion and its tile loads are asynchronous copies (software-pipelined); the conversion
    form has one I2F per code a thread unpacks (64 tokens x 128 channels x 2 tiles / 64 threads)."""
    fast = sass_quant.main(["--bits", "4", "--batch", "1"])
    assert fast["I2F"] == 0 and fast["LDGSTS"] > 0 and fast["spill_stack"] == 0
    assert 0 < fast["loop"] < fast["instructions"] and "HMMA=" in fast["loop_ops"]  # the tile loop found
    slow = sass_quant.main(["--bits", "4", "--batch", "1", "--no-ptx"])
    assert slow["I2F"] >= 64 * 128 * 2 // 64
