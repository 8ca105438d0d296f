"""Named presets resolve to valid policies, and the README recommends only names that resolve."""

import json
import pathlib
import re

import pytest

import kvpress
from kvpress import presets
from kvpress.registry import parse_policy_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", presets.list_presets())
def test_preset_resolves_to_its_spec(name):
    preset = presets.PRESETS[name]
    policy = kvpress.get_policy(name)
    assert policy == kvpress.get_policy(preset.spec)
    policy_name, fields = parse_policy_spec(preset.spec)
    assert policy.name == policy_name and fields, "a preset names a policy and sets its fields"
    assert "-" in name and name not in kvpress.list_policies()


@pytest.mark.parametrize("name", presets.list_presets())
def test_preset_names_a_committed_measurement(name):
    result = ROOT / "benchmarks" / "results" / f"{presets.PRESETS[name].measured}.json"
    assert result.is_file(), f"preset {name} cites {result.name}, which does not exist"
    policy_name, _ = parse_policy_spec(presets.PRESETS[name].spec)
    assert policy_name in result.read_text(encoding="utf-8")


def test_overrides_apply_on_top_of_a_preset():
    policy = kvpress.get_policy("double-sparsity-256", budget=512)
    assert policy.budget == 512 and policy.rerank == 8 and policy.tail_chunk == 64
    assert kvpress.get_policy("kivi-4bit", residual_length=64).bits == 4


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="presets: "):
        presets.preset_spec("kivi-3bit")
    with pytest.raises(ValueError, match="known policies"):
        kvpress.get_policy("kivi-3bit")


def test_describe_lists_every_preset_with_its_spec():
    text = "\n".join(presets.describe())
    for preset in presets.PRESETS.values():
        assert preset.name in text and preset.spec in text
    assert all(len(line) <= 120 for line in presets.describe())


def test_readme_recommends_only_names_that_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Which policy should I use?", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| goal")]
    assert len(rows) >= 5
    for row in rows:
        names = re.findall(r"`([^`]+)`", row.split("|")[2])
        assert names, f"README table row names no configuration: {row}"
        for name in names:
            kvpress.get_policy(name)  # raises on a name or spec that does not resolve


def test_results_files_are_valid_json():
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        assert {"title", "command", "machine", "date", "columns", "rows"} <= set(data), path.name


def test_kvpress_policies_lists_the_presets(capsys):
    from kvpress import cli

    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    for preset in presets.PRESETS.values():
        assert preset.name in out and preset.spec in out


# presets whose policy reads a calibration artifact made for SmolLM2 run on SmolLM2 only
NEED_SMOLLM2 = {"duo-50", "double-sparsity-256"}


@pytest.mark.parametrize("name", [n for n in presets.list_presets() if n not in NEED_SMOLLM2])
def test_preset_generates_on_a_tiny_model(name):
    """Each preset runs as given on a small random model with SmolLM2's head_dim (64)."""
    import torch
    from conftest import tiny_model

    llama = tiny_model("llama", head_dim=64)
    ids = torch.randint(2, 250, (1, 300), generator=torch.Generator().manual_seed(0))
    with kvpress.apply(llama, kvpress.get_policy(name)):
        out = llama.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 304)
    assert kvpress.cache_stats(out).tokens > 0


def test_lm_eval_policy_argument_takes_a_preset():
    from kvpress.evals.lm_eval_model import build_policy

    assert build_policy("double-sparsity-256", budget=512) == kvpress.get_policy("double-sparsity-256", budget=512)
    assert build_policy("kivi-4bit") == kvpress.get_policy("kivi:bits=4")
