"""A BENCHMARKS result file (one table) from ``kvpress eval`` output folders.

``python -m kvpress.evals.result_table RUNS [RUNS ...] --length 16384 --title ... --section gemma
--command "..." --machine "..." --out benchmarks/results/NAME.json`` reads the folders' JSONL logs
(a cell in several folders counts once, :func:`kvpress.evals.report.load`) and writes one table
for one input length in the format :mod:`kvpress.evals.benchmarks_md` renders:

- scored tasks: one row per policy configuration and budget; per task the mean score with its
  sample count, the score over ``full``'s on the same samples with a 95% paired bootstrap interval
  (:func:`kvpress.evals.report.bootstrap_ratio`), and, for tasks scored 0 or 1, how many of the
  samples ``full`` answers the configuration answers too; then the resident KV bytes after the
  answer (mean over the cells) and their share of ``full``'s;
- with ``--perplexity``: one row per configuration, its perplexity on the ``ppl`` task, ``full``'s
  over it, and its resident KV bytes.

The numbers come from the logs alone, so rerunning the command over the same folders rewrites the
same file; the date is the newest cell's.

**Committed logs.** When every folder lies under ``benchmarks/results/logs/`` (a folder per table
holding the runs' ``results.jsonl``), the result file records them and the arguments of the build
under ``"logs"``; BENCHMARKS.md names the folders under the table, and ``tests/test_docs.py``
rebuilds the table from them and checks it equals the committed one. Such folders also serve as
``kvpress eval --reuse`` sources when the table grows (e.g. ``full``'s cells for a new policy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import results as res
from .benchmarks_md import RESULTS, ROOT
from .report import (REFERENCE, bootstrap_ratio, budget_sort_key, load, paired_scores, percent, perplexity_table,
                     score_table, task_mean)


def _label(spec: str, budget) -> str:
    return f"`{spec}`" if budget is None else f"`{spec}` @ {budget}"


def _kept(samples: dict, full_samples: dict) -> str:
    """``"k of n"``: of the samples where ``full`` scores 1, those where the policy does too
    (empty for tasks with partial scores)."""
    scores = [s for s, _ in samples.values()] + [s for s, _ in full_samples.values()]
    if any(s not in (0.0, 1.0) for s in scores):
        return ""
    answered = [i for i, (s, _) in full_samples.items() if s == 1.0 and i in samples]
    return f"{sum(samples[i][0] == 1.0 for i in answered)} of {len(answered)}"


def _mib(by_task: dict, tasks) -> float:
    sizes = [b for task in tasks for (_, b) in by_task.get(task, {}).values()]
    return sum(sizes) / len(sizes) / res.MIB if sizes else float("nan")


def score_rows(records: list[dict], length: int, tasks: list[str] | None = None,
               n_boot: int = 2000) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the scored-task table at ``length`` (see the module docstring)."""
    table = score_table(records, length)
    full = table.get((REFERENCE, None))
    if not full:
        raise ValueError(f"no `{REFERENCE}` scores at {length} tokens in these folders: nothing to compare with")
    tasks = tasks or list(full)
    columns = ["policy"]
    for task in tasks:
        columns += [f"{task} score (n)", "of `full` [95%]", "`full`'s answers kept"]
    columns += ["resident KV MiB", "KV / `full`"]
    full_mib = _mib(full, tasks)
    rows = []
    order = sorted(table, key=lambda key: (key[0] != REFERENCE, key[0], budget_sort_key(key[1])))
    for spec, budget in order:
        by_task = table[(spec, budget)]
        row = [_label(spec, budget)]
        for task in tasks:
            samples = by_task.get(task, {})
            if not samples:
                row += ["", "", ""]
                continue
            row.append(f"{task_mean(samples):.3f} ({len(samples)})")
            policy, reference = paired_scores(samples, full.get(task, {}))
            if (spec, budget) == (REFERENCE, None) or not reference or sum(reference) == 0:
                row += ["", ""]
                continue
            ratio = percent(sum(policy) / sum(reference))
            interval = bootstrap_ratio(policy, reference, n_boot) if n_boot else None
            row.append(ratio + (f" [{percent(interval[0])}-{percent(interval[1])}]" if interval else ""))
            row.append(_kept(samples, full.get(task, {})))
        mib = _mib(by_task, tasks)
        row += [f"{mib:.1f}", f"{mib / full_mib:.2f}x"]
        rows.append(row)
    return columns, rows


