"""kivi / gear static decode steps beyond what tests/test_static_decode.py covers: a prompt shorter
than the window, so the first flush (with the exact sinks) happens inside the compiled steps; other
settings (value rotation, 2 bits, flush_size 16); an eager forward after compiled steps; the
counts a static step leaves; and the bytes the preallocated stores hold."""
import pytest
import torch

import kvpress

from conftest import greedy_steps, planned_after_prompt, random_ids, unplanned_decode

CONFIGS = {
    "kivi": ("kivi", {}),
    "kivi-rotated-2bit": ("kivi", {"rotate_values": True, "bits": 2}),
    "kivi-nosink": ("kivi", {"sink_tokens": 0}),
    "gear": ("gear", {}),
    "gear-flush16-rank1": ("gear", {"flush_size": 16, "rank": 1}),
    "gear-no-outliers": ("gear", {"outliers_per_group": 0, "rank": 0}),
}
STEPS = 60


def _policy(model, config):
    name, overrides = CONFIGS[config]
    return kvpress.policy_class(name).example(kvpress.get_adapter(model)).replace(**overrides)


def _run(model, policy, prompt, compiled: bool):
    """Greedy tokens of STEPS one-token steps (compiled or eager), then the logits of an eager
    4-token forward (a new turn) and the cache."""
    tokens, graphs, cache, logits = greedy_steps(
        model, policy, prompt, STEPS, compiled=compiled, capacity=prompt.shape[1] + STEPS + 4,
        then=lambda cache: model(random_ids(4, seed=9), past_key_values=cache, use_cache=True).logits)
    return tokens, logits, cache, graphs


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("prompt_len", [5, 30])
def test_static_steps_equal_eager_ones(llama, config, prompt_len):
    policy = _policy(llama, config)
    prompt = random_ids(prompt_len, seed=4)
    eager, eager_logits, eager_cache, _ = _run(llama, policy, prompt, compiled=False)
    static, static_logits, static_cache, graphs = _run(llama, policy, prompt, compiled=True)
    assert static == eager
    assert 1 <= graphs <= 2
    # Inductor's fused CPU kernels round differently from eager ops, and by how much depends on the
    # CPU's vector width (2e-4 on one Xeon, below 1e-4 on an EPYC): the tokens must match exactly,
    # the next turn's logits to float noise.
    torch.testing.assert_close(static_logits, eager_logits, atol=1e-3, rtol=1e-3)
    for a, b in zip(static_cache.layers, eager_cache.layers):
        assert (a.seen, a.n_quant, a.win_len) == (b.seen, b.n_quant, b.win_len)
        assert a.n_quant > 0  # flushes happened, the first ones inside the compiled steps for the short prompt
        if hasattr(a, "chunk_starts"):  # gear: the chunks flushed by static steps caught up by the new turn
            assert a.chunk_starts == b.chunk_starts


@pytest.mark.parametrize("config", ["kivi", "gear"])
def test_planned_stores_are_counted(llama, config):
    """A planned capacity preallocates the packed store for every token the window can flush; those
    bytes are state tensors, so ``cache_stats`` counts them."""
    policy = _policy(llama, config)
    layer = planned_after_prompt(llama, policy, capacity=300).layers[0]  # 384 slots
    R, F = layer.residual_length, layer.flush_unit
    assert layer.kc.shape[2] == (384 - R) // F * F and layer.k_win.shape[2] == R + F


@pytest.mark.parametrize("config", ["kivi", "gear"])
def test_unplanned_cache_grows_by_buckets(llama, config):
    """Compiled steps on a cache never planned: the stores grow from bucket to bucket (128, then 256
    tokens here) and the tokens equal eager decoding's. Three graphs per bucket: the traced step
    that reserves it (an unplanned cache keeps its eager sizes until then), then the new shapes
    specialised, then symbolic."""
    policy = _policy(llama, config)
    eager, _, _ = unplanned_decode(llama, policy, compiled=False)
    static, graphs, cache = unplanned_decode(llama, policy, compiled=True)
    layer = cache.layers[0]
    assert static == eager
    assert layer.kc.shape[2] == (256 - layer.residual_length) // layer.flush_unit * layer.flush_unit
    assert graphs <= 6
