"""The GPU suite's plumbing (stages as subprocesses, summary, archive, time budget) on CPU."""
import tarfile

import pytest

from kvpress.evals.gpu_suite import STAGES, main, run


def test_smoke_stages_write_summary_log_and_archive(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--stages", "env,quant", "--smoke"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.tar.gz", "suite.log", "summary.txt"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "env       ok" in summary and "quant     ok" in summary
    assert "torch: " in summary and "speedup" in summary  # the env facts and the quant table's header
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        names = tar.getnames()
    assert "results/env.json" in names and "results/quant/bench_quant_kernel.json" in names
    assert "bench_quant" in (tmp_path / "suite.log").read_text()
    assert capsys.readouterr().out.startswith("kvpress gpu_suite")


def test_stages_past_the_budget_are_skipped_and_named(tmp_path):
    results = run(["env", "quant"], tmp_path, smoke=True, budget_s=0)
    assert [(stage, status.split()[0]) for stage, status, _ in results] == [("env", "skipped"), ("quant", "skipped")]
    assert "skipped" in (tmp_path / "summary.txt").read_text()


def test_unknown_stage_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="allowed: " + ", ".join(STAGES)):
        run(["env", "warp"], tmp_path, smoke=True)
