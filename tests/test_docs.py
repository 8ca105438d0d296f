"""The README stays true: its policy table matches the registry, and CI runs its test command."""

import pathlib
import re

from kvpress.docs import render_readme

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_policy_table_matches_registry():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert render_readme(text) == text, "run `python -m kvpress.docs` to refresh the README policy table"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- test-command -->\n```bash\n(.+)\n```", readme)
    assert match and "pytest" in match.group(1) and "torch==2.13.0" in match.group(1)
    assert "README.md" in (ROOT / ".ci" / "run").read_text()
