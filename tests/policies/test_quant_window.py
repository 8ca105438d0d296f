"""kivi / zipcache / gear: the full-precision window grows with the tokens it holds, not with
``residual_length`` / ``flush_size``, and its growth changes no output."""
import pytest
import torch

import kvpress
from kvpress.compat import cache_kwargs
from kvpress.policies import _quant_window
from kvpress.policies._quant_storage import WINDOW_STEP, window_slots

from conftest import random_ids

# the tiny llama's head_dim is 16: groups of 16 tokens / channels
LARGE_WINDOW = ("kivi:group_size=16:residual_length=65536",
                "zipcache:group_size=16:value_group_size=16:flush_size=65536",
                "gear:group_size=16:flush_size=65536")
# windows of at most 136 / 164 tokens: 128 slots, then the limit
SMALL = ("kivi:group_size=16:residual_length=120",
         "zipcache:group_size=16:value_group_size=16:residual_length=100:flush_size=64",
         "gear:group_size=16:residual_length=100:flush_size=64")


def generate(model, ids, spec, new):
    with torch.no_grad(), kvpress.apply(model, kvpress.get_policy(spec)):
        return model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                              output_scores=True)


def test_window_slots_double_up_to_the_limit():
    assert [window_slots(t, 65536) for t in (0, 1, 128, 129, 300, 65535)] == [128, 128, 128, 256, 512, 65536]
    assert window_slots(20, 24) == 24 and window_slots(24, 24) == 24  # a limit under WINDOW_STEP
    assert window_slots(1000, 300) == 1000  # a long prompt waits in the window for its flush


@pytest.mark.parametrize("spec", LARGE_WINDOW)
def test_short_prompt_holds_about_fulls_bytes(llama, spec):
    ids = random_ids(40, seed=3)
    full = kvpress.cache_stats(generate(llama, ids, "full", 1)).resident_bytes
    out = generate(llama, ids, spec, 1)
    stats = kvpress.cache_stats(out)
    layer = out.past_key_values.layers[0]
    assert layer.n_quant == 0 and layer.k_win.shape[2] == WINDOW_STEP
    # the configured window would be 65536 + 16 or 128 + 65536 slots: 512x full's bytes and more
    assert stats.resident_bytes <= 1.5 * full, (stats.resident_bytes, full)


@pytest.mark.parametrize("spec", LARGE_WINDOW)
def test_window_grows_while_decoding_and_equals_full(llama, spec):
    ids = random_ids(100, seed=4)
    ref = generate(llama, ids, "full", 40)
    out = generate(llama, ids, spec, 40)  # 139 tokens: the window doubles from 128 to 256 slots mid-decode
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    layer = out.past_key_values.layers[0]
    assert (layer.n_quant, layer.win_len, layer.k_win.shape[2]) == (0, 139, 256)


@pytest.mark.parametrize("spec", SMALL)
def test_growth_changes_no_output(llama, spec, monkeypatch):
    """Flushes, a prompt longer than the window and decode steps across flushes give the same
    tokens and logits as a window allocated at its configured size up front."""
    ids = random_ids(300, seed=5)
    sizes = []
    monkeypatch.setattr(_quant_window, "window_slots", lambda tokens, limit: sizes.append((tokens, limit)) or
                        window_slots(tokens, limit))
    grown = generate(llama, ids, spec, 50)
    assert grown.past_key_values.layers[0].n_quant > 0
    assert any(window_slots(t, limit) < limit for t, limit in sizes)  # the window was smaller at times
    monkeypatch.setattr(_quant_window, "window_slots", lambda tokens, limit: max(tokens, limit))
    whole = generate(llama, ids, spec, 50)
    assert torch.equal(grown.sequences, whole.sequences)
    for a, b in zip(grown.scores, whole.scores):
        assert torch.equal(a, b)


def test_long_prompt_window_shrinks_to_what_it_holds(llama):
    spec = "zipcache:group_size=16:value_group_size=16:residual_length=100:flush_size=256"
    ids = random_ids(1000, seed=6)
    policy = kvpress.get_policy(spec)
    cache = kvpress.make_cache(llama, policy)
    with torch.no_grad(), kvpress.apply(llama, policy):
        llama(ids, use_cache=True, **cache_kwargs(llama, cache))
    layer = cache.layers[0]
    # 1000 tokens: 768 flushed, 232 left in a window of 256 slots (not the prompt's 1000, nor 100 + 256)
    assert (layer.n_quant, layer.win_len, layer.k_win.shape[2]) == (768, 232, 256)
    # `generate` plans the cache for a static decode step: the window is reserved for the most it can
    # hold between flushes, residual_length + flush_size
    layer = generate(llama, ids, spec, 1).past_key_values.layers[0]
    assert (layer.n_quant, layer.win_len, layer.k_win.shape[2]) == (768, 232, 356)


@pytest.mark.parametrize("spec", ("kivi:group_size=16:residual_length=16",
                                  "zipcache:group_size=16:value_group_size=16:residual_length=16:flush_size=16"))
def test_a_forced_fused_decode_the_kernel_cannot_run_is_refused(llama, spec):
    """``decode_backend="triton"`` on the tiny llama (head_dim 16, which the fused kernel does not
    take) raises at the first decode step over packed tokens, naming what it takes."""
    policy = kvpress.get_policy(spec)
    cache = kvpress.make_cache(llama, policy)
    for layer in cache.layers:
        layer.decode_backend = "triton"
    ids = random_ids(40, seed=7)
    with torch.no_grad(), kvpress.apply(llama, policy):
        llama(ids, use_cache=True, **cache_kwargs(llama, cache))
        with pytest.raises(ValueError, match=r"decode_backend='triton' cannot run these inputs: it takes head_dim"):
            llama(ids[:, :1], use_cache=True, **cache_kwargs(llama, cache))
