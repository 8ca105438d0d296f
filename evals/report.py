"""Markdown reports of ``kvpress eval`` results: scores relative to ``full``, per task and budget.

``kvpress report results/4k results/8k --min-full 0.5`` reads the JSONL logs of
one or more output folders (a cell that appears in several is counted once) and prints, for
every input length:

- a *retention* table: one row per policy spec, one column per budget (or ``-`` for policies
  without one), each cell the *lowest* over the qualifying tasks of ``score / full's score`` —
  the issues' "keeps >= X% of full's score on every task where full scores >= 0.5";
  qualifying tasks are those where ``full`` averages at least ``--min-full`` at that length;
- a *detail* table: one row per policy config, the mean score on every task, resident KV MiB
  and the number of samples behind each score;
- for the ``ppl`` task, a *perplexity* table: each policy's perplexity (lower is better) and
  ``full``'s perplexity divided by it (100% = as good as ``full``).

Scores are means over samples; ``full`` must be in the results at each length it reports.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict

from . import results as res

REFERENCE = "full"


def load(dirs) -> list[dict]:
    """Records of every folder in ``dirs``; a cell (same key) seen twice is kept once."""
    seen, records = set(), []
    for folder in dirs:
        for record in res.read_records(folder):
            if record["key"] not in seen:
                seen.add(record["key"])
                records.append(record)
    return records


def _spec(record: dict) -> str:
    spec = record.get("policy_spec") or record["policy_name"]
    return spec + (f"/b{record['bits']}" if record.get("bits") is not None else "")


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


def score_table(records: list[dict], length: int) -> dict:
    """``{(spec, budget): {task: {sample: (score, resident bytes)}}}`` for one length (scores only)."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        if r["length"] == length and r.get("metric", "score") == "score":
            cells[(_spec(r), r.get("budget"))][r["task"]][r["sample"]] = (float(r["score"]), r["resident_bytes"])
    return cells


def perplexity_table(records: list[dict], length: int) -> dict:
    """``{(spec, budget): {task: (perplexity, resident bytes)}}`` for one length."""
    cells: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for r in records:
        if r["length"] == length and r.get("metric") == "perplexity":
            cells[(_spec(r), r.get("budget"))][r["task"]] = (float(r["score"]), r["resident_bytes"])
    return cells


def _perplexity_lines(table: dict) -> list[str]:
    full = table.get((REFERENCE, None), {})
    tasks = list(dict.fromkeys(t for by_task in table.values() for t in by_task))
    lines = ["Perplexity (lower is better); `full / policy`: full's perplexity over the policy's.", "",
             "| policy | budget | task | perplexity | full / policy | resident KV MiB |", "|---" * 6 + "|"]
    for (spec, budget), by_task in sorted(table.items(), key=lambda kv: (kv[0][0] != REFERENCE, kv[0][0],
                                                                         _budget_sort(kv[0][1]))):
        for task in tasks:
            if task in by_task:
                value, nbytes = by_task[task]
                ratio = percent(full[task][0] / value) if task in full and value > 0 else ""
                lines.append(f"| {spec} | {'-' if budget is None else budget} | {task} | {value:.3f} | {ratio} "
                             f"| {nbytes / res.MIB:.1f} |")
    return lines + [""]


def _task_mean(samples: dict, only=None) -> float:
    return _mean(score for index, (score, _) in samples.items() if only is None or index in only)


def qualifying_tasks(table: dict, min_full: float) -> dict[str, float]:
    """Tasks where ``full`` scores at least ``min_full`` (mean over its samples), with that score."""
    full = table.get((REFERENCE, None), {})
    means = {task: _task_mean(samples) for task, samples in full.items()}
    return {task: score for task, score in means.items() if score >= min_full}


def retention(table: dict, tasks) -> dict[tuple, tuple[float, int]]:
    """``{(spec, budget): (lowest score/full over the tasks, tasks measured)}``.

    Each ratio compares the samples the cell has with ``full`` on the *same* samples, so a
    partly finished cell is not judged against full's other samples.
    """
    full = table.get((REFERENCE, None), {})
    out = {}
    for key, by_task in table.items():
        ratios = []
        for task in tasks:
            if task in by_task:
                reference = _task_mean(full[task], only=by_task[task])
                if reference > 0:
                    ratios.append(_task_mean(by_task[task]) / reference)
        if ratios:
            out[key] = (min(ratios), len(ratios))
    return out


def _budget_sort(budget) -> float:
    return -1 if budget is None else budget


def percent(ratio: float) -> str:
    """``0.5`` -> ``"50%"``, ``0.8942`` -> ``"89.4%"``: a whole percent only when exact, so a ratio
    just under a target (89.4% against 90%) is never rounded onto it."""
    tenths = math.floor(ratio * 1000 + 1e-9) / 10
    return f"{tenths:.0f}%" if tenths == int(tenths) else f"{tenths:.1f}%"


def format_report(records: list[dict], min_full: float = 0.5) -> str:
    """The markdown report (both tables per length)."""
    lines = []
    for length in sorted({r["length"] for r in records}):
        table = score_table(records, length)
        ppl = perplexity_table(records, length)
        if (REFERENCE, None) not in table:
            lines += [f"## {length} tokens", ""]
            if table:
                lines += [f"(no `{REFERENCE}` scores at this length: nothing to compare)", ""]
            lines += _perplexity_lines(ppl) if ppl else []
            continue
        tasks = qualifying_tasks(table, min_full)
        full_desc = ", ".join(f"{t} {s:.2f}" for t, s in tasks.items()) or "none"
        lines += [f"## {length} tokens", "",
                  f"Lowest score / full's score over the tasks where full >= {min_full} ({full_desc}); "
                  "each ratio against full on the same samples; `(n/k)`: only n of the k tasks measured.", ""]
        ratios = retention(table, tasks)
        budgets = sorted({b for (_, b) in ratios}, key=_budget_sort)
        specs = list(dict.fromkeys(s for (s, _) in table))
        lines.append("| policy | " + " | ".join("-" if b is None else str(b) for b in budgets) + " |")
        lines.append("|---" * (len(budgets) + 1) + "|")
        for spec in specs:
            row = []
            for b in budgets:
                value = ratios.get((spec, b))
                if value is None:
                    row.append("")
                else:
                    ratio, count = value
                    row.append(percent(ratio) + ("" if count == len(tasks) else f" ({count}/{len(tasks)})"))
            if any(row):
                lines.append(f"| {spec} | " + " | ".join(row) + " |")
        all_tasks = list(dict.fromkeys(t for by_task in table.values() for t in by_task))
        lines += ["", "| policy | budget | " + " | ".join(all_tasks) + " | samples | resident KV MiB |",
                  "|---" * (len(all_tasks) + 4) + "|"]
        for (spec, budget), by_task in sorted(table.items(), key=lambda kv: (specs.index(kv[0][0]), _budget_sort(kv[0][1]))):
            scores = [f"{_task_mean(by_task[t]):.2f}" if t in by_task else "" for t in all_tasks]
            counts = sorted({len(samples) for samples in by_task.values()})
            mib = _mean(b for samples in by_task.values() for (_, b) in samples.values()) / res.MIB
            lines.append(f"| {spec} | {'-' if budget is None else budget} | " + " | ".join(scores)
                         + f" | {'/'.join(map(str, counts))} | {mib:.1f} |")
        lines.append("")
        lines += _perplexity_lines(ppl) if ppl else []
    return "\n".join(lines)