def perplexity_rows(records: list[dict], length: int) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the perplexity table at ``length``."""
    table = perplexity_table(records, length)
    full = table.get((REFERENCE, None), {}).get("ppl")
    if full is None:
        raise ValueError(f"no `{REFERENCE}` perplexity at {length} tokens in these folders")
    rows = []
    for spec, budget in sorted(table, key=lambda key: (key[0] != REFERENCE, key[0], budget_sort_key(key[1]))):
        value, nbytes = table[(spec, budget)]["ppl"]
        rows.append([_label(spec, budget), f"{value:.3f}", percent(full[0] / value), f"{nbytes / res.MIB:.1f}"])
    return ["policy", "perplexity", "`full` / policy", "resident KV MiB"], rows


LOGS = RESULTS / "logs"


def committed_logs(folders) -> list[str] | None:
    """The folders as paths relative to the repository when all lie under ``benchmarks/results/logs``,
    else None."""
    relative = []
    for folder in folders:
        path = Path(folder).resolve()
        if not path.is_relative_to(LOGS):
            return None
        relative.append(path.relative_to(ROOT).as_posix())
    return relative


def build(folders, *, length: int, title: str, section: str, order: int, command, machine: str,
          tasks: list[str] | None = None, perplexity: bool = False, notes=()) -> dict:
    """The result-file dict (``benchmarks_md``'s format) for ``length`` from the folders' logs
    (with ``"logs"`` when they are committed ones, see the module docstring)."""
    records = load(folders)
    at_length = [r for r in records if r["length"] == length]
    if not at_length:
        raise ValueError(f"no cells at {length} tokens in {', '.join(map(str, folders))}")
    columns, rows = perplexity_rows(records, length) if perplexity else score_rows(records, length, tasks)
    dates = sorted(r.get("time") or "" for r in at_length)  # ISO 8601 UTC, as kvpress eval writes it
    data = {"title": title, "section": section, "order": order, "command": command, "machine": machine,
            "date": (dates[-1] or "")[:10], "columns": columns, "rows": rows, "notes": list(notes)}
    logs = committed_logs(folders)
    if logs:
        data["logs"] = {"folders": logs, "length": length, "tasks": tasks, "perplexity": perplexity}
    return data


def rebuild(data: dict) -> dict:
    """``data`` (a result file with ``"logs"``) built again from its committed logs."""
    logs = data["logs"]
    return build([ROOT / folder for folder in logs["folders"]], length=logs["length"], title=data["title"],
                 section=data["section"], order=data["order"], command=data["command"], machine=data["machine"],
                 tasks=logs["tasks"], perplexity=logs["perplexity"], notes=data.get("notes", ()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpress.evals.result_table", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="kvpress eval output folders")
    p.add_argument("--length", type=int, required=True, help="input length in tokens")
    p.add_argument("--tasks", help="comma-separated task names, in column order (default: full's)")
    p.add_argument("--perplexity", action="store_true", help="the ppl task's table instead of the scored tasks'")
    p.add_argument("--title", required=True)
    p.add_argument("--section", required=True)
    p.add_argument("--order", type=int, default=0)
    p.add_argument("--command", action="append", required=True, help="the command(s) that made the runs")
    p.add_argument("--machine", required=True)
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--out", required=True, help="the result file to write (JSON)")
    args = p.parse_args(argv)
    try:
        data = build(args.runs, length=args.length, title=args.title, section=args.section, order=args.order,
                     command=args.command if len(args.command) > 1 else args.command[0], machine=args.machine,
                     tasks=args.tasks.split(",") if args.tasks else None, perplexity=args.perplexity,
                     notes=args.note)
    except ValueError as err:
        p.exit(2, f"result_table: {err}\n")
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(data['rows'])} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
