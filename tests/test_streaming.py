"""Eviction invariants of window / streaming (StreamingLLM) on a tiny model."""

import pytest
import torch

import kvpress
from kvpress.attention import streaming_attention

from conftest import random_ids


def run(model, policy, ids, new=8):
    with torch.no_grad(), kvpress.apply(model, policy):
        return model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_scores=True)


@pytest.mark.parametrize("name,budget", [("window", 20), ("streaming", 20)])
def test_kept_count_equals_budget_and_memory_is_flat(llama, name, budget):
    policy = kvpress.get_policy(name).with_budget(budget)
    sizes = []
    for length in (30, 90, 270):
        out = run(llama, policy, random_ids(length), new=4)
        cache = out.past_key_values
        assert all(layer.stored_tokens() == budget for layer in cache.layers)
        sizes.append(kvpress.cache_stats(cache).resident_bytes)
    assert sizes[0] == sizes[1] == sizes[2]


def test_sinks_are_never_evicted_and_window_is_most_recent(llama):
    policy = kvpress.get_policy("streaming", sink_tokens=3, window_size=9)
    ids = random_ids(50, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 starts at token 5: its sinks are tokens 5, 6, 7
    with torch.no_grad(), kvpress.apply(llama, policy):
        cache = llama(ids, attention_mask=mask, use_cache=True).past_key_values
    for layer in cache.layers:
        assert sorted(layer.pos[0].tolist()) == [0, 1, 2] + list(range(41, 50))
        assert sorted(layer.pos[1].tolist()) == [5, 6, 7] + list(range(41, 50))
        assert layer.k.shape[2] == 12  # the storage holds exactly sinks + window slots


def test_evicted_tokens_change_the_output(llama):
    ids = random_ids(80)
    full = run(llama, kvpress.get_policy("full"), ids)
    small = run(llama, kvpress.get_policy("streaming", sink_tokens=4, window_size=12), ids)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(full.scores, small.scores))


