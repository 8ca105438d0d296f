"""zipcache's static decode step beyond what tests/test_static_decode.py covers: a prompt shorter
than the window (the first flush, with the value normaliser and the refined channels, inside the
compiled steps); refined channels, rotated values, a salient ratio whose flushes take 0 or 8
tokens; eager steps before compiled ones and an eager forward after them; the probes the slots
give back; the split table; and the bytes the preallocated stores and slots hold."""
import pytest
import torch

import kvpress
from kvpress.policies._zipcache_static import salient_target

from conftest import greedy_steps, planned_after_prompt, random_ids, unplanned_decode

CONFIGS = {
    "example": {},
    "refined-flush16": {"refine_key_channels": 8, "flush_size": 16, "group_size": 8},
    "rotated": {"rotate_values": True},
    "ratio-0.125": {"salient_ratio": 0.125},
}
STEPS = 60


def _policy(model, overrides):
    return kvpress.policy_class("zipcache").example(kvpress.get_adapter(model)).replace(**overrides)


def _run(model, policy, prompt, compiled: bool, eager_first: int = 0):
    """Greedy tokens of STEPS one-token steps (the first ``eager_first`` eager, the rest compiled
    or eager), the cache's probes as the eager path then holds them, then the logits of an eager
    4-token forward (a new turn) and the cache."""
    def then(cache):
        probes = []
        for layer in cache.layers:
            layer._from_static()
            probes.append((layer.probe_pos, layer.probe_rand, layer.probe_q.clone(), layer.hi.n, layer.lo.n))
        return probes, model(random_ids(4, seed=9), past_key_values=cache, use_cache=True).logits

    tokens, graphs, cache, (probes, logits) = greedy_steps(model, policy, prompt, STEPS, compiled=compiled,
                                                           capacity=prompt.shape[1] + STEPS + 4,
                                                           eager_first=eager_first, then=then)
    return tokens, probes, logits, cache, graphs


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("prompt_len", [5, 30])
def test_static_steps_equal_eager_ones(llama, config, prompt_len):
    policy = _policy(llama, CONFIGS[config])
    prompt = random_ids(prompt_len, seed=4)
    eager, eager_probes, eager_logits, eager_cache, _ = _run(llama, policy, prompt, compiled=False)
    static, static_probes, static_logits, static_cache, graphs = _run(llama, policy, prompt, compiled=True)
    assert static == eager
    assert 1 <= graphs <= 2
    for (pos, rand, q, hi_n, lo_n), (e_pos, e_rand, e_q, e_hi, e_lo) in zip(static_probes, eager_probes):
        assert (pos, rand, hi_n, lo_n) == (e_pos, e_rand, e_hi, e_lo)  # the probe set the eager path keeps
        torch.testing.assert_close(q, e_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(static_logits, eager_logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(static_cache.layers, eager_cache.layers):
        assert (a.seen, a.n_quant, a.win_len, a.hi.n, a.lo.n) == (b.seen, b.n_quant, b.win_len, b.hi.n, b.lo.n)
        assert a.n_quant > 0 and a.hi.n > 0 and a.lo.n > 0
        assert a.probe_pos == b.probe_pos
        if a.lo.refine:  # chosen at the first flush: inside the compiled steps for the short prompt
            assert torch.equal(a.lo.ridx, b.lo.ridx)
        torch.testing.assert_close(a.vn, b.vn)


def test_eager_steps_then_compiled_ones(llama):
    """Eager decode steps on a planned cache keep the probe slots current: compiled steps that
    follow them generate what eager decoding does."""
    policy = _policy(llama, {})
    prompt = random_ids(30, seed=7)
    eager = _run(llama, policy, prompt, compiled=False)[0]
    mixed, _, _, _, graphs = _run(llama, policy, prompt, compiled=True, eager_first=25)
    assert mixed == eager and 1 <= graphs <= 2


@pytest.mark.parametrize("ratio,group,flush", [(0.125, 8, 8), (0.3, 8, 16), (0.5, 16, 32), (1.0, 8, 8), (0.0, 8, 8)])
def test_high_precision_count_follows_the_flushed_count(llama, ratio, group, flush):
    """What the static split's table rests on: after every eager flush, from the prompt's on, the
    high-precision store holds ``salient_target(flushed)`` tokens."""
    policy = _policy(llama, {"salient_ratio": ratio, "group_size": group, "flush_size": flush})
    with torch.no_grad(), kvpress.apply(llama, policy):
        cache = kvpress.make_cache(llama, policy)
        out = llama(random_ids(50, seed=3), past_key_values=cache, use_cache=True)
        tok, counts = out.logits[:, -1:].argmax(-1), set()
        for _ in range(80):
            tok = llama(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                assert layer.hi.n == salient_target(policy, layer.n_quant)
                assert layer.hi.n + layer.lo.n == layer.n_quant
                counts.add(layer.hi.n)
    assert len(counts) > 1 or ratio == 0.0


def test_planned_stores_and_slots_are_counted(llama):
    """A planned capacity reserves each store for the most tokens it can hold while the window
    flushes, and the probe slots and split table beside them; ``cache_stats`` counts them all."""
    policy = _policy(llama, {"salient_ratio": 0.25})
    layer = planned_after_prompt(llama, policy, capacity=300).layers[0]  # 384 slots
    R, F = layer.residual_length, layer.flush_unit
    packed = (384 - R) // F * F
    steps = range(0, packed + 1, F)
    assert layer.hi.t["kc"].shape[2] == max(salient_target(policy, n) for n in steps)
    assert layer.lo.t["kc"].shape[2] == max(n - salient_target(policy, n) for n in steps)
    assert layer.k_win.shape[2] == R + F
    tensors = layer.state_tensors()
    assert tensors["probe_slots_q"].shape[2] == policy.probe_random + policy.probe_recent
    assert tensors["salient_counts"].shape[0] == packed // F + 2


def test_unplanned_cache_grows_by_buckets(llama):
    """Compiled steps on a cache never planned: the first traced step makes the probe slots from
    the eager probes and reserves the stores, which grow from bucket to bucket (128, then 256
    tokens), and the tokens equal eager decoding's (graphs as for kivi: three per bucket)."""
    policy = _policy(llama, {})
    eager, _, _ = unplanned_decode(llama, policy, compiled=False)
    static, graphs, cache = unplanned_decode(llama, policy, compiled=True)
    layer = cache.layers[0]
    assert static == eager
    assert layer.zs.slots == (256 - layer.residual_length) // layer.flush_unit * layer.flush_unit
    assert graphs <= 6
