"""The markdown report: retention against full on the same samples, qualifying tasks only."""

from __future__ import annotations

import pytest

from kvpress.cli import main
from kvpress.evals import results as res
from kvpress.evals.report import format_report, load, qualifying_tasks, retention, score_table


def _cell(spec, task, sample, score, budget=None, length=1024, nbytes=2**20):
    name = spec.split(":")[0]
    return {"key": f"{spec}|{budget}|{task}|{length}|{sample}", "policy_spec": spec, "policy_name": name,
            "policy_label": spec, "budget": budget, "bits": None, "task": task, "length": length,
            "sample": sample, "metric": "score", "score": score, "resident_bytes": nbytes}


def _records():
    out = []
    for i in range(4):
        out.append(_cell("full", "easy", i, 1.0, nbytes=8 * 2**20))
        out.append(_cell("full", "mixed", i, [1.0, 1.0, 0.0, 0.0][i], nbytes=8 * 2**20))
        out.append(_cell("full", "hard", i, 0.0, nbytes=8 * 2**20))  # full < 0.5: never judged
        out.append(_cell("quest", "easy", i, [1.0, 1.0, 1.0, 0.0][i], budget=256))
        out.append(_cell("quest", "hard", i, 1.0, budget=256))
    # two finished samples of "mixed" only: judged against full on samples 0 and 1 (1.0), not 0.5
    out += [_cell("quest", "mixed", 0, 1.0, budget=256), _cell("quest", "mixed", 1, 0.0, budget=256)]
    out += [_cell("duo:random_heads_seed=0", "easy", i, 0.0) for i in range(2)]
    return out


def test_retention_is_the_worst_qualifying_task_against_full_on_the_same_samples():
    table = score_table(_records(), 1024)
    tasks = qualifying_tasks(table, 0.5)
    assert tasks == {"easy": 1.0, "mixed": 0.5}
    ratios = retention(table, tasks)
    assert ratios[("full", None)] == (1.0, 2)
    assert ratios[("quest", 256)] == (pytest.approx(0.5), 2)  # mixed: 0.5 / 1.0 on samples 0-1 (easy: 0.75)
    assert ratios[("duo:random_heads_seed=0", None)] == (0.0, 1)


def test_report_tables_and_cli(tmp_path, capsys):
    for record in _records() + _records()[:3]:  # a repeated cell counts once
        res.append_record(tmp_path, record)
    assert len(load([tmp_path, tmp_path])) == len(_records())
    text = format_report(load([tmp_path]), n_boot=0)
    assert "| policy | - | 256 |" in text
    assert "| quest |  | 50% |" in text
    assert "| duo:random_heads_seed=0 | 0% (1/2) |  |" in text
    assert "| full | - | 1.00 | 0.50 | 0.00 | 4 | 8.0 |" in text
    assert main(["report", str(tmp_path)]) == 0
    assert "## 1024 tokens" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "none")]) == 2
    assert "no kvpress eval results" in capsys.readouterr().err


def test_perplexity_cells_get_their_own_table(tmp_path):
    def ppl(spec, value, length):
        cell = _cell(spec, "ppl", 0, value, length=length)
        return {**cell, "metric": "perplexity", "key": cell["key"] + "|ppl"}

    records = _records() + [ppl("full", 30.0, 1024), ppl("kivi", 31.0, 1024), ppl("kivi", 40.0, 2048)]
    text = format_report(records, n_boot=0)
    assert "| full | - | ppl | 30.000 | 100% | 1.0 |" in text
    assert "| kivi | - | ppl | 31.000 | 96.7% | 1.0 |" in text  # 30 / 31, floored to a tenth
    assert "| quest |  | 50% |" in text  # the score tables are unchanged beside it
    only_ppl = text.split("## 2048 tokens")[1]
    assert "| kivi | - | ppl | 40.000 |  | 1.0 |" in only_ppl and "nothing to compare" not in only_ppl


def test_ratios_just_under_a_target_are_not_rounded_onto_it():
    from kvpress.evals.report import percent

    assert [percent(r) for r in (0.5, 0.0, 1.0, 1.2)] == ["50%", "0%", "100%", "120%"]
    assert percent(0.500 / 0.559) == "89.4%" and percent(0.8999) == "89.9%"  # not "90%"
    assert percent(2 / 3) == "66.6%"


