"""Plots of ``kvpress eval`` results (matplotlib, Agg backend: no display needed).

* ``score_vs_budget.png`` — mean score against budget, one line per policy, one panel per task
  (policies without a budget, like ``full``, are horizontal reference lines);
* ``memory_vs_length.png`` — resident KV MiB against input length per policy config;
* ``latency_vs_length.png`` — decode ms/token against input length per policy config.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from .results import summarize

PLOT_FILES = ("score_vs_budget.png", "memory_vs_length.png", "latency_vs_length.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _finite(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def plot_score_vs_budget(rows: list[dict], path) -> Path:
    """One panel per task: score (mean over samples and lengths) against budget, per policy."""
    plt = _pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    budgets = sorted({r["budget"] for r in rows if r.get("budget") is not None})
    for ax, task in zip(axes[0], tasks):
        by_policy: dict[str, dict] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if r["task"] == task and _finite(r["score"]):
                name = r.get("policy_spec") or r["policy_name"]
                name += (f"/b{r['bits']}" if r.get("bits") is not None else "")
                by_policy[name][r.get("budget")].append(r["score"])
        for name, points in by_policy.items():
            if set(points) == {None}:  # no budget: a reference line across the sweep
                value = sum(points[None]) / len(points[None])
                ax.axhline(value, linestyle="--", linewidth=1, label=name, color="black" if name == "full" else None)
                continue
            xs = sorted(b for b in points if b is not None)
            ax.plot(xs, [sum(points[b]) / len(points[b]) for b in xs], marker="o", label=name)
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
        metric = next((r.get("metric") for r in rows if r["task"] == task), "score")
        ax.set_title(task)
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_ylabel("perplexity" if metric == "perplexity" else "score")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _plot_vs_length(rows: list[dict], key: str, ylabel: str, path, scale: float = 1.0) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    by_label: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if _finite(r.get(key)):
            by_label[r["policy_label"]][r["length"]].append(r[key] * scale)
    for label, points in by_label.items():
        xs = sorted(points)
        ax.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], marker="o", label=label)
    lengths = sorted({r["length"] for r in rows})
    if len(lengths) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if by_label:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_plots(records: list[dict], out_dir) -> list[Path]:
    """Write the three PNGs of the module docstring into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    rows = summarize(records)
    return [
        plot_score_vs_budget(rows, out_dir / PLOT_FILES[0]),
        _plot_vs_length(rows, "resident_mib", "resident KV cache (MiB)", out_dir / PLOT_FILES[1]),
        _plot_vs_length(rows, "decode_ms_per_token", "decode latency (ms/token)", out_dir / PLOT_FILES[2]),
    ]
