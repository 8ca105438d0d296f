"""``kvpress demo`` on a tiny random model: shared prefill, progress on stderr, speed as a ratio to full."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvpress.cli import main
from kvpress.demo import DEFAULT_POLICIES, answer_all, demo_policies, format_rows, run_demo
from kvpress.evals.models import byte_tokenizer
from kvpress.evals.tasks import build_input_ids, get_task
from kvpress.generation import timed_generate

SPECS = ["window", "kivi:bits=4:group_size=16", "exact_topk", "full"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), byte_tokenizer()


def _prompt(tokenizer, length=512):
    task = get_task("niah_single", haystack="noise", value_type="numbers", depth=0.5)
    sample = task.generate(tokenizer, length=length, num_samples=1, seed=0)[0]
    return torch.tensor([build_input_ids(tokenizer, sample)])


def test_demo_policies_put_full_first_and_apply_the_budget():
    chosen = demo_policies(SPECS, budget=48)
    assert [spec for spec, _ in chosen] == ["full", "window", "kivi:bits=4:group_size=16", "exact_topk"]
    by_spec = dict(chosen)
    assert by_spec["window"].window_size == 48 and by_spec["exact_topk"].budget == 48
    assert by_spec["kivi:bits=4:group_size=16"].bits == 4  # no budget knob: as the spec says
    assert dict(demo_policies(["exact_topk:budget=40"], budget=48))["exact_topk:budget=40"].budget == 40
    assert [s for s, _ in demo_policies(["window"], 16)] == ["full", "window"]  # the reference is added
    defaults = [spec for spec, _ in demo_policies(None, 256)]
    assert defaults == list(DEFAULT_POLICIES) and defaults[0] == "full"


@pytest.mark.parametrize("kw, message", [
    (dict(policies="nope"), "unknown policy 'nope'"),
    (dict(policies="window:window_size=-3"), "window_size"),
    (dict(policies="window", all_policies=True), "--policies or --all"),
    (dict(budget=0), "budget must be an int >= 1"),
    (dict(policies="exact_topk", budget=8), "exact_topk with budget 8: "),
    (dict(length=10), "length must be an int >= 64"),
])
def test_bad_input_fails_before_the_model_loads(kw, message):
    with pytest.raises(ValueError, match=message):
        run_demo(model="no-such-model", **kw)


def test_cli_says_what_is_wrong(capsys):
    assert main(["demo", "--policies", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_shared_prefill_gives_what_each_policy_gives_alone(tiny, capsys):
    model, tokenizer = tiny
    ids = _prompt(tokenizer)
    chosen = demo_policies(SPECS, budget=48)
    rows = answer_all(model, tokenizer, ids, chosen, max_new_tokens=5, eos_token_id=None, timing_rounds=2)
    err = capsys.readouterr().err
    sharers = [r.spec for r in rows if r.shared_prefill]
    assert sharers == [s for s, p in chosen if p.prefills_densely()] and "window" not in sharers and len(sharers) == 3
    assert f"prefill of {ids.shape[1]} tokens, shared by {', '.join(sharers)}" in err
    for i, row in enumerate(rows, 1):
        assert f"[{i}/4] {row.spec}: answered" in err  # progress per policy, on stderr
        alone = timed_generate(model, ids, row.policy, max_new_tokens=5, eos_token_id=None)
        assert row.tokens == alone.tokens[0].tolist(), row.spec
        assert row.resident_bytes == alone.stats.resident_bytes, row.spec
        assert len(row.step_ms) == 2 and row.decode_ms > 0 and row.cache is None
    separate = answer_all(model, tokenizer, ids, chosen, max_new_tokens=5, eos_token_id=None, share_prefill=False,
                          timing_rounds=0)
    assert not any(r.shared_prefill for r in separate)
    assert [(r.tokens, r.resident_bytes) for r in separate] == [(r.tokens, r.resident_bytes) for r in rows]
    assert all(r.decode_ms != r.decode_ms for r in separate)  # no timing phase: NaN
    assert "speed/full" in format_rows(separate)


def test_run_demo_prints_the_table_with_speed_relative_to_full(tiny, capsys):
    assert run_demo(model="tiny", length=512, budget=48, policies="window,kivi:bits=4:group_size=16", timing_rounds=3,
                    loaded=tiny) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    assert "speed/full" in lines[header] and "KV/full" in lines[header]
    rows = lines[header + 2:header + 5]
    assert [line.split()[0] for line in rows] == ["full", "window", "kivi:bits=4:group_size=16"]
    full = rows[0].split()
    assert full[1] in ("yes", "no") and full[3] == "1.00x" and full[4] == "1.00x"  # KV and speed of full vs itself
    assert all(line.split()[4].endswith("x") for line in rows)
    assert "3 steps of each policy taken in turn" in " ".join(captured.out.split())  # the wrapped footnote
    for i, spec in enumerate(["full", "window", "kivi:bits=4:group_size=16"], 1):
        assert f"[{i}/3] {spec}: " in captured.err
    assert "timing decode" in captured.err and "done" in captured.err