def test_rerotation_only_matters_once_tokens_are_evicted(llama):
    ids = random_ids(30)
    plain = run(llama, kvpress.get_policy("streaming", sink_tokens=4, window_size=60), ids)
    rerot = run(llama, kvpress.get_policy("streaming", sink_tokens=4, window_size=60, rerotate=True), ids)
    for a, b in zip(plain.scores, rerot.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    ids = random_ids(120)
    plain = run(llama, kvpress.get_policy("streaming", sink_tokens=4, window_size=12), ids)
    rerot = run(llama, kvpress.get_policy("streaming", sink_tokens=4, window_size=12, rerotate=True), ids)
    assert not torch.allclose(plain.scores[0], rerot.scores[0], atol=1e-4)


def test_rerotated_sink_scores_match_keys_rotated_at_in_cache_positions(llama):
    """The query rotation used for sinks equals re-rotating pre-RoPE keys at in-cache slots."""
    adapter = kvpress.get_adapter(llama)
    torch.manual_seed(0)
    sinks, window, total = 2, 5, 20
    h, d = adapter.num_kv_heads, adapter.head_dim
    pre_k = torch.randn(1, h, total, d)
    pre_q = torch.randn(1, adapter.num_heads, 1, d)
    v = torch.randn(1, h, total, d)
    positions = torch.arange(total).view(1, 1, total).float()
    post_k = adapter.rotate(pre_k, positions)
    kept = list(range(sinks)) + list(range(total - window, total))
    q_pos = total - 1
    # Paper's formulation: pre-RoPE keys rotated at in-cache slots 0..S+W-1, query at slot S+W-1.
    slots = torch.arange(sinks + window).view(1, 1, -1).float()
    k_cache = adapter.rotate(pre_k[:, :, kept], slots)
    q_cache = adapter.rotate(pre_q, torch.full((1, 1, 1), float(sinks + window - 1)))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q_cache, k_cache, v[:, :, kept], scale=d**-0.5, enable_gqa=True
    )
    # Ours: stored post-RoPE keys, query at its true position, fed as the last new token.
    q_post = adapter.rotate(pre_q, torch.full((1, 1, 1), float(q_pos)))
    cached = [i for i in kept if i != q_pos]
    out = streaming_attention(
        q_post, post_k[:, :, cached], v[:, :, cached], torch.tensor([cached]),
        post_k[:, :, q_pos:], v[:, :, q_pos:], d**-0.5, q_start=q_pos, row_start=torch.zeros(1, dtype=torch.long),
        sinks=sinks, window=window, sink_query_fn=adapter.rotate,
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_invert_rope_is_exact(llama):
    adapter = kvpress.get_adapter(llama)
    x = torch.randn(2, 2, 33, adapter.head_dim)
    pos = torch.arange(33).view(1, 1, 33) * 97
    back = adapter.invert_rope(adapter.rotate(x, pos), pos)
    torch.testing.assert_close(back, x, atol=1e-4, rtol=1e-5)


def test_streaming_prefill_cost_is_bounded_by_the_window(llama):
    """A long prompt is processed window-by-window: no O(T^2) score matrix is built."""
    ids = random_ids(1500)
    policy = kvpress.get_policy("streaming", sink_tokens=4, window_size=60)
    with torch.no_grad(), kvpress.apply(llama, policy):
        out = llama(ids, use_cache=True)
    assert torch.isfinite(out.logits).all()
    assert out.past_key_values.layers[0].stored_tokens() == 64


def test_decode_decides_visibility_and_sink_writes_on_the_host(llama, monkeypatch):
    """Decode steps pick the dense index over every slot and skip the sink writes from host-side
    counters (no device sync per layer and step); the choices must match what the slots say."""
    import kvpress.window_layers as layers

    calls, dense = [], []
    real_whole, real_decode = layers.whole_cache_index, layers.SinkWindowLayer._decode

    def whole_spy(*args, **kwargs):
        dense.append(True)
        return real_whole(*args, **kwargs)

    def decode_spy(self, q, k_new, v_new, scaling):
        dense.clear()
        out = real_decode(self, q, k_new, v_new, scaling)
        pos = self._visible_pos(self._row_start(q.shape[0], q.device))  # what the slots say, for this step's query
        visible = (pos >= 0) & (self.seen - pos < self.window) | (pos >= 0) & (self._slot[None, :] < self.sinks)
        calls.append((bool(visible.all()), bool(dense)))
        return out

    monkeypatch.setattr(layers, "whole_cache_index", whole_spy)
    monkeypatch.setattr(layers.SinkWindowLayer, "_decode", decode_spy)
    policy = kvpress.get_policy("streaming", sink_tokens=3, window_size=5)
    run(llama, policy, random_ids(2), new=12)  # the sinks fill during decode, then the window
    assert calls and all(vis == host for vis, host in calls)
    assert {host for _, host in calls} == {True, False}

    calls.clear()
    ids = random_ids(3, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :1] = 0  # row 1 starts at token 1: its sinks are tokens 1, 2 and (decoded) 3
    with torch.no_grad(), kvpress.apply(llama, policy):
        out = llama.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             return_dict_in_generate=True)
    assert calls and not any(host and not vis for vis, host in calls)
    for layer in out.past_key_values.layers:
        last = layer.seen - 1
        ring = list(range(last - 4, last + 1))
        assert sorted(layer.pos[0].tolist()) == [0, 1, 2] + ring
        assert sorted(layer.pos[1].tolist()) == [1, 2, 3] + ring


