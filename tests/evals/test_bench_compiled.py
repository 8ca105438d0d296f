"""``kvpress.evals.bench_compiled``: generate's compiled decode under a policy, on CPU with the eager backend."""

import json

import pytest

from kvpress.evals.bench_compiled import main


def test_compiled_generate_matches_eager_and_writes_rows(tmp_path, capsys):
    out = tmp_path / "compiled.json"
    assert main(["--length", "40", "--new-tokens", "6", "--backend", "eager", "--budget", "24", "--policies",
                 "full,kivi,zipcache,shadowkv", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    for name in ("full", "kivi", "zipcache", "shadowkv"):
        assert rows[name]["tokens_equal"] is True and rows[name]["compiled_ms"] > 0, rows[name]
        assert rows[name]["vs_full"] > 0 and rows[name]["resident_mib"] > 0
    # one dense prefill serves the policies whose prefill is plain attention; zipcache prefills itself
    assert rows["shadowkv"]["shared_prefill"] is True and rows["zipcache"]["shared_prefill"] is False
    assert rows["transformers StaticCache"]["compiled_ms"] > 0 and data["config"]["budget"] == 24
    assert "shared dense prefill" in capsys.readouterr().out


def test_result_file_is_a_benchmarks_table(tmp_path):
    from kvpress.evals.benchmarks_md import load

    result = tmp_path / "compiled_tiny.json"
    assert main(["--length", "24", "--new-tokens", "5", "--backend", "eager", "--no-static-baseline", "--policies",
                 "full,window", "--result", str(result), "--title", "tiny"]) == 0
    data = load(result)
    assert data["title"] == "tiny" and data["section"] == "cpu"
    assert [r[0] for r in data["rows"]] == ["`full`", "`window`"]
    assert data["command"] == ("python -m kvpress.evals.bench_compiled --length 24 --new-tokens 5 --backend eager "
                               "--no-static-baseline --policies full,window --title tiny")


@pytest.mark.parametrize("args, message", [(["--new-tokens", "4"], "--new-tokens must be >= "),
                                           (["--skip-steps", "0"], "--skip-steps must be >= 1"),
                                           (["--policies", "full,quest:page_size=0"], "allowed: [1, 8, 16")])
def test_bad_sizes_are_refused(capsys, args, message):
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err
