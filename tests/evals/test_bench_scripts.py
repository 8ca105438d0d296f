"""The benchmark scripts behind BENCHMARKS.md run end to end on CPU with the tiny random model.

The GPU figures come from these same scripts with a bigger model and
``--device cuda``; these runs keep their code paths (model loading, policy options, correctness
gates, tables, JSON) working on a machine without a GPU.
"""
import argparse
import json
import math
import warnings

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_bench_quant_kernel_cpu_smoke(tmp_path):
    from kvpress.evals.bench_quant import main

    rows = main(["kernel", "--device", "cpu", "--contexts", "1k", "--warmup", "0", "--iters", "1",
                 "--out", str(tmp_path)])
    assert [(r["bits"], r["context"]) for r in rows] == [(4, 1024), (2, 1024)]
    for r in rows:
        assert r["quant_ms"] > 0 and r["dense_ms"] > 0
        assert r["packed_MB"] < r["dense_MB"] / 4  # fp32 dense against <= 4-bit codes + fp16 scales
    assert json.loads((tmp_path / "bench_quant_kernel.json").read_text())[0]["bits"] == 4


def test_bench_prefill_sliding_routes_agree_and_time(tmp_path, capsys):
    from kvpress.evals.bench_prefill import main

    rows = main(["--device", "cpu", "--lengths", "300", "--windows", "64", "--chunks", "32,128", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "32", "--warmup", "0", "--iters", "1",
                 "--json", str(tmp_path / "p.json")])
    assert len(rows) == 1 and rows[0]["max_abs_diff"] < 1e-5  # the SDPA route equals the streaming one
    assert all(rows[0][f"{n}_ms"] > 0 for n in ("streaming", "sdpa_c32", "sdpa_c128"))
    assert "sdpa_c128" in capsys.readouterr().out
    assert json.loads((tmp_path / "p.json").read_text())[0]["window"] == 64


def test_bench_shadowkv_speed_and_memory_on_random_tiny(tmp_path):
    from kvpress.evals.bench_shadowkv import main

    speed_json = tmp_path / "speed.json"
    main(["speed", "--model", "random-tiny", "--length", "512", "--batches", "1", "--new-tokens", "3",
          "--json", str(speed_json)])
    speed = json.loads(speed_json.read_text())
    assert speed["device"] == "cpu" and set(speed["runs"]) == {"full", "shadowkv"}
    (full,), (shadow,) = speed["runs"]["full"], speed["runs"]["shadowkv"]
    assert full["batch"] == shadow["batch"] == 1
    assert shadow["host_bytes"] > 0 and full["host_bytes"] == 0
    assert shadow["fetched_bytes_per_step"] > 0 and 0.0 <= shadow["reuse_rate"] <= 1.0
    for run in (full, shadow):  # every step kept; mean and median over steps 2-3
        assert len(run["step_ms"]) == 3 and min(run["step_ms"]) > 0
        assert abs(run["decode_ms_per_step"] - sum(run["step_ms"][1:]) / 2) < 1e-6
        assert run["decode_ms_median"] == sum(run["step_ms"][1:]) / 2

    mem_json = tmp_path / "memory.json"
    main(["memory", "--model", "random-tiny", "--length", "1024", "--json", str(mem_json)])
    mem = json.loads(mem_json.read_text())
    assert mem["length"] == 1024 and 0 < mem["resident_vs_full"] < 1
    assert mem["host_bytes"] > 0
    assert sum(mem["resident_by_tensor"].values()) <= mem["resident_bytes"]


