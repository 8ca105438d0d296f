"""What the adapter promises per family: its RoPE is the model's, and unsupported layouts are refused."""

import importlib

import pytest
import torch

import kvpress

from conftest import CONTRACT_MODELS, FAMILIES, contract_model, random_ids, sliding_model, tiny_model


def _cached_keys(model, ids):
    out = model(ids, use_cache=True)
    return [layer.keys.clone() for layer in out.past_key_values.layers]


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_rope_is_the_models_own(family, monkeypatch):
    """The adapter's rotation maps the keys the model caches without RoPE onto the keys it caches
    with RoPE, and its inverse maps them back: whatever the family does before RoPE (q/k norms,
    multipliers) ShadowKV's and StreamingLLM's pre-RoPE keys are the model's."""
    model = tiny_model(family, seed=3)
    adapter = kvpress.get_adapter(model)
    assert (adapter.family, adapter.num_layers, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim) == (
        family, 2, 4, 2, 16)
    ids = random_ids(40, seed=1)
    with torch.no_grad():
        post = _cached_keys(model, ids)
        modeling = importlib.import_module(type(adapter.attention_modules()[0]).__module__)
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", lambda q, k, *args, **kwargs: (q, k))
        pre = _cached_keys(model, ids)
    pos = torch.arange(ids.shape[1])[None, None, :]
    # only layer 0 sees the same input in both runs (later layers see what RoPE changed upstream)
    for k_post, k_pre in zip(post[:1], pre[:1]):
        assert k_post.shape == (1, 2, 40, 16)
        assert not torch.allclose(k_post, k_pre, atol=1e-3)  # RoPE did rotate them
        torch.testing.assert_close(adapter.invert_rope(k_post, pos), k_pre, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(adapter.rotate(k_pre, pos), k_post, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", CONTRACT_MODELS)
def test_full_under_apply_equals_the_unpatched_model(family):
    """Our cache and attention function reproduce each family's own attention (its scaling,
    norms, masks): same logits for a prompt, same greedy continuation and scores. ``llama-g16``:
    16 query heads per KV head, above the compiled kernels' group limit (the torch paths run it)."""
    model = contract_model(family, seed=4)
    ids = random_ids(33, seed=2)
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        ref_logits, ref = model(ids).logits, model.generate(ids, **kw)
        with kvpress.apply(model, kvpress.get_policy("full")):
            logits, out = model(ids, use_cache=True).logits, model.generate(ids, **kw)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-4, rtol=0)
    assert isinstance(out.past_key_values, kvpress.PolicyCache)


@pytest.mark.parametrize("family, overrides", [
    ("mistral", dict(sliding_window=4096)),  # Mistral v0.1's config: every layer slides
    ("mixtral", dict(sliding_window=4096)),
    ("phi3", dict(sliding_window=2047, pad_token_id=0)),  # Phi-3-mini-4k's window
    ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)),
])
def test_models_whose_every_layer_slides_are_refused(family, overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="sliding-window attention in every layer.*no full-attention layer"):
        kvpress.get_adapter(model)
    with pytest.raises(ValueError, match="sliding-window"):
        with kvpress.apply(model, kvpress.get_policy("full")):
            pass
    assert model.config.to_dict() == before  # refused before anything was patched


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe", "qwen3", "gemma3_text", "olmo3", "ministral"])
def test_sliding_window_layers_run_as_the_model_runs_them(family):
    """Layers the model limits to a window keep that window exactly under any policy: ``full``
    equals the unpatched model on prompts longer than the window (left-padded batch, with and
    without a cache), and a policy's cache holds its own layers for the full-attention layers only."""
    from kvpress.layers import SlidingWindowLayer

    model = sliding_model(family, seed=5)
    adapter = kvpress.get_adapter(model)
    assert adapter.sliding_windows == (None, None, 8) and adapter.policy_layers == (0, 1)
    ids = torch.cat([random_ids(30, seed=3), random_ids(30, seed=4)])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
              output_scores=True)
    with torch.no_grad():
        ref_logits, ref = model(ids, attention_mask=mask).logits, model.generate(ids, **kw)
        with kvpress.apply(model, kvpress.get_policy("full")):
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            out = model.generate(ids, **kw)
        no_window = tiny_model(family, layers=3, seed=5)  # same weights, every layer full
        assert not torch.allclose(no_window(ids, attention_mask=mask).logits[mask.bool()],
                                  ref_logits[mask.bool()], atol=1e-3)  # the window matters at this length
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], atol=1e-5, rtol=0)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-4, rtol=0)

    cache = kvpress.make_cache(model, kvpress.get_policy("streaming", sink_tokens=2, window_size=12))
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[2] == "SlidingWindowLayer" and "SlidingWindowLayer" not in kinds[:2]
    with torch.no_grad(), kvpress.apply(model, cache.policy):
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert isinstance(cache.layers[2], SlidingWindowLayer) and cache.layers[2].k.shape[2] == 8
    # the dense reference is the model's own cache: 30 tokens in layers 0-1, its 8-token window in layer 2
    stats = kvpress.cache_stats(cache)
    assert stats.dense_bytes == 2 * (30 + 30 + 8) * 2 * adapter.num_kv_heads * adapter.head_dim * 4


