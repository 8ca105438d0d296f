"""The kvpress command line: registry listing, generate, demo, and errors before any model loads."""

import pytest

import kvpress
from kvpress import cli


def test_policies_lists_every_registered_policy(capsys):
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in kvpress.list_policies():
        assert f"\n{name} " in out
        assert kvpress.policy_class(name).description in out


def test_generate_rejects_bad_policy_input_before_loading(tmp_path, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("model must not load")

    monkeypatch.setattr(kvpress, "load_model", no_load)
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    assert cli.main(["generate", "--policy", "nope", "--prompt-file", str(prompt)]) == 2
    assert "known policies" in capsys.readouterr().err
    assert cli.main(["generate", "--policy", "window", "-o", "window_size=-3", "--prompt-file", str(prompt)]) == 2
    assert "window_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--policy", "window", "-o", "oops", "--prompt-file", str(prompt)])


@pytest.mark.smollm2
def test_generate_and_demo_on_smollm2(tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The pass key is 4821. Remember it. What is the pass key?")
    assert cli.main(["generate", "--policy", "streaming", "--budget", "64", "--prompt-file", str(prompt), "--max-new-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert "4821" in captured.out
    assert "[streaming]" in captured.err and "ms/token" in captured.err
    assert cli.main(["demo", "--length", "600", "--budget", "64", "--policies", "window,full"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("full ", "window "))]
    assert [line.split()[0] for line in lines] == ["full", "window"]  # the reference first
    assert lines[0].split()[1] == "yes"  # full finds the needle at 600 tokens
    snap = ["generate", "--policy", "snapkv", "--budget", "40", "--prompt-file", str(prompt), "--max-new-tokens", "8"]
    assert cli.main(snap) == 0
    one = capsys.readouterr().out
    assert cli.main(snap + ["--prefill-chunk-size", "8"]) == 0
    assert capsys.readouterr().out == one  # the prompt in 8-token forwards, selected at its end as in one


@pytest.mark.parametrize("module", ["kvpress", "kvpress.cli"])
def test_python_dash_m_knows_the_eval_subcommands(module):
    # `accelerate launch -m kvpress.cli lm-eval ...` (multi-GPU lm-eval) runs the module as
    # __main__; its subcommands must be the same as the console script's.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", module, "eval", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--policies" in done.stdout and "--budgets" in done.stdout
