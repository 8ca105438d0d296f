"""Markdown reports of ``kvpress eval`` results: scores relative to ``full``, per task and budget.

``kvpress report results/4k results/8k --min-full 0.5`` reads the JSONL logs of
one or more output folders (a cell that appears in several is counted once) and prints, for
every input length:

- a *retention* table: one row per policy spec, one column per budget (or ``-`` for policies
  without one), each cell the *lowest* over the qualifying tasks of ``score / full's score`` —
  the question "does it keep >= X% of full's score on every task where full scores >= 0.5?";
  qualifying tasks are those where ``full`` averages at least ``--min-full`` at that length.
  Each ratio is taken on the samples the cell shares with ``full``, and is followed by its 95%
  paired bootstrap interval (``86.2% [72.4–100%]``: ``--bootstrap N`` resamples of those samples,
  seed 0, default 2000; ``--bootstrap 0`` prints the ratios alone), so a shortfall against a
  target can be told from sampling noise over a few dozen samples;
- a *detail* table: one row per policy config, the mean score on every task, resident KV MiB
  and the number of samples behind each score;
- for the ``ppl`` task, a *perplexity* table: each policy's perplexity (lower is better) and
  ``full``'s perplexity divided by it (100% = as good as ``full``).

Scores are means over samples; ``full`` must be in the results at each length it reports.
:func:`write_report` writes the same markdown to ``report.md`` with the PNG plots of
:mod:`kvpress.evals.plots` beside it (``kvpress report`` does so into ``--out``, by default the
first folder).
"""

from __future__ import annotations

import functools
import math
import random
from collections import defaultdict
from operator import itemgetter
from pathlib import Path

from . import results as res
from .results import task_label  # noqa: F401  (re-exported: compare and older callers import it here)

REFERENCE = "full"
REPORT_FILE = "report.md"
BOOTSTRAP_RESAMPLES = 2000  # `kvpress report --bootstrap`'s default


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
            cells[(_spec(r), r.get("budget"))][task_label(r)][r["sample"]] = (float(r["score"]), r["resident_bytes"])
    return cells


def perplexity_table(records: list[dict], length: int) -> dict:
    """``{(spec, budget): {task: (perplexity, resident bytes)}}`` for one length."""
    cells: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for r in records:
        if r["length"] == length and r.get("metric") == "perplexity":
            cells[(_spec(r), r.get("budget"))][task_label(r)] = (float(r["score"]), r["resident_bytes"])
    return cells


def _perplexity_lines(table: dict) -> list[str]:
    full = table.get((REFERENCE, None), {})
    tasks = list(dict.fromkeys(t for by_task in table.values() for t in by_task))
    lines = ["Perplexity (lower is better); `full / policy`: full's perplexity over the policy's.", "",
             "| policy | budget | task | perplexity | full / policy | resident KV MiB |", "|---" * 6 + "|"]
    for (spec, budget), by_task in sorted(table.items(), key=lambda kv: (kv[0][0] != REFERENCE, kv[0][0],
                                                                         budget_sort_key(kv[0][1]))):
        for task in tasks:
            if task in by_task:
                value, nbytes = by_task[task]
                ratio = percent(full[task][0] / value) if task in full and value > 0 else ""
                lines.append(f"| {spec} | {'-' if budget is None else budget} | {task} | {value:.3f} | {ratio} "
                             f"| {nbytes / res.MIB:.1f} |")
    return lines + [""]


def task_mean(samples: dict) -> float:
    """Mean score over a cell's samples (``{index: (score, ...)}``)."""
    return _mean(score for score, _ in samples.values())


def qualifying_tasks(table: dict, min_full: float) -> dict[str, float]:
    """Tasks where ``full`` scores at least ``min_full`` (mean over its samples), with that score."""
    full = table.get((REFERENCE, None), {})
    means = {task: task_mean(samples) for task, samples in full.items()}
    return {task: score for task, score in means.items() if score >= min_full}


def paired_scores(samples: dict, full_samples: dict) -> tuple[list[float], list[float]]:
    """The cell's and full's scores on the samples both have, in sample order (so the bootstrap
    does not depend on the order the logs were read in)."""
    shared = sorted(index for index in samples if index in full_samples)
    return [samples[i][0] for i in shared], [full_samples[i][0] for i in shared]