def test_bench_sparse_decode_with_a_calibrated_random_model(tmp_path, capsys):
    """Double Sparsity calibrated on a random model (for speed runs of random-llama3-8b), then the
    decode benchmark: a budget covering the prompt reproduces full's tokens."""
    from kvpress.evals.bench_sparse_decode import main
    from kvpress.policies._double_sparsity_calib import run_cli

    artifact = tmp_path / "ds-random-tiny.safetensors"
    run_cli(argparse.Namespace(model="random-tiny", out=str(artifact), tokens=1024, seq_len=512,
                               device=None, dtype=None))
    out = tmp_path / "rows.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["--model", "random-tiny", "--length", "600", "--budgets", "96,4096", "--new-tokens", "4",
              "--policies", "full,quest,double_sparsity", "-o", f"double_sparsity.artifact={artifact}",
              "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["device"] == "cpu"
    rows = {(r["policy"], r["budget"]): r for r in data["rows"]}
    assert set(rows) == {("full", None), ("quest", 96), ("quest", 4096), ("double_sparsity", 96),
                         ("double_sparsity", 4096)}
    for name in ("quest", "double_sparsity"):
        assert rows[(name, 4096)]["tokens_agreeing_with_first"] == "4/4"
    for r in data["rows"]:
        assert r["decode_ms_per_token"] > 0 and math.isfinite(r["attention_ms_per_token"])
    assert "double_sparsity" in capsys.readouterr().out


def test_double_sparsity_artifact_of_a_random_model_names_it(tmp_path):
    import kvpress
    from kvpress.evals.models import load_eval_model
    from kvpress.policies._double_sparsity_calib import run_cli

    artifact = tmp_path / "ds.safetensors"
    run_cli(argparse.Namespace(model="random-tiny", out=str(artifact), tokens=600, seq_len=300,
                               device=None, dtype=None))
    model, _ = load_eval_model("random-smollm2")
    policy = kvpress.get_policy("double_sparsity", artifact=str(artifact))
    import torch

    with pytest.raises(ValueError, match="random-tiny"):
        with kvpress.apply(model, policy):
            model(torch.tensor([[1, 2, 3]]))


