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


def test_rotation_copies_cover_l2_and_alternate():
    """GPU timings rotate over copies of inputs that would fit in L2 (the 4-bit cache at 32k,
    42 MB, would be timed from an H100's 50 MB L2 at batch 1); large working sets are not copied."""
    from kvpress.evals.bench_kernels import L2_BYTES, copies_beyond_l2, rotating

    assert copies_beyond_l2(42e6) == 4 and copies_beyond_l2(134e6) == 2 and copies_beyond_l2(336e6) == 1
    assert copies_beyond_l2(1.0, most=3) == 3 and copies_beyond_l2(3 * L2_BYTES) == 1
    seen = []
    call = rotating([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
