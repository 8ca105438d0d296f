"""The README stays true: its policy table matches the registry, and CI runs its test command."""

import json
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


def test_readme_quickstart_is_complete_python():
    """The quickstart compiles, defines its input before generating, and names a policy that resolves (running
    it takes a minute on CPU; tests/test_smollm2.py generates with the embedded model under policies)."""
    import kvpress

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    compile(code, "README quickstart", "exec")
    assert code.index("input_ids =") < code.index("model.generate(input_ids")
    for name in re.findall(r'get_policy\("([^"]+)"\)', code):
        kvpress.get_policy(name)


def test_benchmarks_md_is_generated_from_the_result_files():
    from kvpress.evals import benchmarks_md

    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert benchmarks_md.render(ROOT / "benchmarks" / "results") == text, (
        "BENCHMARKS.md is generated: edit benchmarks/results/*.json and run `python -m kvpress.evals.benchmarks_md`"
    )


def test_tables_with_committed_logs_rebuild_from_them():
    """A result file that names its per-cell logs (benchmarks/results/logs/) is what
    `python -m kvpress.evals.result_table` makes of them today."""
    from kvpress.evals import result_table

    files = [p for p in sorted((ROOT / "benchmarks" / "results").glob("*.json"))
             if "logs" in json.loads(p.read_text(encoding="utf-8"))]
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert result_table.rebuild(data) == data, f"{path.name} differs from a rebuild from {data['logs']['folders']}"


def test_a_bad_result_file_is_a_clear_error(tmp_path):
    import json

    import pytest

    from kvpress.evals import benchmarks_md

    good = {"title": "t", "section": "cpu", "order": 1, "command": "c", "machine": "m", "date": "d",
            "columns": ["a", "b"], "rows": [["1", "2"]]}
    (tmp_path / "t.json").write_text(json.dumps(good))
    assert "| 1 | 2 |" in benchmarks_md.render(tmp_path)
    (tmp_path / "t.json").write_text(json.dumps({**good, "rows": [["1"]]}))
    with pytest.raises(ValueError, match="1 cells for 2 columns"):
        benchmarks_md.render(tmp_path)
    (tmp_path / "t.json").write_text(json.dumps({**good, "section": "misc"}))
    with pytest.raises(ValueError, match="allowed"):
        benchmarks_md.render(tmp_path)
    bad = dict(good)
    del bad["command"]
    (tmp_path / "t.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="missing \\['command'\\]"):
        benchmarks_md.render(tmp_path)
