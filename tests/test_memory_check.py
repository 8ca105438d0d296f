"""A cache that cannot fit is refused before the prompt runs, and running out of device memory
inside ``generate`` names the policy and its cache (both on CPU: free memory given, or the error
raised by a stand-in forward)."""

import pytest
import torch

import kvpress
from kvpress.generate_hooks import check_cache_fits
from kvpress.stats import planned_dense_bytes

from conftest import random_ids, sliding_model, tiny_model


def _planned(model, spec: str, tokens: int):
    cache = kvpress.make_cache(model, kvpress.get_policy(spec))
    cache.plan_capacity(tokens)
    return cache


def test_planned_bytes_of_policies_that_keep_every_token():
    model = tiny_model("llama", layers=2, kv_heads=2, head_dim=16)
    cache = _planned(model, "full", 300)  # planned capacity: a multiple of 128
    assert cache.capacity == 384
    assert planned_dense_bytes(cache, batch=3) == 2 * 2 * 3 * 2 * 16 * 384 * 4  # layers x (k, v) x B x H x D x T x fp32
    assert planned_dense_bytes(_planned(model, "quest", 300), batch=3) == planned_dense_bytes(cache, batch=3)
    # compressing policies hold fewer bytes, known only once they run; an unplanned cache: unknown
    assert planned_dense_bytes(_planned(model, "kivi:group_size=16", 300), batch=3) is None
    assert planned_dense_bytes(kvpress.make_cache(model, kvpress.get_policy("full")), batch=3) is None


def test_a_sliding_layer_counts_its_window():
    model = sliding_model("qwen2", layers=3, full_layers=2, window=8)
    cache = _planned(model, "full", 100)
    a = model.config
    per_token = 2 * a.num_key_value_heads * (a.hidden_size // a.num_attention_heads) * 4
    assert planned_dense_bytes(cache, batch=1) == per_token * (2 * cache.capacity + 8)


def test_a_cache_that_cannot_fit_is_refused_naming_the_bytes():
    model = tiny_model("llama")
    cache = _planned(model, "full", 1000)
    needed = planned_dense_bytes(cache, batch=2)
    check_cache_fits(cache, 2, "cuda", free_bytes=needed)  # fits exactly
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"full's cache needs at least 0\.00 GiB for 2 x 1024 tokens"):
        check_cache_fits(cache, 2, "cuda", free_bytes=needed - 1)
    # a compressing policy's bytes are unknown before it runs: no refusal
    check_cache_fits(_planned(model, "kivi:group_size=16", 1000), 2, "cuda", free_bytes=0)
    check_cache_fits(cache, 2, "cpu")  # a CPU has no device memory to check


def test_out_of_memory_inside_generate_names_the_policy_and_restores_the_model():
    model = tiny_model("llama")
    ids = random_ids(20)
    before = model(ids).logits
    calls = []

    def exhausted(module, args, kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first decode step
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = model.model.layers[0].register_forward_pre_hook(exhausted, with_kwargs=True)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError) as err, kvpress.apply(model, kvpress.get_policy("full")):
            model.generate(ids, max_new_tokens=5, do_sample=False)
    finally:
        handle.remove()
    message = str(err.value)
    assert message.startswith("kvpress: out of device memory in generate under full with its cache holding")
    assert "for 20 tokens" in message and "CUDA out of memory. Tried to allocate 2.00 GiB" in message
    assert torch.equal(model(ids).logits, before)
