"""The fused quantized decode's launch configuration (``triton_quant.launch_config``): the rule
the H200 sweeps chose, whole key groups per tile, and the sweep's override."""
import pytest

pytest.importorskip("triton")

from kvpress.kernels import triton_quant as tq  # noqa: E402


@pytest.mark.parametrize("pairs,group,bits,expected", [
    (8, 32, 4, (64, 2, 16)),     # one row of 8 KV heads: 64-token tiles, a warp per 32 tokens
    (64, 32, 4, (32, 1, 16)),    # 8 rows: 32-token tiles, one warp
    (64, 32, 2, (32, 1, 16)),
    (8, 32, 2, (64, 2, 16)),     # FEW_PAIRS is inclusive
    (16, 32, 2, (32, 1, 16)),    # 2 rows
    (64, 128, 4, (128, 4, 16)),  # a tile holds a whole 128-token key group, and warps follow the tile
    (8, 32, 8, (64, 4, 16)),     # 8-bit: a warp per 16 tokens
])
def test_launch_config(pairs, group, bits, expected):
    assert tq.launch_config(pairs, group, bits) == expected


def test_launch_override(monkeypatch):
    monkeypatch.setattr(tq, "OVERRIDE", (32, 4, 8))
    assert tq.launch_config(8, 32, 4) == (32, 4, 8)
    assert tq.launch_config(8, 64, 4) == (64, 4, 8)  # still whole key groups