def test_bootstrap_interval_brackets_the_ratio_and_is_seeded():
    from kvpress.evals.report import bootstrap_ratio

    full = [float(i % 4 != 0) for i in range(32)]  # 24 of 32 right
    policy = [f if i % 7 else 0.0 for i, f in enumerate(full)]  # loses 3 of them: 21 / 24
    lo, hi = bootstrap_ratio(policy, full)
    assert lo < sum(policy) / sum(full) == 0.875 < hi <= 1.0
    assert bootstrap_ratio(tuple(policy), full, n_boot=2000, seed=0) == (lo, hi)  # any sequence

    full = [(i * 37 % 101) / 100 for i in range(48)]  # continuous scores: seeds tell apart
    policy = [f * (0.6 + (i * 13 % 17) / 40) for i, f in enumerate(full)]
    interval = bootstrap_ratio(policy, full, seed=0)
    assert interval[0] < sum(policy) / sum(full) < interval[1]
    assert bootstrap_ratio(policy, full, seed=0) == interval  # the same seed, the same interval
    assert bootstrap_ratio(policy, full, seed=1) != interval


def test_bootstrap_intervals_that_can_be_worked_out():
    from kvpress.evals.report import bootstrap_ratio, percent

    full = [0.2, 0.9, 0.0, 0.7, 1.0]  # a sample full misses: resamples of only it are skipped
    assert bootstrap_ratio(full, full) == (1.0, 1.0)
    lo, hi = bootstrap_ratio([0.5 * f for f in full], full)
    assert (lo, hi) == (0.5, 0.5) and percent(lo) == "50%"  # halving is exact in binary
    # two samples, the policy right on one: resample ratios 0, 1/2, 1 with odds 1/4, 1/2, 1/4,
    # so the 2.5th and 97.5th percentiles of 2000 of them are 0 and 1
    assert bootstrap_ratio([1.0, 0.0], [1.0, 1.0]) == (0.0, 1.0)
    assert bootstrap_ratio([1.0, 0.0], [1.0, 1.0], n_boot=1) in {(0.0, 0.0), (0.5, 0.5), (1.0, 1.0)}


def test_bootstrap_without_an_interval_or_with_bad_arguments():
    from kvpress.evals.report import bootstrap_ratio

    assert bootstrap_ratio([1.0], [1.0]) is None  # one sample: nothing to resample
    assert bootstrap_ratio([], []) is None
    assert bootstrap_ratio([1.0, 1.0], [0.0, 0.0]) is None  # full never positive: no resample counts
    with pytest.raises(ValueError, match="3 policy scores and 2 full scores"):
        bootstrap_ratio([1.0, 1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="n_boot must be >= 1"):
        bootstrap_ratio([1.0, 1.0], [1.0, 1.0], n_boot=0)


def test_retention_cells_get_a_bootstrap_interval(tmp_path, capsys):
    records = _records()
    old = format_report(records, n_boot=0)
    assert "[" not in old and "bootstrap" not in old
    text = format_report(records, n_boot=2000)
    assert "95% paired bootstrap interval" in text and "(2000 resamples, seed 0;" in text
    assert "| full | 100% [100%–100%] |  |" in text
    # quest's lowest task is "mixed", 1/2 on two samples (see the worked case above), not "easy"'s 3/4
    assert "| quest |  | 50% [0%–100%] |" in text
    assert "| duo:random_heads_seed=0 | 0% [0%–0%] (1/2) |  |" in text  # the (n/k) suffix stays last
    assert "| full | - | 1.00 | 0.50 | 0.00 | 4 | 8.0 |" in text  # the detail table is unchanged
    with pytest.raises(ValueError, match="n_boot must be >= 0"):
        format_report(records, n_boot=-1)

    for record in records:
        res.append_record(tmp_path, record)
    assert main(["report", str(tmp_path)]) == 0
    assert "| quest |  | 50% [0%–100%] |" in capsys.readouterr().out  # the CLI bootstraps by default
    assert main(["report", str(tmp_path), "--bootstrap", "0"]) == 0
    assert capsys.readouterr().out == old + "\n"
    assert main(["report", str(tmp_path), "--bootstrap", "-5"]) == 2


def test_a_sample_full_lacks_does_not_count_in_the_ratio():
    records = _records() + [_cell("quest", "mixed", 9, 1.0, budget=256)]  # full has samples 0-3 only
    table = score_table(records, 1024)
    assert retention(table, qualifying_tasks(table, 0.5))[("quest", 256)] == (pytest.approx(0.5), 2)
