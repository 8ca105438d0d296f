"""kvpress eval: grid validation, resumable JSONL, CSVs, plots, shared prefill (tiny random model)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import kvpress
from kvpress.evals import results as res
from kvpress.evals.decode import generate_sample, shared_prefill
from kvpress.evals.models import byte_tokenizer
from kvpress.evals.plots import PLOT_FILES
from kvpress.evals.runner import EvalGrid, expand_policies, run_eval
from conftest import random_ids, tiny_model

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), byte_tokenizer()


def _grid(**kw):
    base = dict(model="random-smollm2", policies=("full", "window"), budgets=(32,), tasks=("niah_single",),
                lengths=(512,), samples=2, max_new_tokens=3)
    return EvalGrid(**{**base, **kw})


# --------------------------------------------------------------------------- bad input, no model


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tasks=("nope",)), "unknown task 'nope'"),
        (dict(tasks=("vt:colour=red",)), "unknown option"),
        (dict(policies=("nope",)), "unknown policy 'nope'"),
        (dict(options={"window.nope": "1"}), "has no field"),
        (dict(options={"window.window_size": "-3"}), "out of range"),
        (dict(options={"nothere.x": "1"}), "policy of the grid"),
        (dict(model="no-such-model"), "unknown model"),
        (dict(budgets=(0,)), "positive ints"),
        (dict(samples=0), "samples"),
        (dict(lengths=()), "at least one"),
        (dict(samples=2, sample_ids=(2,)), r"sample_ids must be ints in 0 \.\. samples - 1 = 1, got 2"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size must be an int >= 1"),
    ],
)
def test_bad_grid_is_a_value_error(kw, message):
    with pytest.raises(ValueError, match=message):
        _grid(**kw)


def test_cli_rejects_bad_input_before_loading(monkeypatch, capsys):
    from kvpress.cli import main

    def boom(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("kvpress.evals.runner.load_eval_model", boom)
    for argv, message in [
        (["eval", "--policies", "full,nope"], "unknown policy"),
        (["eval", "--policies", "duo:sink_tokens=8,window_size=64"], "separated by ':'"),
        (["eval", "--tasks", "niah_single,nope"], "unknown task"),
        (["eval", "--model", "no-such-model"], "unknown model"),
        (["eval", "--policies", "window", "-o", "window.size=3"], "has no field"),
        (["eval", "--budgets", "12x"], "comma-separated list of int"),
    ]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_budgets_map_through_with_budget_and_budgetless_policies_run_once():
    names = kvpress.list_policies()
    variants = expand_policies(names, budgets=(64, 128))
    for name in names:
        base = kvpress.get_policy(name)
        try:
            configs = {json.dumps(base.with_budget(b).to_dict(), sort_keys=True) for b in (64, 128)}
        except ValueError:
            configs = {json.dumps(base.to_dict(), sort_keys=True)}
        mine = [v for v in variants if v.policy.name == name]
        assert len(mine) == len(configs), name
    full = [v for v in variants if v.policy.name == "full"]
    assert [v.label for v in full] == ["full"] and full[0].budget is None
    assert [v.label for v in variants if v.policy.name == "window"] == ["window@64", "window@128"]


def test_policy_specs_put_variants_of_one_policy_in_one_grid():
    variants = expand_policies(["streaming", "streaming:sink_tokens=2"], budgets=(128,),
                               options={"streaming.rerotate": "true"})
    assert [v.label for v in variants] == ["streaming@128", "streaming:sink_tokens=2@128"]
    assert [v.spec for v in variants] == ["streaming", "streaming:sink_tokens=2"]
    plain, two = (v.policy for v in variants)
    assert plain.rerotate and two.rerotate and two.sink_tokens == 2 and plain.sink_tokens != 2
    assert plain.sink_tokens + plain.window_size == two.sink_tokens + two.window_size == 128
    assert expand_policies(["window:window_size=64"])[0].policy.window_size == 64
    for bad, message in [("window:size", "field=value"), ("window:nope=1", "has no field"), ("nope:x=1", "unknown policy")]:
        with pytest.raises(ValueError, match=message):
            expand_policies([bad])


def test_a_spec_equal_to_another_names_config_runs_once_and_says_so(capsys):
    """`kivi` is 2-bit by default: `kivi:bits=2` beside it is one configuration, run once; the
    user is told which label it runs under instead of finding a row missing."""
    variants = expand_policies(["kivi", "kivi:bits=2", "kivi:bits=4"], budgets=(64, 128))
    assert [v.label for v in variants] == ["kivi", "kivi:bits=4"]
    err = capsys.readouterr().err
    assert err.count("is the same configuration") == 1 and "'kivi:bits=2'" in err and "as 'kivi'" in err


# --------------------------------------------------------------------------- the grid on a tiny model


def test_grid_resumes_and_writes_jsonl_csv_and_plots(tiny, tmp_path, capsys):
    model, tok = tiny
    grid = _grid()
    first = run_eval(grid, tmp_path, model=model, tokenizer=tok, max_cells=3, progress=False)
    assert len(first) == 3
    assert "1 cell(s) pending" in capsys.readouterr().out
    lines_before = (tmp_path / res.RESULTS_FILE).read_text().splitlines()

    records = run_eval(grid, tmp_path, model=model, tokenizer=tok, progress=False)
    table = capsys.readouterr().out
    lines_after = (tmp_path / res.RESULTS_FILE).read_text().splitlines()
    assert lines_after[:3] == lines_before, "finished cells are kept as written"
    assert len(records) == len(lines_after) == 4  # 2 policy configs x 1 task x 1 length x 2 samples
    assert len({r["key"] for r in records}) == 4
    assert {(r["policy_label"], r["sample"]) for r in records} == {
        ("full", 0), ("full", 1), ("window@32", 0), ("window@32", 1)}
    for r in records:
        assert r["grid"]["policies"] == ["full", "window"] and r["policy"]["policy"] == r["policy_name"]
        assert r["versions"]["torch"] == torch.__version__ and "git_sha" in r
        assert 0.0 <= r["score"] <= 1.0 and r["answers"] and 1 <= r["new_tokens"] <= 3
        assert r["resident_bytes"] > 0 and r["prefill_s"] > 0 and 490 <= r["num_tokens"] <= 512
    window = [r for r in records if r["policy_name"] == "window"]
    full = [r for r in records if r["policy_name"] == "full"]
    assert max(r["resident_bytes"] for r in window) < min(r["resident_bytes"] for r in full)

    # A third run has nothing left to do and appends nothing.
    run_eval(grid, tmp_path, model=model, tokenizer=tok, progress=False, plots=False)
    assert (tmp_path / res.RESULTS_FILE).read_text().splitlines() == lines_after

    with open(tmp_path / res.CELLS_CSV) as f:
        cells = list(csv.DictReader(f))
    assert len(cells) == 4 and set(res.CELL_COLUMNS) <= set(cells[0])
    with open(tmp_path / res.SUMMARY_CSV) as f:
        summary = list(csv.DictReader(f))
    assert {(s["policy_label"], s["n"]) for s in summary} == {("full", "2"), ("window@32", "2")}
    mean_full = sum(r["score"] for r in full) / 2
    assert float(next(s for s in summary if s["policy_label"] == "full")["score"]) == pytest.approx(mean_full)
    for header in ("score", "KV MiB", "decode ms/tok", "prefill s"):
        assert header in table
    for name in PLOT_FILES:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_reuse_copies_matching_cells_from_earlier_runs(tiny, tmp_path, capsys):
    """--reuse: a cell finished in another folder with the same key is copied (marked), not computed;
    cells whose policy fields differ are computed."""
    model, tok = tiny
    earlier = run_eval(_grid(), tmp_path / "a", model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    grid = _grid(policies=("full", "streaming"))
    records = run_eval(grid, tmp_path / "b", model=model, tokenizer=tok, progress=False, plots=False,
                       reuse=(tmp_path / "a",))
    assert "reused 2 finished cell(s)" in capsys.readouterr().out
    by_key = {r["key"]: r for r in earlier}
    full = [r for r in records if r["policy_name"] == "full"]
    assert len(full) == 2 and all(r["reused_from"] == str(tmp_path / "a") for r in full)
    assert all({k: v for k, v in r.items() if k != "reused_from"} == by_key[r["key"]] for r in full)
    streaming = [r for r in records if r["policy_name"] == "streaming"]
    assert len(streaming) == 2 and not any("reused_from" in r for r in streaming)
    with pytest.raises(FileNotFoundError, match="holds no results.jsonl"):
        run_eval(grid, tmp_path / "c", model=model, tokenizer=tok, progress=False, plots=False, reuse=(tmp_path / "nope",))
    assert not (tmp_path / "c").exists()  # nothing written before the check


def test_killed_mid_line_results_file_still_resumes(tiny, tmp_path):
    model, tok = tiny
    grid = _grid(policies=("full",), samples=2)
    run_eval(grid, tmp_path, model=model, tokenizer=tok, max_cells=1, progress=False, plots=False, quiet=True)
    with open(tmp_path / res.RESULTS_FILE, "a") as f:
        f.write('{"key": "half a line')  # a kill during the write
    with pytest.warns(UserWarning, match=r"skipped 1 line\(s\) that are not result records \(line 2\)"):
        records = run_eval(grid, tmp_path, model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    assert sorted(r["sample"] for r in records) == [0, 1]


def test_sample_ids_run_the_same_cells_as_the_whole_sweep(tiny, tmp_path):
    model, tok = tiny
    some = run_eval(_grid(policies=("full",), samples=3, sample_ids=(2, 0, 2)), tmp_path / "some", model=model,
                    tokenizer=tok, progress=False, plots=False, quiet=True)
    every = run_eval(_grid(policies=("full",), samples=3), tmp_path / "all", model=model, tokenizer=tok,
                     progress=False, plots=False, quiet=True)
    assert sorted(r["sample"] for r in some) == [0, 2]  # a repeated index runs once
    by_key = {r["key"]: r for r in every}
    for r in some:  # same keys (resumable into the whole run's folder), same prompts and answers
        assert by_key[r["key"]]["answers"] == r["answers"] and by_key[r["key"]]["prediction"] == r["prediction"]


def test_ppl_task_scores_perplexity_through_the_policy_cache(tiny, tmp_path):
    model, tok = tiny
    grid = _grid(tasks=("ppl",), lengths=(256,), chunk_size=64)
    records = run_eval(grid, tmp_path, model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    by = {r["policy_label"]: r for r in records}
    assert set(by) == {"full", "window@32"} and all(r["metric"] == "perplexity" for r in records)
    assert by["full"]["score"] != pytest.approx(by["window@32"]["score"], rel=1e-6)
    ids = torch.tensor([kvpress.evals.tasks.get_task("ppl").token_ids(tok, 256)])
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
    assert by["full"]["score"] == pytest.approx(float(torch.exp(nll)), rel=1e-4)


# --------------------------------------------------------------------------- shared prefill


def _shared_policies(model):
    adapter = kvpress.get_adapter(model)
    out = []
    for name in kvpress.list_policies():
        cls = kvpress.policy_class(name)
        if cls.full_prefill:
            out.append(cls.example(adapter))
    return out


def test_shared_prefill_equals_each_policy_prefilling_alone(tiny):
    model, _ = tiny
    ids = random_ids(48, seed=3)
    prefill = shared_prefill(model, ids)
    for policy in _shared_policies(model):
        own = generate_sample(model, policy, ids, max_new_tokens=4, eos_token_id=None)
        shared = generate_sample(model, policy, ids, max_new_tokens=4, eos_token_id=None, prefill=prefill)
        assert shared.shared_prefill and not own.shared_prefill
        assert shared.tokens == own.tokens, policy.name
        assert shared.stats.resident_bytes == own.stats.resident_bytes, policy.name


def test_runner_with_and_without_prefill_sharing_agree(tiny, tmp_path):
    model, tok = tiny
    adapter = kvpress.get_adapter(model)

    def runs_with_defaults(name):
        try:
            kvpress.get_policy(name).check_model(adapter)
        except (ValueError, OSError):
            return False
        return True

    sharers = [p for p in _shared_policies(model) if p.name != "full" and runs_with_defaults(p.name)]
    if not sharers:
        pytest.skip("no other artifact-free policy declares full_prefill")
    grid = _grid(policies=("full", sharers[0].name), budgets=(32,), samples=1, max_new_tokens=4)
    a = run_eval(grid, tmp_path / "a", model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    nogrid = _grid(policies=("full", sharers[0].name), budgets=(32,), samples=1, max_new_tokens=4, share_prefill=False)
    b = run_eval(nogrid, tmp_path / "b", model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    assert any(r["shared_prefill"] for r in a) and not any(r["shared_prefill"] for r in b)
    pick = lambda rs: sorted((r["policy_label"], r["prediction"], r["score"], r["resident_bytes"]) for r in rs)  # noqa: E731
    assert pick(a) == pick(b)


def test_prompts_in_pieces_split_only_the_policies_they_change(tiny, tmp_path, monkeypatch):
    """``prefill_chunk_size``: the exact policies keep their keys and shared prefill (their pieces end
    as one forward), so a chunked grid resumes their cells; a quantizer becomes a ``~prefillN``
    variant of its own whose cell is generation with the prompt in pieces."""
    from kvpress.evals.runner import _eos
    from kvpress.evals.tasks import build_input_ids

    model, tok = tiny
    spec = "kivi:bits=4:group_size=8:residual_length=16"
    kw = dict(policies=("full", spec), budgets=(), samples=1, max_new_tokens=3)
    plain = run_eval(_grid(**kw), tmp_path, model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    grid = _grid(**kw, prefill_chunk_size=100)
    assert [v.label for v in grid.variants()] == ["full", f"{spec}~prefill100"]
    opened = []
    monkeypatch.setattr(kvpress.PolicyCache, "begin_prompt",
                        lambda self, _orig=kvpress.PolicyCache.begin_prompt: (opened.append(1), _orig(self))[1])
    records = run_eval(grid, tmp_path, model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    assert len(records) == 3 and len(opened) == 1  # full's cell resumed; the quantizer's prompt went in pieces
    chunked = next(r for r in records if r["policy_label"] == f"{spec}~prefill100")
    assert chunked["policy"]["prefill_chunk_size"] == 100 and not chunked["shared_prefill"]
    assert chunked["policy_spec"].endswith("~prefill100") and chunked["key"] not in {r["key"] for r in plain}
    sample = grid.task_objects()[0].generate(tok, 512, num_samples=1, seed=grid.seed)[0]
    ids = torch.tensor([build_input_ids(tok, sample)])
    direct = generate_sample(model, grid.variants()[1].policy, ids, max_new_tokens=min(sample.max_new_tokens, 3),
                             eos_token_id=_eos(tok, model), prefill_chunk_size=100)
    assert tok.decode(direct.tokens, skip_special_tokens=True).strip() == chunked["prediction"]
    with pytest.raises(ValueError, match="not both"):
        generate_sample(model, grid.variants()[1].policy, ids, max_new_tokens=1, prefill=shared_prefill(model, ids),
                        prefill_chunk_size=100)


def test_policy_that_cannot_run_on_the_model_fails_before_any_cell(tiny, tmp_path):
    model, tok = tiny
    adapter = kvpress.get_adapter(model)
    misfits = []
    for name in kvpress.list_policies():
        try:
            kvpress.get_policy(name).check_model(adapter)
        except (ValueError, OSError):
            misfits.append(name)
    if not misfits:
        pytest.skip("every registered policy runs on the tiny model with its defaults")
    with pytest.raises(ValueError, match="cannot run on this model"):
        run_eval(_grid(policies=("full", misfits[0])), tmp_path, model=model, tokenizer=tok, progress=False)
    assert not (tmp_path / res.RESULTS_FILE).exists()


# --------------------------------------------------------------------------- one writer, clean records


def test_a_second_run_on_a_locked_out_dir_fails_at_once(tiny, tmp_path, capsys, monkeypatch):
    """Another process holds the folder's lock: run_eval and `kvpress eval` stop before any cell
    (a ValueError: the command line prints one line naming the lock)."""
    import subprocess
    import sys

    model, tok = tiny
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(tmp_path / res.LOCK_FILE)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(res.OutDirLockedError, match=r"another kvpress eval is writing to .*\.kvpress-eval\.lock"):
            run_eval(_grid(), tmp_path, model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
        assert not (tmp_path / res.RESULTS_FILE).exists()

        from kvpress.cli import main

        monkeypatch.setattr("kvpress.evals.runner.load_eval_model", lambda *a, **k: (model, tok))
        assert main(["eval", "--policies", "full", "--tasks", "niah_single", "--lengths", "512", "--samples", "1",
                     "--out", str(tmp_path), "--no-progress", "--no-plots"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and res.LOCK_FILE in err[0]
    finally:
        holder.kill()
        holder.wait()
    records = run_eval(_grid(policies=("full",), samples=1), tmp_path, model=model, tokenizer=tok, progress=False,
                       plots=False, quiet=True)  # the lock released: this run goes ahead
    assert len(records) == 1


def test_lines_that_are_not_records_are_skipped_with_a_count(tiny, tmp_path):
    model, tok = tiny
    grid = _grid(policies=("full",), samples=2)
    run_eval(grid, tmp_path, model=model, tokenizer=tok, max_cells=1, progress=False, plots=False, quiet=True)
    good = json.loads((tmp_path / res.RESULTS_FILE).read_text())
    junk = ['[1, 2, 3]', '"a string"', '{"key": 3}', '{"not": "a record"}', json.dumps({**good, "length": "512"}),
            "not json at all", "42"]
    with open(tmp_path / res.RESULTS_FILE, "a") as f:
        f.write("\n".join(junk) + "\n")
    with pytest.warns(UserWarning, match=r"skipped 7 line\(s\) that are not result records \(line 2, 3, 4"):
        records = run_eval(grid, tmp_path, model=model, tokenizer=tok, progress=False, plots=False, quiet=True)
    assert sorted(r["sample"] for r in records) == [0, 1]  # resumed: sample 0 kept, sample 1 computed

    from kvpress.evals.report import format_report, load

    with pytest.warns(UserWarning, match="skipped 7 line"):
        assert "full" in format_report(load([tmp_path]), n_boot=0)


def test_chunked_nll_is_the_cross_entropy_of_the_chunked_logits(tiny):
    """The ppl task's NLL, reduced chunk by chunk (one chunk's logits in memory at a time), equals
    the cross-entropy of all the chunked logits, and the cache is the same policy's."""
    from kvpress.evals.decode import chunked_logits, chunked_nll

    model, _ = tiny
    ids = random_ids(70, seed=2)
    policy = kvpress.get_policy("kivi", group_size=8, residual_length=8)
    nll, cache = chunked_nll(model, policy, ids, chunk_size=16)
    logits = chunked_logits(model, policy, ids, chunk_size=16)
    reference = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    assert nll.shape == (69,) and cache.policy is policy
    torch.testing.assert_close(nll, reference)
    with pytest.raises(ValueError, match="shape \\[1, T\\]"):
        chunked_nll(model, policy, ids.repeat(2, 1))
