"""``tail_chunk``: the selection policies' estimate of the tokens a sparse step leaves out."""

import pytest
import torch

import kvpress
from kvpress.policies.double_sparsity import synthetic_artifact

from conftest import random_ids, tiny_model

PROMPT, STEPS = 90, 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


def fields(name, model):
    base = {
        "exact_topk": dict(budget=20, sink_tokens=2, window_size=4),
        "quest": dict(budget=24, page_size=8, dense_layers=0),
        "tidal": dict(budget=20, selection_layer=0, reselection_layer=-1, sink_tokens=2, recent_tokens=4),
        "double_sparsity": dict(budget=20, sink_tokens=2, window_size=4, label_channels=2),
    }[name]
    if name == "double_sparsity":
        base["artifact"] = str(synthetic_artifact(kvpress.get_adapter(model)))
    return base


def decode(model, policy, ids, attention_mask=None, steps=STEPS):
    """Greedy decode by hand; returns the cache and every step's last logits (B, steps + 1, V)."""
    logits = []
    with torch.no_grad(), kvpress.apply(model, policy):
        out = model(ids, attention_mask=attention_mask, use_cache=True)
        cache = out.past_key_values
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1:].argmax(-1)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], 1)
            out = model(nxt, past_key_values=cache, attention_mask=attention_mask, use_cache=True)
        logits.append(out.logits[:, -1])
    return cache, torch.stack(logits, 1)


NAMES = ["exact_topk", "quest", "tidal", "double_sparsity"]


@pytest.mark.parametrize("name", NAMES)
def test_one_token_chunks_make_every_sparse_step_exact(model, name):
    ids = random_ids(PROMPT, seed=1)
    _, full = decode(model, kvpress.get_policy("full"), ids)
    _, sparse = decode(model, kvpress.get_policy(name, **fields(name, model), tail_chunk=0), ids)
    _, tail = decode(model, kvpress.get_policy(name, tail_chunk=1, **fields(name, model)), ids)
    assert (sparse[:, 1:] - full[:, 1:]).abs().max() > 1e-3  # the budget really drops tokens
    torch.testing.assert_close(tail, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", NAMES)
def test_tail_sums_are_resident_state_counted_in_cache_stats(model, name):
    ids = random_ids(PROMPT, seed=2)
    plain, _ = decode(model, kvpress.get_policy(name, **fields(name, model), tail_chunk=0), ids)
    cache, _ = decode(model, kvpress.get_policy(name, tail_chunk=16, **fields(name, model)), ids)
    extra = 0
    for layer in cache.layers:
        tail = getattr(layer, "tail", None)
        if tail is None:
            continue
        n = -(-(PROMPT + STEPS) // 16)
        assert tail.chunks == n and torch.equal(tail.tail_count[0, :n].sum(), torch.tensor(float(PROMPT + STEPS)))
        # the running sums are the chunk sums of the stored keys / values
        k = layer.buffer.keys.float()
        want = torch.nn.functional.pad(k, (0, 0, 0, n * 16 - k.shape[2])).view(*k.shape[:2], n, 16, -1).sum(3)
        torch.testing.assert_close(tail.tail_k_sum[:, :, :n], want, atol=1e-4, rtol=1e-5)
        extra += sum(t.numel() * t.element_size() for t in tail.state_tensors().values())
    assert extra > 0
    assert kvpress.cache_stats(cache).resident_bytes == kvpress.cache_stats(plain).resident_bytes + extra


def generate_scores(model, policy, ids, attention_mask=None):
    """generate()'s per-step logits (B, steps, V): it derives positions from the mask, as users run it."""
    with torch.no_grad(), kvpress.apply(model, policy):
        out = model.generate(ids, attention_mask=attention_mask, max_new_tokens=STEPS + 1, do_sample=False,
                             return_dict_in_generate=True, output_scores=True)
    return torch.stack(out.scores, 1)


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_rows_estimate_as_when_run_alone(model, name):
    policy = kvpress.get_policy(name, tail_chunk=8, **fields(name, model))
    long, short = random_ids(PROMPT, seed=3), random_ids(PROMPT - 13, seed=4)
    batch = torch.zeros(2, PROMPT, dtype=torch.long)
    mask = torch.zeros(2, PROMPT, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 13:], mask[1, 13:] = short[0], 1
    both = generate_scores(model, policy, batch, attention_mask=mask)
    one = generate_scores(model, policy, long)
    two = generate_scores(model, policy, short)
    torch.testing.assert_close(both[0], one[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[1], two[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_negative_tail_chunk_is_a_clear_error(name):
    with pytest.raises(ValueError, match="tail_chunk"):
        kvpress.get_policy(name, tail_chunk=-1)
