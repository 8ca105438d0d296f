"""Write BENCHMARKS.md from the result files in ``benchmarks/results/`` (``python -m kvpress.evals.benchmarks_md``).

Each result file is one table, as JSON::

    {"title": str, "section": one of SECTIONS, "order": int,
     "command": str or [str, ...], "machine": str, "date": str, "commit": str (optional),
     "columns": [str, ...], "rows": [[str, ...], ...], "notes": [str, ...],
     "logs": {"folders": [str, ...], ...} (optional: the committed per-cell logs the table was
             built from, see :mod:`kvpress.evals.result_table`)}

BENCHMARKS.md is this script's output and nothing else (``tests/test_docs.py`` checks it), so a
new measurement is a new or changed result file, and the page follows. Superseded results are
replaced, not kept: git holds the history.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

SECTIONS = {
    "quality": "Quality on SmolLM2-135M (CPU)",
    "gemma": "Quality on Gemma 3 270M (CPU)",
    "memory": "Memory",
    "cpu": "Decode speed on CPU",
    "gpu": "GPU",
}
WIDTH = 118
REQUIRED = ("title", "section", "order", "command", "machine", "date", "columns", "rows")

HEADER = """# Benchmarks

Current measurements only, one table per file in `benchmarks/results/`; this page is generated
from them (`python -m kvpress.evals.benchmarks_md`), so edit the result files, not this page.
Each table gives the command that made it, the machine and the date. Quality tables score
SmolLM2-135M-Instruct (8k context) or the base Gemma 3 270M (32k context, completion prompts;
fp32, greedy) on the offline task suite (`kvpress eval`): "`full`'s needles kept" (or "answers
kept") counts the samples whose needle `full` answers that the policy answers too, and
"x `full`" / "of `full`" is the policy's score over `full`'s on the same samples (intervals:
`kvpress report`'s 95% paired bootstrap). Budgets are tokens attended per KV head per decode
step, sinks and windows included. The CPU is a shared 2-core machine: compare rows within one
table, not across tables.
"""


def load(path: pathlib.Path) -> dict:
    """Read and check one result file (ValueError naming the file and what is wrong)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path.name}: not valid JSON ({err})") from None
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{path.name}: missing {missing}; a result file needs {list(REQUIRED)}")
    if data["section"] not in SECTIONS:
        raise ValueError(f"{path.name}: section {data['section']!r}; allowed: {sorted(SECTIONS)}")
    width = len(data["columns"])
    for row in data["rows"]:
        if len(row) != width:
            raise ValueError(f"{path.name}: row {row} has {len(row)} cells for {width} columns")
    return data


def _numeric(column: list[str]) -> bool:
    cells = [re.sub(r"[*`x%]", "", c).strip() for c in column if c.strip()]
    return bool(cells) and all(re.fullmatch(r"[-+>=<~ ]*[0-9][0-9.,e+-]*", c) for c in cells)


def _command_lines(command: str) -> list[str]:
    """A shell command broken with backslashes to fit the page (comment lines as they are)."""
    if command.startswith("#") or len(command) <= WIDTH:
        return [command]
    pieces = textwrap.wrap(command, width=WIDTH - 6, break_long_words=False, break_on_hyphens=False)
    lines = [piece + " \\" for piece in pieces[:-1]] + [pieces[-1]]
    return lines[:1] + ["    " + line for line in lines[1:]]


def _prose(text: str, first: str = "", rest: str = "") -> list[str]:
    return textwrap.wrap(text, width=WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def render_table(data: dict) -> str:
    """Markdown for one result: heading, command, machine and date, table, notes."""
    commands = data["command"] if isinstance(data["command"], list) else [data["command"]]
    when = data["date"] + (f", commit {data['commit']}" if data.get("commit") else "")
    lines = [f"### {data['title']}", "", "```bash"]
    for command in commands:
        lines.extend(_command_lines(command))
    lines += ["```", "", *_prose(f"{data['machine']}; {when}."), ""]
    columns = data["columns"]
    align = ["---:" if _numeric([row[i] for row in data["rows"]]) else "---" for i in range(len(columns))]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "|".join(align) + "|")
    lines.extend("| " + " | ".join(row) + " |" for row in data["rows"])
    if data.get("notes"):
        lines.append("")
        for note in data["notes"]:
            lines.extend(_prose(note, "- ", "  "))
    if data.get("logs"):
        folders = ", ".join(f"`{folder}/`" for folder in data["logs"]["folders"])
        lines += ["", *_prose(f"Per-cell logs (each answer with its score, KV bytes and timings): {folders}; "
                              "`python -m kvpress.evals.result_table` rebuilds this table from them.")]
    return "\n".join(lines)


def render(results_dir: pathlib.Path = RESULTS) -> str:
    """The whole BENCHMARKS.md text for the result files in ``results_dir``."""
    tables = [load(p) for p in sorted(results_dir.glob("*.json"))]
    if not tables:
        raise ValueError(f"no result files (*.json) in {results_dir}")
    parts = [HEADER.rstrip("\n")]
    for section, heading in SECTIONS.items():
        chosen = sorted((t for t in tables if t["section"] == section), key=lambda t: (t["order"], t["title"]))
        if chosen:
            parts.append(f"## {heading}")
            parts.extend(render_table(t) for t in chosen)
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="folder of result JSON files")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--check", action="store_true", help="only check that --out is up to date (exit 1 if not)")
    args = parser.parse_args(argv)
    text = render(args.results)
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run `python -m kvpress.evals.benchmarks_md`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} from {len(list(args.results.glob('*.json')))} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
