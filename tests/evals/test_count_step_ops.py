"""benchmarks/count_step_ops.py: counts a decode step's torch ops on the CPU (the launches a
host-bound GPU step issues; BENCHMARKS "Session 34")."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import count_step_ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_counts_ops_per_step_and_a_sparse_policy_issues_more_than_full(capsys):
    full = count_step_ops.main(["full", "--model", "random-tiny", "--length", "96"])
    sparse = count_step_ops.main(["shadowkv:budget=48:rank=4:outlier_chunks=2:local_window=16",
                                  "--model", "random-tiny", "--length", "96"])
    out = capsys.readouterr().out
    assert 0 < full < sparse
    assert "ops in one decode step of" in out and "by file:" in out and "_shadowkv" in out