@pytest.mark.parametrize("window,chunk", [(8, 3), (8, None), (50, 16), (200, None)])
def test_sliding_causal_attention_equals_brute_force_window(window, chunk):
    """The SDPA route of the model's sliding layers (query chunks over their reachable keys)
    equals a brute-force masked softmax over every key and the streaming route without sinks,
    with a left-padded row and chunks shorter than, equal to and longer than the window."""
    from kvpress.attention import sliding_causal_attention

    gen = torch.Generator().manual_seed(window)
    B, H_q, H_kv, T, D = 2, 6, 2, 90, 16
    q, k, v = (torch.randn(B, h, T, D, generator=gen, dtype=torch.float64) for h in (H_q, H_kv, H_kv))
    row_start = torch.tensor([0, 13])
    got = sliding_causal_attention(q, k, v, 0.25, window=window, row_start=row_start, query_chunk=chunk)

    pos = torch.arange(T)
    rs = row_start.view(B, 1, 1)
    visible = (pos[None, None] <= pos[None, :, None]) & (pos[None, :, None] - pos[None, None] < window)
    visible = (visible & (pos[None, None] >= rs)) | ((pos[None, :, None] < rs) & (pos[None, None] == pos[None, :, None]))
    kk, vv = (x.repeat_interleave(H_q // H_kv, dim=1) for x in (k, v))
    scores = (q @ kk.transpose(-1, -2) * 0.25).masked_fill(~visible[:, None], float("-inf"))
    want = torch.softmax(scores, -1) @ vv
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    empty = k.new_zeros(B, H_kv, 0, D)
    old = streaming_attention(q, empty, empty, torch.zeros(B, 0, dtype=torch.long), k, v, 0.25, q_start=0,
                              row_start=row_start, sinks=0, window=window)
    torch.testing.assert_close(got, old, rtol=1e-5, atol=1e-6)  # streaming_attention computes in fp32


@pytest.mark.parametrize("sinks,window,chunk", [(4, 8, 3), (16, 8, 5), (3, 50, 16), (20, 20, None), (1, 1, 7)])
def test_sliding_causal_attention_with_sinks_equals_masked_softmax(sinks, window, chunk):
    """With ``sinks`` every query also sees keys 0 .. sinks - 1 (each once, also where the window
    reaches them): a brute-force masked softmax over every key, in values and in gradients."""
    from kvpress.attention import sliding_causal_attention

    gen = torch.Generator().manual_seed(100 * sinks + window)
    H_q, H_kv, T, D = 6, 2, 70, 16
    q, k, v = (torch.randn(1, h, T, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (H_q, H_kv, H_kv))
    got = sliding_causal_attention(q, k, v, 0.25, window=window, sinks=sinks, query_chunk=chunk)

    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & ((j < sinks) | (i - j < window))
    kk, vv = (x.repeat_interleave(H_q // H_kv, dim=1) for x in (k, v))
    scores = (q @ kk.transpose(-1, -2) * 0.25).masked_fill(~visible, float("-inf"))
    want = torch.softmax(scores, -1) @ vv
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    probe = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((got * probe).sum(), (q, k, v))
    wants = torch.autograd.grad((want * probe).sum(), (q, k, v))
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_sliding_causal_attention_rejects_bad_sinks():
    from kvpress.attention import sliding_causal_attention

    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        sliding_causal_attention(q, q, q, 0.5, window=4, sinks=-1)
    with pytest.raises(ValueError, match="row_start"):
        sliding_causal_attention(q, q, q, 0.5, window=4, sinks=2, row_start=torch.tensor([1]))


@pytest.mark.parametrize("name,fields", [("window", {"window_size": 65536}),
                                         ("streaming", {"sink_tokens": 4, "window_size": 65536}),
                                         ("streaming", {"sink_tokens": 65536, "window_size": 65536})])
def test_state_grows_with_the_tokens_seen_not_the_window(llama, name, fields):
    """A 40-token prompt under a 65536-token window (and sinks) holds bytes of the order of the
    prompt; the outputs equal the full cache's (nothing is evicted)."""
    ids = random_ids(40)
    small = run(llama, kvpress.get_policy(name, **fields), ids, new=4)
    stats = kvpress.cache_stats(small.past_key_values)
    dense = run(llama, kvpress.get_policy("full"), ids, new=4)
    assert stats.resident_bytes <= 8 * kvpress.cache_stats(dense.past_key_values).resident_bytes
    assert torch.equal(small.sequences, dense.sequences)
    torch.testing.assert_close(torch.stack(small.scores), torch.stack(dense.scores), atol=1e-4, rtol=0)
    layer = small.past_key_values.layers[0]
    assert layer.k.shape[2] == min(fields.get("sink_tokens", 0), 128) + 128  # RING_STEP slots each


@pytest.mark.parametrize("sinks,window,pad", [(4, 200, 0), (150, 200, 0), (150, 200, 7), (3, 9, 5)])
def test_slots_grow_in_place_across_decode_steps(llama, monkeypatch, sinks, window, pad):
    """Sinks and a ring that grow during decoding (128 -> 150 sink slots, 128 -> 200 ring slots) and
    then wrap attend as storage allocated whole would, with left padding too."""
    from kvpress import window_layers

    ids = random_ids(120, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    policy = kvpress.get_policy("streaming", sink_tokens=sinks, window_size=window)

    def go():
        with torch.no_grad(), kvpress.apply(llama, policy):
            return llama.generate(ids, attention_mask=mask, max_new_tokens=100, do_sample=False,
                                  return_dict_in_generate=True, output_scores=True)

    grown = go()
    assert grown.past_key_values.layers[0].k.shape[2] == sinks + window
    monkeypatch.setattr(window_layers, "RING_STEP", 1 << 20)  # every part allocated whole at once
    whole = go()
    assert torch.equal(grown.sequences, whole.sequences)
    torch.testing.assert_close(torch.stack(grown.scores), torch.stack(whole.scores), atol=1e-5, rtol=0)
