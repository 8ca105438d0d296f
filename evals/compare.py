"""Policy comparison summaries for notebooks: score, resident KV and decode speed per configuration.

:func:`policy_summary` folds ``kvpress eval`` records (one input length) into one entry per
policy configuration; :func:`summary_markdown` renders it as a table and :func:`score_figure`
as score-against-memory and score-against-speed plots (a ``matplotlib.figure.Figure``, no global
backend). ``notebooks/policy_comparison_gemma.ipynb`` shows them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .plots import mean_interval
from .report import REFERENCE, percent, task_label
from .results import MIB

NAN3 = (float("nan"),) * 3


@dataclass
class PolicySummary:
    """One configuration over its cells.

    Attributes
    ----------
    label : str
        The eval's label (``quest@1024``, ``kivi/b4``).
    score : (mean, low, high)
        Mean score over every cell (tasks and samples) with its 95% bootstrap interval.
    of_full : dict
        Per task: the configuration's total score over ``full``'s on the same samples
        (NaN where ``full`` scores nothing there).
    mib : float
        Mean resident KV bytes after the answer, in MiB (device tensors that exist).
    offloaded_mib : float
        Mean host-tier bytes, in MiB (ShadowKV's values).
    speed : (mean, low, high)
        ``full``'s decode time per token on the same prompt over this configuration's, with its
        interval (> 1: faster); NaN without ``full`` cells.
    n : int
        Cells behind the means.
    """

    label: str
    score: tuple
    of_full: dict
    mib: float
    offloaded_mib: float
    speed: tuple
    n: int


def policy_summary(records: list[dict]) -> dict[str, PolicySummary]:
    """``{label: PolicySummary}`` of scored records, ``full`` first (see :class:`PolicySummary`)."""
    scored = [r for r in records if r.get("metric", "score") == "score"]
    full = {(task_label(r), r["sample"]): r for r in scored if r["policy_label"] == REFERENCE}
    cells = defaultdict(list)
    for r in scored:
        cells[r["policy_label"]].append(r)
    out = {}
    for label in sorted(cells, key=lambda name: name != REFERENCE):
        rs = cells[label]
        paired = [(r, full[(task_label(r), r["sample"])]) for r in rs if (task_label(r), r["sample"]) in full]
        sums = defaultdict(lambda: [0.0, 0.0])
        for r, f in paired:
            sums[task_label(r)][0] += r["score"]
            sums[task_label(r)][1] += f["score"]
        speed = [f["decode_ms_per_token"] / r["decode_ms_per_token"] for r, f in paired
                 if r["decode_ms_per_token"] > 0 and f["decode_ms_per_token"] > 0]
        out[label] = PolicySummary(
            label=label,
            score=mean_interval([r["score"] for r in rs]),
            of_full={task: (s / f if f > 0 else float("nan")) for task, (s, f) in sums.items()},
            mib=sum(r["resident_bytes"] for r in rs) / len(rs) / MIB,
            offloaded_mib=sum(r.get("offloaded_bytes", 0) for r in rs) / len(rs) / MIB,
            speed=mean_interval(speed) if speed else NAN3,
            n=len(rs),
        )
    return out


def summary_markdown(summary: dict[str, PolicySummary]) -> str:
    """A markdown table of :func:`policy_summary`: score, score of ``full``'s per task, KV, speed."""
    tasks = list(dict.fromkeys(t for s in summary.values() for t in s.of_full))
    full_mib = summary[REFERENCE].mib if REFERENCE in summary else float("nan")
    head = ["policy", "n", "score [95%]"] + [f"of `full`: {t}" for t in tasks] + [
        "KV MiB", "KV / full", "host MiB", "speed / full [95%]"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (len(tasks) + 3) + "---|"]
    for label, s in summary.items():
        (m, lo, hi), (v, vlo, vhi) = s.score, s.speed
        ratios = [percent(s.of_full[t]) if t in s.of_full and s.of_full[t] == s.of_full[t] else ""
                  for t in tasks]
        lines.append(f"| `{label}` | {s.n} | {m:.2f} [{lo:.2f}-{hi:.2f}] | " + " | ".join(ratios)
                     + f" | {s.mib:.1f} | {s.mib / full_mib:.2f}x | {s.offloaded_mib:.1f} "
                     f"| {v:.2f}x [{vlo:.2f}-{vhi:.2f}] |")
    return "\n".join(lines)


def score_figure(summary: dict[str, PolicySummary], title: str, ylabel: str = "mean score"):
    """Score against resident KV (left) and against decode speed relative to ``full`` (right)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5.6))
    axes = fig.subplots(1, 2)
    for label, s in summary.items():
        (m, lo, hi), (v, vlo, vhi) = s.score, s.speed
        yerr = [[m - lo], [hi - m]]
        dot = axes[0].errorbar([s.mib], [m], yerr=yerr, marker="o", capsize=3, label=f"{label} (n={s.n})")
        color = dot[0].get_color()
        if v == v:
            axes[1].errorbar([v], [m], yerr=yerr, xerr=[[v - vlo], [vhi - v]], marker="o", capsize=3, color=color)
        axes[0].annotate(label.split(":")[0].split("@")[0].split("/")[0], (s.mib, m), fontsize=7, xytext=(4, 4),
                         textcoords="offset points", color=color)
    axes[0].set_xlabel("resident KV cache (MiB)")
    axes[1].set_xlabel("decode speed relative to full (> 1: faster)")
    axes[1].axvline(1.0, color="black", linewidth=0.8, linestyle=":")
    for ax in axes:
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.05)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.22, 1, 1))
    return fig
