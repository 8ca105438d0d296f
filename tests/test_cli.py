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


def test_check_reads_a_config_and_says_what_runs(tmp_path, capsys):
    """``kvpress check``: from a config alone (no weights), whether the model is supported, its
    policy layers, NoPE layers, and per policy "ready" or the error that policy gives."""
    from conftest import tiny_model
    from transformers import GPT2Config

    tiny_model("smollm3", head_dim=32).config.save_pretrained(tmp_path / "smollm3")
    tiny_model("phi3", partial_rotary_factor=0.5).config.save_pretrained(tmp_path / "phi3")
    GPT2Config(n_layer=1, n_head=2, n_embd=16).save_pretrained(tmp_path / "gpt2")
    assert cli.main(["check", str(tmp_path / "smollm3" / "config.json")]) == 0
    out = capsys.readouterr().out
    assert "supported (smollm3); 2 layers, 4 query / 2 KV heads, head_dim 32" in out
    assert "policy layers: 2 of 2" in out and "layers without RoPE: [1]" in out
    # K and V, 2 layers, 2 KV heads of 32 fp32 channels, 4096 positions (the tiny config's maximum)
    assert f"KV cache at 4096 tokens in float32: {2 * 2 * 4096 * 2 * 32 * 4 / 2**20:.1f} MiB per sequence" in out
    assert "  streaming        ready" in out and "  kivi             ready" in out
    assert "run `kvpress calibrate double_sparsity" in out  # no shipped artifact for this model
    assert cli.main(["check", str(tmp_path / "phi3")]) == 1
    assert "not supported: partial RoPE (partial_rotary_factor=0.5" in capsys.readouterr().out
    assert cli.main(["check", str(tmp_path / "gpt2")]) == 1
    assert "model family 'gpt2' is not supported; supported families: llama" in capsys.readouterr().out
    assert cli.main(["check", str(tmp_path / "missing")]) == 2
    assert "cannot read its config" in capsys.readouterr().err


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
