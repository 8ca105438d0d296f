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
    text = format_report(load([tmp_path]))
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
    text = format_report(records)
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
