"""Result files of ``kvpress eval``: the JSONL log, per-cell and summary CSVs, the printed table.

One JSONL line per finished cell (policy config x length x task x sample); everything else is
derived from that file, so an interrupted run loses at most the cell in flight. A line that is
not a record (cut by a kill, edited by hand, another tool's output) is skipped with a warning
that counts them. One run writes an output folder at a time (`lock_out_dir`).
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import platform
import subprocess
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from .tasks import get_task, parse_task_spec

RESULTS_FILE = "results.jsonl"
LOCK_FILE = ".kvpress-eval.lock"
# what every record holds, with its type(s): resume, the CSVs and the report read these
RECORD_FIELDS = {"key": (str,), "policy_label": (str,), "policy_name": (str,), "task": (str,), "length": (int,),
                 "sample": (int,), "score": (int, float, type(None)), "resident_bytes": (int, float, type(None))}
CELLS_CSV = "cells.csv"
SUMMARY_CSV = "summary.csv"
MIB = 2.0**20

CELL_COLUMNS = [
    "policy_label", "policy_name", "policy_spec", "budget", "bits", "task", "task_spec", "length", "sample", "num_tokens",
    "metric", "score", "resident_bytes", "offloaded_bytes", "dense_bytes", "prefill_s",
    "decode_ms_per_token", "new_tokens", "shared_prefill", "prediction",
]
SUMMARY_COLUMNS = [
    "policy_label", "policy_name", "policy_spec", "budget", "bits", "task", "length", "metric", "n", "score",
    "resident_mib", "offloaded_mib", "decode_ms_per_token", "prefill_s",
]


def environment() -> dict:
    """Package versions, kvpress's own version, and the git commit of kvpress's checkout.

    ``git_sha`` / ``git_dirty`` are None unless kvpress itself runs from a git checkout (an
    editable install of its repository): a kvpress installed inside some other repository (a
    virtual environment in a project folder) records no commit rather than that project's.
    """
    import importlib.metadata as md

    import kvpress

    versions = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "kvpress-toolkit", "lm_eval", "triton", "accelerate"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    sha, dirty = checkout_commit(Path(kvpress.__file__).resolve())
    return {"versions": versions, "kvpress_version": kvpress.__version__, "git_sha": sha, "git_dirty": dirty}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True).stdout


def checkout_commit(package_init: Path) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git checkout ``package_init`` (kvpress/__init__.py) is tracked in.

    The checkout must be the package's own: its top level is the folder above the package and it
    tracks ``package_init``; otherwise, or without git, ``(None, None)``. ``dirty``: tracked files
    differ from the commit. Committed per-cell logs (``benchmarks/results/logs/``) do not count: a
    run that resumes into them appends to a tracked file, and the code is still the commit's.
    """
    root = package_init.parent.parent
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").strip()).resolve()
        if top != root.resolve():
            return None, None
        _git(root, "ls-files", "--error-unmatch", str(package_init.relative_to(root)))  # fails if untracked
        sha = _git(root, "rev-parse", "HEAD").strip() or None
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", ".",
                           ":(exclude)benchmarks/results/logs").strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None, None
    return sha, dirty


def write_jsonl(path, rows: list[dict]) -> None:
    """Write ``rows`` as JSON lines to ``path`` (parent folders created); benchmark scripts' ``--out``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def cell_key(model: str, policy: dict, task_spec: str, length: int, sample: int, seed: int) -> str:
    """Identity of one cell; a run skips cells whose key is already in the results file."""
    return json.dumps([model, policy, task_spec, int(length), int(sample), int(seed)], sort_keys=True)


class OutDirLockedError(ValueError):
    """Another ``kvpress eval`` holds the lock of this output folder."""


@contextmanager
def lock_out_dir(out_dir):
    """Hold an exclusive ``flock`` on ``out_dir/.kvpress-eval.lock`` for the block.

    Raises `OutDirLockedError` at once (no waiting) when another process holds it: two runs
    appending to one ``results.jsonl`` would compute, and count, every cell twice. Where
    ``fcntl`` does not exist (Windows) the block runs unlocked.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path = Path(out_dir) / LOCK_FILE
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutDirLockedError(f"another kvpress eval is writing to {out_dir} (it holds {path}); wait for it "
                                    "to finish or give another --out") from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def is_record(value) -> bool:
    """Whether ``value`` (one parsed JSON line) is a cell record: an object with `RECORD_FIELDS`."""
    return isinstance(value, dict) and all(
        isinstance(value.get(name, _ABSENT), types) and not isinstance(value.get(name), bool)
        for name, types in RECORD_FIELDS.items())