def _lowest(table: dict, tasks) -> dict[tuple, tuple]:
    """``{(spec, budget): ((ratio, policy scores, full scores) of the lowest-ratio task, tasks measured)}``."""
    full = table.get((REFERENCE, None), {})
    out = {}
    for key, by_task in table.items():
        measured = []
        for task in tasks:
            if task in by_task:
                policy, reference = paired_scores(by_task[task], full[task])
                if reference and _mean(reference) > 0:
                    measured.append((_mean(policy) / _mean(reference), policy, reference))
        if measured:
            out[key] = (min(measured, key=itemgetter(0)), len(measured))
    return out


def retention(table: dict, tasks) -> dict[tuple, tuple[float, int]]:
    """``{(spec, budget): (lowest score/full over the tasks, tasks measured)}``.

    Each ratio compares the cell with ``full`` on the samples both have, so a partly finished
    cell is not judged against full's other samples.
    """
    return {key: (worst[0], count) for key, (worst, count) in _lowest(table, tasks).items()}


def _percentile(ordered: list[float], q: float) -> float:
    # linear interpolation between order statistics (numpy's default), exact when they are equal
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@functools.lru_cache(maxsize=8)
def _resamples(num_samples: int, n_boot: int, seed: int) -> tuple[itemgetter, ...]:
    # a fresh Random(seed) per call draws the same indices for every cell with as many samples,
    # so they are drawn once per report; an itemgetter picks a resample's scores in C
    rng = random.Random(seed)
    population = range(num_samples)
    return tuple(itemgetter(*rng.choices(population, k=num_samples)) for _ in range(n_boot))


def bootstrap_ratio(policy_scores, full_scores, n_boot: int = BOOTSTRAP_RESAMPLES,
                    seed: int = 0) -> tuple[float, float] | None:
    """95% paired bootstrap interval of ``mean(policy_scores) / mean(full_scores)``.

    The samples are resampled with replacement ``n_boot`` times, the same indices for the policy
    and ``full`` (paired: a sample hard for both stays hard for both); resamples where full's mean
    is not positive have no ratio and are skipped.

    Parameters
    ----------
    policy_scores : sequence of float, shape (n,)
        The policy's score on each sample.
    full_scores : sequence of float, shape (n,)
        ``full``'s score on the same samples, in the same order.
    n_boot : int
        Resamples, at least 1.
    seed : int
        Seed of the ``random.Random`` that draws them: the same seed gives the same interval.

    Returns
    -------
    (float, float) or None
        The 2.5th and 97.5th percentiles of the resampled ratios (linear interpolation);
        ``None`` with fewer than 2 samples or when no resample has a ratio.

    Raises
    ------
    ValueError
        If the two sequences differ in length or ``n_boot < 1``.
    """
    policy = [float(s) for s in policy_scores]
    full = [float(s) for s in full_scores]
    if len(policy) != len(full):
        raise ValueError(f"bootstrap_ratio pairs scores sample by sample: got {len(policy)} policy scores "
                         f"and {len(full)} full scores")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1 resample, got {n_boot}")
    if len(policy) < 2:
        return None
    ratios = []
    for pick in _resamples(len(policy), n_boot, seed):
        # the ratio of sums is the ratio of means (same count) with one rounding fewer
        full_sum = sum(pick(full))
        if full_sum > 0:
            ratios.append(sum(pick(policy)) / full_sum)
    if not ratios:
        return None
    ratios.sort()
    return _percentile(ratios, 0.025), _percentile(ratios, 0.975)


def budget_sort_key(budget) -> float:
    """Sort key of a budget column: no budget (None) first, then ascending."""
    return -1 if budget is None else budget


def percent(ratio: float) -> str:
    """``0.5`` -> ``"50%"``, ``0.8942`` -> ``"89.4%"``: a whole percent only when exact, so a ratio
    just under a target (89.4% against 90%) is never rounded onto it."""
    tenths = math.floor(ratio * 1000 + 1e-9) / 10
    return f"{tenths:.0f}%" if tenths == int(tenths) else f"{tenths:.1f}%"


