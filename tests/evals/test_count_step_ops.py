"""benchmarks/count_step_ops.py: counts a decode step's torch ops on the CPU (the launches a
host-bound GPU step issues)."""
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


def test_an_interpreted_triton_launch_counts_once():
    """Under TRITON_INTERPRET=1 a launch runs through the interpreter's own torch ops (copies of its
    arguments, hundreds per launch): they are not the step's, so a launch counts once."""
    import os
    import subprocess

    script = Path(count_step_ops.__file__)
    out = subprocess.run([sys.executable, str(script), "shadowkv:budget=48:rank=4:outlier_chunks=2:local_window=16:"
                          "backend=triton", "--model", "random-tiny", "--length", "96", "--cuda-path"],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(8 Triton launches)" in out.stdout  # ShadowKV's rebuild and its attention, 4 layers
    commonest = next(line for line in out.stdout.splitlines() if line.startswith("commonest:"))
    assert "set_" not in commonest and "launch" not in commonest.split(",")[0]


def test_ops_that_wait_for_the_device_are_found():
    """``item``, ``nonzero`` and indexing by a boolean mask make the host wait when their input is
    on a CUDA device (e.g. ``q[:, :, keep]`` with a device mask); views launch nothing."""
    import torch

    x, mask = torch.randn(4, 5), torch.tensor([True, False, True, False, True])
    with count_step_ops.CountOps() as counter:
        x[:, mask]
        x[:, torch.tensor([0, 2])]  # an index tensor of positions: no wait
        x.sum().item()
        x.t()
    assert counter.ops["index[bool]"] == 1 and counter.ops["index"] == 1 and counter.ops["_local_scalar_dense"] == 1
    waits = {op for (_, op), n in counter.site_ops.items() if op in count_step_ops.SYNC_OPS}
    assert waits == {"index[bool]", "_local_scalar_dense"}
    assert "t" in count_step_ops.VIEW_OPS and counter.ops["t"] == 1


def test_zipcache_cuda_path_waits_for_nothing_and_attends_its_window_in_one_launch():
    """zipcache's fused (GPU) decode, counted under the interpreter: no line waits for the device
    (its probe bookkeeping is on the host) and the window goes through `attend_rows`."""
    import os
    import subprocess

    out = subprocess.run([sys.executable, str(Path(count_step_ops.__file__)),
                          "zipcache:group_size=8:value_group_size=8:residual_length=16:flush_size=8",
                          "--model", "random-tiny", "--length", "96", "--cuda-path", "--top", "0"],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "may wait for the device (if its input is there): none" in out.stdout
    assert "triton_rows.py 12" in out.stdout and "triton_quant.py" in out.stdout  # 4 layers: 3 ops per attend_rows


def test_batch_rows_issue_no_more_ops_than_one_row():
    """``--batch``: a step whose op count grew with the rows would loop over them on the host
    (ShadowKV's residual, for one, gives the same count at batch 1 and 8)."""
    one = count_step_ops.main(["snapkv:budget=48:window_size=8", "--model", "random-tiny", "--length", "96"])
    three = count_step_ops.main(["snapkv:budget=48:window_size=8", "--model", "random-tiny", "--length", "96",
                                 "--batch", "3"])
    assert one == three > 0


def test_a_full_window_decode_step_builds_no_index(capsys):
    """Once its sinks and window are full, a `streaming` / `window` decode step writes its slot by
    a host index and reuses one dense index: a few ops per layer beyond `full`'s (not the slot,
    visibility and index tensors rebuilt every step)."""
    layers = 4  # random-tiny
    full = count_step_ops.main(["full", "--model", "random-tiny", "--length", "96"])
    for spec in ["streaming:sink_tokens=4:window_size=28", "window:window_size=32"]:
        ops = count_step_ops.main([spec, "--model", "random-tiny", "--length", "96"])
        assert ops - full <= 20 * layers, (spec, ops, full)
    assert "index.py" not in capsys.readouterr().out


def test_a_snapkv_eviction_step_is_a_few_ops_per_layer():
    """A full `snapkv` row evicts by one argmin and four scatters; its free-slot bookkeeping for
    padded rows is skipped on the host."""
    layers = 4  # random-tiny
    full = count_step_ops.main(["full", "--model", "random-tiny", "--length", "96"])
    ops = count_step_ops.main(["snapkv:budget=48:window_size=8", "--model", "random-tiny", "--length", "96"])
    assert ops - full <= 20 * layers, (ops, full)


def test_merge_states_cpu_script_times_both(capsys):
    import merge_states_cpu
    from kvpress.kernels import native

    if not native.available():
        pytest.skip("native library not built")
    merge_states_cpu.main(["--iters", "3"])
    out = capsys.readouterr().out
    assert "(1, 9, 64)" in out and "(8, 32, 128)" in out


def test_policy_outputs_compares_two_runs(tmp_path, capsys):
    import policy_outputs

    first, second = tmp_path / "a.pt", tmp_path / "b.pt"
    assert policy_outputs.main(["window:window_size=8", str(first), "--budgets", "8,8,8,8"]) == 0
    assert policy_outputs.main(["window:window_size=8", str(second), "--budgets", "8,8,8,8", "--compare", str(first)]) == 0
    assert capsys.readouterr().out.count("tokens equal, max score difference 0") == 4
    assert policy_outputs.main(["full", str(second), "--budgets", "8,8,8,8", "--compare", str(first)]) == 1