_ABSENT = object()


def read_records(out_dir) -> list[dict]:
    """Every record of ``out_dir/results.jsonl``; lines that are not records (a line cut by a
    kill, invalid JSON, JSON that is not a cell record) are skipped with one warning counting them."""
    path = Path(out_dir) / RESULTS_FILE
    if not path.exists():
        return []
    records, skipped = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            if is_record(value):
                records.append(value)
            else:
                skipped.append(number)
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
        warnings.warn(f"{path}: skipped {len(skipped)} line(s) that are not result records (line {shown})",
                      UserWarning, stacklevel=2)
    return records


def append_record(out_dir, record: dict) -> None:
    """Append one cell and flush it to disk before the next cell starts."""
    path = Path(out_dir) / RESULTS_FILE
    with open(path, "a+", encoding="utf-8") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:  # a previous run killed mid-line: start on a fresh line
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                f.write("\n")
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _mean(values) -> float:
    values = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


@functools.lru_cache(maxsize=64)
def _label_of_spec(spec: str) -> str:
    name, options = parse_task_spec(spec)
    defaults = parse_task_spec(get_task(name).spec)[1]
    changed = [f"{k}={v}" for k, v in options.items() if defaults.get(k) != v]
    return name + (":" + ",".join(changed) if changed else "")


def task_label(record: dict) -> str:
    """The record's task name, with the options it sets away from their defaults
    (``niah_single:value_type=uuids``), so two configurations of one task stay apart."""
    spec = record.get("task_spec")
    if not spec:
        return record["task"]
    try:
        return _label_of_spec(spec)
    except (KeyError, ValueError):  # a task this version does not know: its full spec
        return spec


def summarize(records: list[dict]) -> list[dict]:
    """Mean score, memory and timings per (policy config, task, length), in first-seen order; two
    configurations of one task (``niah_single`` and ``niah_single:value_type=uuids``) are two tasks."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["policy_label"], task_label(r), r["length"])].append(r)
    rows = []
    for (label, task, length), cells in groups.items():
        first = cells[0]
        rows.append({
            "policy_label": label,
            "policy_name": first["policy_name"],
            "policy_spec": first.get("policy_spec", first["policy_name"]),
            "budget": first.get("budget"),
            "bits": first.get("bits"),
            "task": task,
            "length": length,
            "metric": first.get("metric", "score"),
            "n": len(cells),
            "score": _mean(c["score"] for c in cells),
            "resident_mib": _mean(c["resident_bytes"] for c in cells) / MIB,
            "offloaded_mib": _mean(c.get("offloaded_bytes") for c in cells) / MIB,
            "decode_ms_per_token": _mean(c.get("decode_ms_per_token") for c in cells),
            "prefill_s": _mean(c.get("prefill_s") for c in cells),
        })
    return rows


def write_csvs(out_dir, records: list[dict]) -> tuple[Path, Path]:
    """Write ``cells.csv`` (one row per cell) and ``summary.csv``; return their paths."""
    out_dir = Path(out_dir)
    cells_path, summary_path = out_dir / CELLS_CSV, out_dir / SUMMARY_CSV
    with open(cells_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, CELL_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    with open(summary_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(summarize(records))
    return cells_path, summary_path


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_table(rows: list[dict]) -> str:
    """Fixed-width table: policy, budget/bits, task, length, n, score, resident KV MiB, decode ms/token, prefill s."""
    width = max([16] + [len(r["task"]) for r in rows])
    header = (f"{'policy':<24} {'budget':>6} {'task':<{width}} {'length':>6} {'n':>3} {'score':>8} "
              f"{'KV MiB':>8} {'decode ms/tok':>13} {'prefill s':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        knob = r["budget"] if r.get("budget") is not None else (f"b{r['bits']}" if r.get("bits") is not None else "-")
        score = _fmt(r["score"], ".3f") + ("*" if r.get("metric") == "perplexity" else "")
        lines.append(
            f"{r['policy_label']:<24} {str(knob):>6} {r['task']:<{width}} {r['length']:>6} {r['n']:>3} {score:>8} "
            f"{_fmt(r['resident_mib'], '.2f'):>8} {_fmt(r['decode_ms_per_token'], '.1f'):>13} "
            f"{_fmt(r['prefill_s'], '.2f'):>9}"
        )
    if any(r.get("metric") == "perplexity" for r in rows):
        lines.append("* perplexity (lower is better); other scores: RULER string match in [0, 1]")
    return "\n".join(lines)