def test_policies_that_name_layers_respect_sliding_ones():
    from kvpress.policies._duo_calibrate import CalibrationSettings, calibrate

    model = sliding_model(seed=6)
    adapter = kvpress.get_adapter(model)
    with pytest.raises(ValueError, match=r"selection_layer=2 is a sliding-window layer.*full-attention layer: \[0, 1\]"):
        kvpress.get_policy("tidal", selection_layer=2).check_model(adapter)
    # duo's calibration gates the full-attention layers; the sliding one keeps the model's window
    # (so with every gate open the gated model is the model itself: no distillation loss)
    ids = random_ids(40, seed=2)
    settings = CalibrationSettings(steps=2, sink_tokens=2, window_size=4, init_logit=30.0, lr=0.0)
    gates, info = calibrate(model, settings=settings, samples=[(ids, 30)] * 2, log=lambda *_: None)
    assert gates.shape == (3, 2) and all(h["distill"] < 1e-6 for h in info["history"])
    settings = CalibrationSettings(steps=2, sink_tokens=2, window_size=4)
    gates, _ = calibrate(model, settings=settings, samples=[(ids, 30)] * 2, log=lambda *_: None)
    assert bool((gates[2] == torch.sigmoid(torch.tensor(settings.init_logit))).all())  # untouched: unused
    assert not bool((gates[:2] == torch.sigmoid(torch.tensor(settings.init_logit))).all())
    # duo's sparsity counts the heads of the full-attention layers only
    gates = ((0.1, 0.9), (0.2, 0.8), (0.0, 0.0))
    mask = kvpress.get_policy("duo", gates=gates, sparsity=0.5).retrieval_mask(adapter)
    assert mask.tolist() == [[False, True], [False, True], [True, True]]


@pytest.mark.parametrize("family, overrides, match", [
    ("phi3", dict(partial_rotary_factor=0.5), r"partial RoPE \(partial_rotary_factor=0.5: 8 of head_dim 16"),
    ("stablelm", dict(), "family 'stablelm' is not supported; supported families: llama, mistral"),
])
def test_layouts_the_policies_cannot_rotate_are_refused(family, overrides, match):
    """RoPE over part of the head (Phi-4-mini; StableLM, not a supported family either) would make the adapter's rotation -- ShadowKV's
    pre-RoPE keys, StreamingLLM's re-rotated sinks -- wrong: refused before anything is patched."""
    model = tiny_model(family, **overrides)
    with pytest.raises(ValueError, match=match):
        with kvpress.apply(model, kvpress.get_policy("full")):
            pass
    assert model.base_model.layers[0].self_attn.forward.__func__ is type(model.base_model.layers[0].self_attn).forward


def test_nope_layers_rotate_by_the_identity(monkeypatch):
    """SmolLM3 leaves RoPE out of some layers: the adapter finds them, and its rotation there is the
    identity, as the model's own keys show (layer 0 is the NoPE one here, so both runs see its input)."""
    model = tiny_model("smollm3", seed=3, no_rope_layers=[0, 1])
    adapter = kvpress.get_adapter(model)
    assert adapter.nope_layers == (0,) and not adapter.has_rope(0) and adapter.has_rope(1)
    ids = random_ids(40, seed=1)
    with torch.no_grad():
        post = _cached_keys(model, ids)[0]
        modeling = importlib.import_module(type(adapter.attention_modules()[0]).__module__)
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", lambda q, k, *args, **kwargs: (q, k))
        pre = _cached_keys(model, ids)[0]
    pos = torch.arange(40)[None, None, :]
    torch.testing.assert_close(post, pre, atol=0, rtol=0)
    torch.testing.assert_close(adapter.rotate(pre, pos, 0), post, atol=0, rtol=0)
    torch.testing.assert_close(adapter.invert_rope(post, pos, 0), pre, atol=0, rtol=0)
    assert not torch.allclose(adapter.rotate(pre, pos, 1), post, atol=1e-3)  # a RoPE layer's rotation is not
    assert not adapter.inv_freq("cpu", 0).any() and adapter.inv_freq("cpu", 1).any()
    with pytest.raises(ValueError, match="no layer of this model applies RoPE"):
        kvpress.get_adapter(tiny_model("smollm3", no_rope_layers=[0, 0]))


def test_attention_logit_soft_capping_is_refused():
    model = tiny_model("gemma3_text", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="soft-capping .*attn_logit_softcapping=50.0"):
        kvpress.get_adapter(model)


def test_gemma3_policies_rotate_with_the_full_attention_layers_rope():
    """Gemma 3 rotates sliding layers with a local base (10k) and full layers with 1M: the adapter's
    RoPE, which ShadowKV and StreamingLLM use on the policy's (full-attention) layers, is the latter."""

    model = sliding_model("gemma3_text", seed=2)
    rotary = model.base_model.rotary_emb
    adapter = kvpress.get_adapter(model)
    assert not torch.equal(rotary.full_attention_inv_freq, rotary.sliding_attention_inv_freq)
    assert torch.equal(adapter.inv_freq("cpu"), rotary.full_attention_inv_freq)


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "phi3", "gemma3_text-sliding"])
def test_observed_attention_sees_what_the_model_attends_with(family):
    """``observed_attention`` shows each layer's post-RoPE q and k -- after q/k norms (Qwen3, OLMo 2),
    fused projections (Phi-3) -- and attends as the model does: same logits, same keys the model
    caches, the attention implementation restored on exit."""
    from kvpress.patching import observed_attention

    model = contract_model(family, seed=7)
    ids = random_ids(30, seed=5)
    seen = {}
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        with observed_attention(model, lambda i, q, k: seen.__setitem__(i, (q.clone(), k.clone()))) as adapter:
            logits = model(ids, use_cache=False).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
    assert sorted(seen) == list(range(adapter.num_layers))
    for i, layer in enumerate(ref.past_key_values.layers):
        q, k = seen[i]
        assert q.shape == (1, adapter.num_heads, 30, adapter.head_dim)
        kept = layer.keys.shape[2]  # a sliding layer caches only its window's last tokens
        torch.testing.assert_close(k[:, :, 30 - kept:], layer.keys, atol=1e-6, rtol=0)
