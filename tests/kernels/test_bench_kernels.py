"""The kernel benchmark script runs end to end on CPU and writes its JSON / CSV."""
import json

from kvpress.evals.bench_kernels import main


def test_bench_kernels_cpu_smoke(tmp_path):
    rows = main(["--device", "cpu", "--contexts", "1k", "--budgets", "256", "--warmup", "0", "--iters", "1",
                 "--out", str(tmp_path)])
    assert [r["budget"] for r in rows] == ["256", "all"]
    assert all(r["sparse_ms"] > 0 and r["dense_ms"] > 0 for r in rows)
    data = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert len(data["rows"]) == 2 and data["meta"]["correctness_max_abs_err"] < 1e-4
    assert (tmp_path / "bench_kernels.csv").read_text().startswith("device,backend,dtype")