def test_bench_layer_decode_smoke(capsys):
    from kvpress.evals.bench_layer_decode import main

    assert main(["--contexts", "256", "--policies", "full,window:64,quest:dense_layers=0:tail_chunk=16@96", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[-3:]] == ["full", "window:64", "quest:dense_layers=0:tail_chunk=16@96"]
    assert all(float(line.split()[1]) > 0 for line in lines[-3:])


def test_bench_layer_decode_reads_policy_specs():
    from kvpress.evals.bench_layer_decode import parse_spec

    assert parse_spec("window:64") == parse_spec("window@64")  # the older name:budget form
    policy = parse_spec("double_sparsity:rerank=8:tail_chunk=64@256")
    assert (policy.name, policy.budget, policy.rerank, policy.tail_chunk) == ("double_sparsity", 256, 8, 64)
    with pytest.raises(ValueError, match="rerank"):
        parse_spec("double_sparsity:rerank=0@256")


def test_bench_assisted_prompt_lookup_on_random_tiny(tmp_path, capsys):
    from kvpress.evals.bench_assisted import main

    out = tmp_path / "assisted.jsonl"
    assert main(["--model", "random-tiny", "--length", "400", "--new-tokens", "6", "--lookup", "3",
                 "--policies", "full,window,zipcache", "--budget", "64", "--threads", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["policy_label"] for r in rows] == ["full", "window@64", "zipcache"]
    for r in rows:
        assert r["plain_decode_ms_per_token"] > 0 and r["lookup_decode_ms_per_token"] > 0
        assert 1 <= r["lookup_forwards"] <= 5
    assert rows[0]["same_tokens"] and rows[1]["same_tokens"]  # their verification attends as one-token steps
    assert rows[0]["agree_full"] == 1.0 and rows[0]["full_forward_ms_4"] > 0
    assert "tok/fwd" in capsys.readouterr().out


def test_bench_chunked_prefill_on_random_tiny(tmp_path, capsys):
    from kvpress.evals.bench_chunked_prefill import main

    out = tmp_path / "chunked.jsonl"
    assert main(["--model", "random-tiny", "--length", "400", "--chunks", "0,100", "--new-tokens", "2",
                 "--policies", "full,snapkv", "--budget", "64", "--threads", "1", "--time", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["policy_label"], r["prefill_chunk_size"]) for r in rows] == [
        ("full", None), ("full", 100), ("snapkv@64", None), ("snapkv@64", 100)]
    for r in rows:
        assert r["peak_mib"] > r["kv_mib"] > 0 and r["same_tokens_as_first"] and r["generate_s"] > 0
    # the prompt's MLP activations for 100 tokens instead of ~400: a lower peak for the dense cache
    assert rows[1]["peak_mib"] < rows[0]["peak_mib"]
    assert rows[1]["kv_mib"] == rows[0]["kv_mib"] and rows[3]["kv_mib"] == rows[2]["kv_mib"]
    assert "peak - KV" in capsys.readouterr().out


def test_bench_quant_forward_paths_agree_and_time(tmp_path, capsys):
    from kvpress.evals.bench_quant_forward import main

    rows = main(["--context", "300", "--tokens", "2,20", "--repeats", "1", "--out", str(tmp_path / "q.jsonl"),
                 "--ppl-tokens", "700", "--model", "random-tiny"])
    paths, ppl = rows[:6], rows[6:]
    assert [(r["policy"], r["tokens"]) for r in paths] == [
        (p, t) for p in ("kivi:bits=4", "zipcache", "gear") for t in (2, 20)]  # each after its agreement check
    assert all(r["codes_ms"] > 0 and r["copy_ms"] > 0 for r in paths)
    assert [r["policy"] for r in ppl] == ["kivi:bits=4", "zipcache", "gear"]
    for r in ppl:  # the same attention to rounding: the perplexities agree closely
        assert math.isfinite(r["codes_ppl"]) and abs(r["copy_ppl"] / r["codes_ppl"] - 1) < 1e-3, r
    assert "T=20 codes" in capsys.readouterr().out
    assert len((tmp_path / "q.jsonl").read_text().splitlines()) == 9


def test_bench_turn_times_a_turn_and_checks_it_against_steps(tmp_path, capsys):
    from kvpress.evals.bench_turn import main

    out = tmp_path / "turn.jsonl"
    assert main(["--model", "random-tiny", "--length", "400", "--turn", "40", "--policies",
                 "full,snapkv:reselect_turns=false,window,snapkv", "--budget", "64", "--rounds", "2", "--check",
                 "--threads", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["policy_label"] for r in rows] == ["full", "snapkv:reselect_turns=false@64", "window@64", "snapkv@64"]
    for r in rows:
        assert r["turn_tokens"] == 40 and len(r["turn_s_all"]) == 2 and r["turn_s"] > 0
    for r in rows[:3]:  # these attend a forward after the prompt as that many decode steps would
        assert r["max_abs_logit_diff_vs_steps"] < 1e-4, r
    assert rows[3]["max_abs_logit_diff_vs_steps"] > 1e-3  # a new turn, attended over all it kept
    assert rows[0]["turn_vs_full"] == 1.0
    assert "max |dlogit| vs steps" in capsys.readouterr().out
    with pytest.raises(ValueError, match="turn=1 must be >= 2"):
        main(["--model", "random-tiny", "--turn", "1"])


def test_two_turns_places_needles_in_each_turn_and_scores(tmp_path, capsys):
    from kvpress.evals.two_turns import main

    out = tmp_path / "turns.jsonl"
    assert main(["--model", "random-tiny", "--length", "600", "--turn", "200", "--samples", "2", "--policies",
                 "full,shadowkv", "--budget", "64", "--threads", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["needle"], r["policy_label"]) for r in rows] == [
        (part, label) for part in ("prompt", "turn") for _ in range(2) for label in ("full", "shadowkv@64")]
    for r in rows:  # the needle in the part named, the score from the tasks' scorer
        first = r["tokens"] - r["turn_tokens"]
        assert (r["needle_token"] < first) == (r["needle"] == "prompt") and r["score"] in (0.0, 1.0)
        assert r["resident_bytes"] > 0 and (r["max_attended"] is None) == (r["policy_label"] == "full")
    assert "max attended" in capsys.readouterr().out
    with pytest.raises(ValueError, match="allowed placements are"):
        main(["--model", "random-tiny", "--needle", "middle"])
