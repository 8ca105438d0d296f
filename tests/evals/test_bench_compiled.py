"""``kvpress.evals.bench_compiled``: generate's compiled decode under a policy, on CPU with the eager backend."""

import json

from kvpress.evals.bench_compiled import main


def test_compiled_generate_matches_eager_and_writes_rows(tmp_path, capsys):
    out = tmp_path / "compiled.json"
    assert main(["--length", "24", "--new-tokens", "3", "--iters", "1", "--backend", "eager", "--policies",
                 "full,kivi,zipcache", "--out", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["full"]["tokens_equal"] is True and rows["full"]["compiled_ms"] is not None
    assert rows["kivi"]["tokens_equal"] is True and rows["kivi"]["compiled_ms"] is not None
    assert rows["zipcache"]["tokens_equal"] is True and rows["zipcache"]["compiled_ms"] is not None
    assert "transformers StaticCache" in capsys.readouterr().out


def test_bad_sizes_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--new-tokens", "1"])
    assert "--new-tokens must be >= 2" in capsys.readouterr().err