def _retention_cell(lowest: tuple, num_tasks: int, n_boot: int, seed: int) -> str:
    (ratio, policy, reference), count = lowest
    text = percent(ratio)
    interval = bootstrap_ratio(policy, reference, n_boot, seed) if n_boot else None
    if interval is not None:
        # both ends floored like the ratio, so neither end is rounded up onto a target
        text += f" [{percent(interval[0])}–{percent(interval[1])}]"
    return text + ("" if count == num_tasks else f" ({count}/{num_tasks})")


def format_report(records: list[dict], min_full: float = 0.5, n_boot: int = BOOTSTRAP_RESAMPLES,
                  seed: int = 0) -> str:
    """The markdown report (both tables per length).

    Parameters
    ----------
    records : list of dict
        ``kvpress eval`` result records, as :func:`load` returns them.
    min_full : float
        A task counts in the retention table where ``full`` averages at least this.
    n_boot : int
        Paired bootstrap resamples behind each retention cell's 95% interval (see
        :func:`bootstrap_ratio`); 0 prints the ratios alone (``kvpress report --bootstrap``).
    seed : int
        The bootstrap's seed.
    """
    if n_boot < 0:
        raise ValueError(f"n_boot must be >= 0 resamples (0: no intervals), got {n_boot}")
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
        if n_boot:
            lines += [f"`[lo–hi]`: 95% paired bootstrap interval of that lowest task's ratio over its samples "
                      f"({n_boot} resamples, seed {seed}; none with fewer than 2 samples).", ""]
        lowest = _lowest(table, tasks)
        budgets = sorted({b for (_, b) in lowest}, key=budget_sort_key)
        specs = list(dict.fromkeys(s for (s, _) in table))
        lines.append("| policy | " + " | ".join("-" if b is None else str(b) for b in budgets) + " |")
        lines.append("|---" * (len(budgets) + 1) + "|")
        for spec in specs:
            row = [_retention_cell(lowest[(spec, b)], len(tasks), n_boot, seed) if (spec, b) in lowest else ""
                   for b in budgets]
            if any(row):
                lines.append(f"| {spec} | " + " | ".join(row) + " |")
        all_tasks = list(dict.fromkeys(t for by_task in table.values() for t in by_task))
        lines += ["", "| policy | budget | " + " | ".join(all_tasks) + " | samples | resident KV MiB |",
                  "|---" * (len(all_tasks) + 4) + "|"]
        order = sorted(table.items(), key=lambda kv: (specs.index(kv[0][0]), budget_sort_key(kv[0][1])))
        for (spec, budget), by_task in order:
            scores = [f"{task_mean(by_task[t]):.2f}" if t in by_task else "" for t in all_tasks]
            counts = sorted({len(samples) for samples in by_task.values()})
            mib = _mean(b for samples in by_task.values() for (_, b) in samples.values()) / res.MIB
            lines.append(f"| {spec} | {'-' if budget is None else budget} | " + " | ".join(scores)
                         + f" | {'/'.join(map(str, counts))} | {mib:.1f} |")
        lines.append("")
        lines += _perplexity_lines(ppl) if ppl else []
    return "\n".join(lines)


def write_report(records: list[dict], out_dir, min_full: float = 0.5, n_boot: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0, plots: bool = True) -> list[Path]:
    """Write :func:`format_report`'s markdown to ``out_dir/report.md`` and the plots beside it.

    The markdown ends with links to the PNGs (:func:`kvpress.evals.plots.write_plots`: score
    against budget, resident KV and decode latency against length). Returns the written paths,
    ``report.md`` first. ``plots=False`` writes the markdown alone.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = format_report(records, min_full, n_boot=n_boot, seed=seed)
    written = []
    if plots:
        from .plots import write_plots

        written = write_plots(records, out_dir)
        text += "\n## Plots\n\nMeans over samples with 95% bootstrap intervals; `n`: samples behind a point.\n\n"
        text += "\n".join(f"![{p.stem.replace('_', ' ')}]({p.name})" for p in written) + "\n"
    report = out_dir / REPORT_FILE
    report.write_text(text, encoding="utf-8")
    return [report, *written]
