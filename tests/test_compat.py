"""kvpress.compat: the cache argument under its name in the installed transformers (``cache`` from 5.24).

The other tests pass ``past_key_values=`` as most user code still does; these pass the name
:func:`kvpress.compat.cache_kwargs` picks, and check that kvpress itself raises no deprecation warning.
"""

import inspect
import warnings

import pytest
import torch

import kvpress
from kvpress.compat import cache_keyword, cache_kwargs, output_cache
from kvpress.generation import chunked_nll, timed_generate

from conftest import random_ids


def test_the_keyword_is_the_one_forward_takes(llama):
    name = cache_keyword(type(llama).forward)
    assert name in ("cache", "past_key_values")
    assert name in inspect.signature(llama.forward).parameters
    assert cache_kwargs(llama, None) == {name: None}
    stack = llama.get_decoder()
    assert cache_keyword(type(stack).forward) in inspect.signature(stack.forward).parameters


@pytest.mark.parametrize("name", ["full", "streaming"])
def test_incremental_forwards_with_the_current_keyword_continue_the_policy_cache(llama, name):
    ids = random_ids(40)
    policy = kvpress.get_policy(name).with_budget(64)
    with torch.no_grad(), kvpress.apply(llama, policy):
        whole = llama(ids, use_cache=True)
        cache = kvpress.make_cache(llama, policy)
        first = llama(ids[:, :25], **cache_kwargs(llama, cache), use_cache=True)
        assert output_cache(first) is cache
        second = llama(ids[:, 25:], **cache_kwargs(llama, output_cache(first)), use_cache=True)
    assert isinstance(output_cache(whole), kvpress.PolicyCache)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole.logits, atol=1e-5, rtol=0)
    assert kvpress.cache_stats(second).tokens == 40


def test_generate_output_and_cache_stats(llama):
    ids = random_ids(20)
    policy = kvpress.get_policy("window", window_size=16)
    with torch.no_grad(), kvpress.apply(llama, policy):
        out = llama.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = output_cache(out)
    assert isinstance(cache, kvpress.PolicyCache) and cache.layers[0].stored_tokens() == 16
    assert kvpress.cache_stats(out) == kvpress.cache_stats(cache)
    with pytest.raises(TypeError, match="holds no cache"):
        output_cache(kvpress.cache_stats(cache))
    with pytest.raises(TypeError, match="PolicyCache"):
        kvpress.cache_stats(torch.zeros(1))


def test_kvpress_paths_raise_no_deprecation_warning(llama):
    ids = random_ids(24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        result = timed_generate(llama, ids, kvpress.get_policy("streaming").with_budget(16), max_new_tokens=4)
        nll = chunked_nll(llama, ids, kvpress.get_policy("full"), chunk_size=8)
    assert result.tokens.shape == (1, 4) and result.stats.tokens == 24 + 3
    assert nll.shape == (23,) and torch.isfinite(nll).all()
