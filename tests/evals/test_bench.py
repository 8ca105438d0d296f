"""``kvpress bench``: separate and interleaved runs, attention timing, speedups, bad input."""
import json
import math

import pytest
import torch

import kvpress
from kvpress.evals.bench import interleaved_decode, run_bench
from kvpress.evals.models import random_model
from kvpress.generation import timed_generate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tiny():
    return random_model("random-tiny")


def _rows(out):
    return [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("interleave", [False, True])
def test_bench_rows_time_attention_and_compare_with_full(tiny, tmp_path, interleave):
    run_bench("random-tiny", policies=("quest", "window", "full"), budget=64, lengths=(300,), new_tokens=5,
              out=tmp_path, interleave=interleave, loaded=tiny)
    rows = {r["policy_label"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"full", "quest@64", "window@64"}
    full = rows["full"]
    assert full["speedup_vs_full"] == 1.0 and full["agree"] == 1.0 and full["interleaved"] is interleave
    for r in rows.values():
        assert r["decode_ms_per_token"] > 0
        # attention is part of the step: positive, and below the whole step's time
        assert 0 < r["attention_ms_per_token"] < r["decode_ms_per_token"]
        assert math.isclose(r["speedup_vs_full"], full["decode_ms_per_token"] / r["decode_ms_per_token"])
        assert (r["cpu_ms_per_token"] > 0) if interleave else math.isnan(r["cpu_ms_per_token"])
    assert rows["window@64"]["resident_mib"] < full["resident_mib"]  # 64 of 300 tokens kept
    assert "speedup_vs_full" in (tmp_path / "bench.csv").read_text().splitlines()[0]


def test_interleaved_decode_matches_each_policy_decoding_alone(tiny):
    model, _ = tiny
    ids = torch.randint(3, 500, (1, 200), generator=torch.Generator().manual_seed(0))
    policies = {"full": kvpress.get_policy("full"), "quest": kvpress.get_policy("quest", budget=512),
                "window": kvpress.get_policy("window", window_size=48)}
    runs = interleaved_decode(model, ids, policies, steps=4)
    assert [runs[n]["shared_prefill"] for n in policies] == [True, True, False]
    alone = {n: timed_generate(model, ids, p, max_new_tokens=5, eos_token_id=[]).tokens[0].tolist()
             for n, p in policies.items()}
    for name in policies:  # the prefill's token plus one per step, as each policy decodes alone
        assert runs[name]["tokens"] == alone[name]
    assert runs["quest"]["tokens"] == runs["full"]["tokens"]  # a budget covering the prompt is exact
    assert runs["window"]["stats"].resident_bytes < runs["full"]["stats"].resident_bytes


def test_timed_generate_hands_over_the_cache_after_the_prefill(tiny):
    model, _ = tiny
    seen = []
    res = timed_generate(model, torch.tensor([[5, 6, 7, 8]]), kvpress.get_policy("full"), max_new_tokens=3,
                         eos_token_id=[], keep_cache=True,
                         on_prefill=lambda cache: seen.append(cache.get_seq_length()))
    assert seen == [4]  # called once, with the prompt in the cache and no decode step yet
    assert res.cache.get_seq_length() == 6


def test_bench_reports_a_policy_it_cannot_run_and_checks_its_arguments(tiny, tmp_path, capsys):
    run_bench("random-tiny", policies=("full", "double_sparsity"), budget=64, lengths=(200,), new_tokens=4,
              out=tmp_path, interleave=True, loaded=tiny)
    out = capsys.readouterr().out
    assert "double_sparsity@64" in out and "skipped: double_sparsity ships channel artifacts for SmolLM2 and Gemma 3 270M only" in out
    assert [r["policy_label"] for r in _rows(tmp_path)] == ["full"]
    with pytest.raises(ValueError, match="new_tokens must be >= 4"):
        run_bench("random-tiny", policies=("full",), lengths=(64,), new_tokens=3, interleave=True, loaded=tiny)
    with pytest.raises(ValueError, match="lengths must be positive"):
        run_bench("random-tiny", policies=("full",), lengths=(0,), loaded=tiny)


def test_random_gemma3_270m_is_a_hybrid_model_the_policies_run_on_three_layers():
    """The Gemma-3-270M shape (built on the meta device: no weights) slides 15 of 18 layers over
    512 tokens; kvpress gives the policy layers 5, 11 and 17, at head_dim 256 with one KV head."""
    from transformers import AutoModelForCausalLM

    from kvpress.evals.models import check_model_name, random_config

    check_model_name("random-gemma3-270m")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(random_config("random-gemma3-270m"))
    adapter = kvpress.get_adapter(model)
    assert adapter.policy_layers == (5, 11, 17)
    assert {adapter.sliding_window(i) for i in range(18)} == {512, None}
    assert (adapter.num_heads, adapter.num_kv_heads, adapter.head_dim) == (4, 1, 256)
