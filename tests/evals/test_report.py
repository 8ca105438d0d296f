"""The markdown report: retention against full on the same samples, qualifying tasks only."""

from __future__ import annotations

import json

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


def _sweep():
    """Two policies over budgets 64 / 256 and two lengths, scores and timings varying by sample."""
    out = []
    for length in (1024, 2048):
        for i in range(6):
            full = _cell("full", "niah", i, float(i != 5), length=length, nbytes=length * 2**12)
            out.append({**full, "decode_ms_per_token": 40.0 + i})
            for budget in (64, 256):
                cell = _cell("snapkv", "niah", i, float(i < budget // 64 + 1), budget=budget, length=length,
                             nbytes=budget * 2**12)
                out.append({**cell, "policy_label": f"snapkv@{budget}",
                            "decode_ms_per_token": 30.0 + i})
    return out


def test_mean_interval_is_seeded_and_brackets_the_mean():
    from kvpress.evals.plots import mean_interval

    assert mean_interval([0.5]) == (0.5, 0.5, 0.5)
    assert mean_interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    mean, low, high = mean_interval([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    assert mean == pytest.approx(2 / 3) and 0.0 <= low < mean < high <= 1.0
    assert mean_interval([0.0, 1.0, 1.0, 0.0, 1.0, 1.0]) == (mean, low, high)
    with pytest.raises(ValueError, match="at least one value"):
        mean_interval([])


def test_plots_start_at_zero_and_show_counts_and_intervals(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from kvpress.evals import plots

    figures = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (figures.append(fig), original(fig, *a, **kw))[1])
    paths = plots.write_plots(_sweep(), tmp_path)
    assert [p.name for p in paths] == list(plots.PLOT_FILES)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    for fig in figures:
        for ax in fig.axes:
            assert ax.get_ylim()[0] == 0
    score_ax = figures[0].axes[0]
    texts = [t.get_text() for t in score_ax.texts]
    assert texts.count("n=12") == 2  # snapkv at each budget: 6 samples x 2 lengths
    legend = [t.get_text() for t in score_ax.get_legend().get_texts()]
    assert "full (n=12)" in legend and "snapkv" in legend
    assert score_ax.collections  # the error bars and full's interval band
    memory_legend = [t.get_text() for t in figures[1].axes[0].get_legend().get_texts()]
    assert "snapkv@64 (n=6)" in memory_legend


def test_report_writes_markdown_and_plots_next_to_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from kvpress.evals.plots import PLOT_FILES
    from kvpress.evals.report import REPORT_FILE, write_report

    paths = write_report(_sweep(), tmp_path / "w", n_boot=0)
    assert [p.name for p in paths] == [REPORT_FILE, *PLOT_FILES]
    text = paths[0].read_text()
    assert text.startswith(format_report(_sweep(), n_boot=0)) and "![score vs budget](score_vs_budget.png)" in text
    (tmp_path / "r").mkdir()
    for record in _sweep():
        res.append_record(tmp_path / "r", record)
    assert main(["report", str(tmp_path / "r"), "--bootstrap", "0"]) == 0
    assert all((tmp_path / "r" / name).is_file() for name in (REPORT_FILE, *PLOT_FILES))
    assert "wrote" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [REPORT_FILE]


def test_results_record_the_commit_of_kvpress_own_checkout_only(tmp_path):
    import shutil
    import subprocess

    from kvpress.evals.results import checkout_commit, environment

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    env = environment()
    import kvpress

    assert env["kvpress_version"] == kvpress.__version__

    def git(cwd, *args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                       capture_output=True)

    # kvpress sitting inside another project's repository (e.g. its virtual environment), untracked
    project = tmp_path / "project"
    package = project / "venv" / "site" / "kvpress"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (project / "README").write_text("x")
    git(project, "init", "-q")
    git(project, "add", "README")
    git(project, "commit", "-qm", "project")
    assert checkout_commit(package / "__init__.py") == (None, None)
    # kvpress's own checkout: its top level holds the package, which it tracks
    own = tmp_path / "own"
    (own / "kvpress").mkdir(parents=True)
    (own / "kvpress" / "__init__.py").write_text("")
    git(own, "init", "-q")
    logs = own / "benchmarks" / "results" / "logs" / "run"
    logs.mkdir(parents=True)
    (logs / "results.jsonl").write_text("{}\n")
    git(own, "add", "kvpress/__init__.py", "benchmarks")
    git(own, "commit", "-qm", "kvpress")
    sha, dirty = checkout_commit(own / "kvpress" / "__init__.py")
    assert len(sha) == 40 and dirty is False
    # a run resuming into committed per-cell logs appends to a tracked file: the code is still clean
    (logs / "results.jsonl").write_text("{}\n{}\n")
    assert checkout_commit(own / "kvpress" / "__init__.py")[1] is False
    (own / "kvpress" / "__init__.py").write_text("changed = 1\n")
    assert checkout_commit(own / "kvpress" / "__init__.py")[1] is True
    assert checkout_commit(tmp_path / "nowhere" / "kvpress" / "__init__.py") == (None, None)


def test_two_configurations_of_one_task_stay_apart():
    """Cells of `niah_single` and `niah_single:value_type=uuids` share the task name and sample
    indices; the report keys them by the options they set away from the defaults."""
    from kvpress.evals.report import task_label
    from kvpress.evals.tasks import get_task

    plain, uuids = get_task("niah_single"), get_task("niah_single", value_type="uuids")
    cells = [{**_cell("full", "niah_single", 0, 1.0), "task_spec": plain.spec},
             {**_cell("full", "niah_single", 0, 0.0), "task_spec": uuids.spec, "key": "other"}]
    assert [task_label(c) for c in cells] == ["niah_single", "niah_single:value_type=uuids"]
    table = score_table(cells, 1024)[("full", None)]
    assert table["niah_single"][0][0] == 1.0 and table["niah_single:value_type=uuids"][0][0] == 0.0
    assert task_label({"task": "old"}) == "old"  # records without a spec keep their task name
    # so do the run's own summary (the printed table and summary.csv) and the score plot's panels
    from kvpress.evals import results as res

    rows = res.summarize(cells)
    assert [(r["task"], r["n"], r["score"]) for r in rows] == [("niah_single", 1, 1.0),
                                                                ("niah_single:value_type=uuids", 1, 0.0)]
    assert "niah_single:value_type=uuids  " in res.format_table(rows)


def test_result_table_file_from_eval_logs(tmp_path):
    """`python -m kvpress.evals.result_table` writes a BENCHMARKS result file: scores with counts,
    ratios to full on the same samples, full's answers kept, and resident bytes."""
    from kvpress.evals import benchmarks_md
    from kvpress.evals.result_table import main as table_main

    (tmp_path / "runs").mkdir()
    for record in _records():
        res.append_record(tmp_path / "runs", {**record, "time": "2026-11-28T10:00:00Z"})
    out = tmp_path / "table.json"
    assert table_main([str(tmp_path / "runs"), "--length", "1024", "--tasks", "easy,mixed", "--title", "T",
                       "--section", "quality", "--command", "kvpress eval ...", "--machine", "m", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["date"] == "2026-11-28" and data["columns"][1:4] == ["easy score (n)", "of `full` [95%]",
                                                                     "`full`'s answers kept"]
    rows = {row[0]: row for row in data["rows"]}
    assert rows["`full`"][1] == "1.000 (4)" and rows["`full`"][-2:] == ["8.0", "1.00x"]
    quest = rows["`quest` @ 256"]
    assert quest[1] == "0.750 (4)" and quest[2].startswith("75% [") and quest[3] == "3 of 4"
    assert quest[4] == "0.500 (2)" and quest[5].startswith("50% [") and quest[6] == "1 of 2"
    assert quest[-2:] == ["1.0", "0.12x"]
    benchmarks_md.load(out)  # a valid result file
    assert "logs" not in data  # folders outside benchmarks/results/logs are not recorded
    with pytest.raises(SystemExit):
        table_main([str(tmp_path / "runs"), "--length", "99", "--title", "T", "--section", "quality",
                    "--command", "c", "--machine", "m", "--out", str(out)])


def test_result_table_records_committed_logs_and_rebuilds_from_them(tmp_path, monkeypatch):
    """Folders under benchmarks/results/logs are named in the result file, which BENCHMARKS.md
    shows and `rebuild` reproduces; a changed log changes the rebuild."""
    from kvpress.evals import benchmarks_md, result_table

    monkeypatch.setattr(result_table, "ROOT", tmp_path)
    monkeypatch.setattr(result_table, "LOGS", tmp_path / "benchmarks" / "results" / "logs")
    folder = result_table.LOGS / "t"
    folder.mkdir(parents=True)
    for record in _records():
        res.append_record(folder, {**record, "time": "2026-11-28T10:00:00Z"})
    data = result_table.build([folder], length=1024, title="T", section="quality", order=0,
                              command="kvpress eval ...", machine="m", tasks=["easy", "mixed"])
    assert data["logs"] == {"folders": ["benchmarks/results/logs/t"], "length": 1024, "tasks": ["easy", "mixed"],
                            "perplexity": False}
    assert result_table.rebuild(json.loads(json.dumps(data))) == data
    assert "`benchmarks/results/logs/t/`" in benchmarks_md.render_table(data)
    res.append_record(folder, {**_cell("quest", "easy", 4, 0.0, budget=256), "time": "2026-11-29T10:00:00Z"})
    assert result_table.rebuild(data)["date"] == "2026-11-29"


def test_policy_summary_pairs_each_cell_with_full_on_its_sample():
    from kvpress.evals.compare import policy_summary, score_figure, summary_markdown

    def cell(label, task, sample, score, ms, nbytes, host=0):
        return {**_cell(label, task, sample, score, nbytes=nbytes), "policy_label": label,
                "decode_ms_per_token": ms, "offloaded_bytes": host}

    records = [cell("full", "a", i, 1.0, 10.0, 8 * 2**20) for i in range(4)]
    records += [cell("quest@64", "a", i, [1.0, 0.0, 1.0][i], 5.0, 2 * 2**20) for i in range(3)]
    records += [cell("shadowkv@64", "a", 0, 1.0, 20.0, 2**20, host=3 * 2**20)]
    summary = policy_summary(records)
    assert list(summary) == ["full", "quest@64", "shadowkv@64"]
    quest = summary["quest@64"]
    assert quest.n == 3 and abs(quest.score[0] - 2 / 3) < 1e-9 and abs(quest.of_full["a"] - 2 / 3) < 1e-9
    assert quest.mib == 2.0 and quest.speed[0] == 2.0  # full's 10 ms over its 5 ms
    assert summary["shadowkv@64"].offloaded_mib == 3.0 and summary["shadowkv@64"].speed[0] == 0.5
    table = summary_markdown(summary)
    assert "| `quest@64` | 3 | 0.67 [" in table and "| 66.6% | 2.0 | 0.25x | 0.0 | 2.00x [" in table
    pytest.importorskip("matplotlib")
    fig = score_figure(summary, "title")
    assert len(fig.axes) == 2 and fig.axes[0].get_xlabel() == "resident KV cache (MiB)"
