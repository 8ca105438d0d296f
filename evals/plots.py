"""Plots of ``kvpress eval`` results (matplotlib's ``Figure`` API: no display, no global backend).

* ``score_vs_budget.png`` — mean score against budget, one line per policy, one panel per task
  configuration (`niah_single` and `niah_single:value_type=uuids` are two panels)
  (policies without a budget, like ``full``, are horizontal reference lines with a shaded band);
* ``memory_vs_length.png`` — resident KV MiB against input length per policy config;
* ``latency_vs_length.png`` — decode ms/token against input length per policy config.

Every point is a mean over samples with its 95% bootstrap interval (bars; seeded, so the same
records give the same picture) and, on the score plot, its sample count (``n=5``). Score,
memory and latency axes start at 0, so a gap between policies is drawn to scale.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from pathlib import Path

from .results import task_label

PLOT_FILES = ("score_vs_budget.png", "memory_vs_length.png", "latency_vs_length.png")
INTERVAL_RESAMPLES = 1000


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def _finite(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def mean_interval(values, n_boot: int = INTERVAL_RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` and its 95% percentile-bootstrap interval ``(mean, low, high)``.

    The interval collapses onto the mean for a single value (nothing to resample); it is seeded,
    so the same values always give the same interval.
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval needs at least one value")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, mean, mean
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(n_boot))
    return mean, means[int(0.025 * (n_boot - 1))], means[int(math.ceil(0.975 * (n_boot - 1)))]


def _series(xs_values: dict) -> tuple[list, list, list, list]:
    """Sorted x, mean, (below, above) error lengths and counts of ``{x: [values]}``."""
    xs = sorted(xs_values)
    stats = [mean_interval(xs_values[x]) for x in xs]
    means = [m for m, _, _ in stats]
    errors = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
    return xs, means, errors, [len(xs_values[x]) for x in xs]


def _label(record: dict) -> str:
    name = record.get("policy_spec") or record["policy_name"]
    return name + (f"/b{record['bits']}" if record.get("bits") is not None else "")


def plot_score_vs_budget(records: list[dict], path) -> Path:
    """One panel per task: score (mean over samples and lengths) against budget, per policy."""
    tasks = list(dict.fromkeys(task_label(r) for r in records))
    fig = _figure(4.4 * len(tasks), 3.6)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    budgets = sorted({r["budget"] for r in records if r.get("budget") is not None})
    lengths = sorted({r["length"] for r in records})
    for ax, task in zip(axes, tasks):
        by_policy: dict[str, dict] = defaultdict(lambda: defaultdict(list))
        for r in records:
            if task_label(r) == task and _finite(r.get("score")):
                by_policy[_label(r)][r.get("budget")].append(float(r["score"]))
        for name, points in by_policy.items():
            if set(points) == {None}:  # no budget: a reference line (and its interval) across the sweep
                mean, low, high = mean_interval(points[None])
                color = "black" if name == "full" else None
                line = ax.axhline(mean, linestyle="--", linewidth=1, color=color,
                                  label=f"{name} (n={len(points[None])})")
                ax.axhspan(low, high, color=line.get_color(), alpha=0.12, linewidth=0)
                continue
            xs, means, errors, counts = _series({b: v for b, v in points.items() if b is not None})
            bars = ax.errorbar(xs, means, yerr=errors, marker="o", capsize=3, label=name)
            for x, y, n in zip(xs, means, counts):
                ax.annotate(f"n={n}", (x, y), xytext=(4, -10), textcoords="offset points", fontsize=6,
                            color=bars[0].get_color())
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
        metric = next((r.get("metric") for r in records if task_label(r) == task), "score")
        ax.set_title(f"{task} ({', '.join(map(str, lengths))} tokens)", fontsize=9)
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_ylabel("perplexity (lower is better)" if metric == "perplexity" else "score (mean, 95% interval)")
        ax.set_ylim(bottom=0, top=None if metric == "perplexity" else 1.05)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def _plot_vs_length(records: list[dict], key: str, ylabel: str, path, scale: float = 1.0) -> Path:
    fig = _figure(5.6, 3.8)
    ax = fig.subplots()
    by_label: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if _finite(r.get(key)):
            by_label[r["policy_label"]][r["length"]].append(float(r[key]) * scale)
    for label, points in by_label.items():
        xs, means, errors, counts = _series(points)
        counts_text = "/".join(map(str, sorted(set(counts))))
        ax.errorbar(xs, means, yerr=errors, marker="o", capsize=3, label=f"{label} (n={counts_text})")
    lengths = sorted({r["length"] for r in records})
    if len(lengths) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if by_label:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def write_plots(records: list[dict], out_dir) -> list[Path]:
    """Write the three PNGs of the module docstring into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_score_vs_budget(records, out_dir / PLOT_FILES[0]),
        _plot_vs_length(records, "resident_bytes", "resident KV cache (MiB)", out_dir / PLOT_FILES[1], scale=2.0**-20),
        _plot_vs_length(records, "decode_ms_per_token", "decode latency (ms/token)", out_dir / PLOT_FILES[2]),
    ]
