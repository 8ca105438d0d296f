"""exact_topk: the selection is the brute-force top-k of exact scores; budgets; bad input."""

import pytest
import torch

import kvpress
from kvpress.attention import dense_causal_attention
from kvpress.cache import PolicyCache

from conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")  # 4 query heads, 2 KV heads, head_dim 16, 2 layers


def topk_layer(model, row_start=None, **fields):
    policy = kvpress.get_policy("exact_topk", **fields)
    cache = PolicyCache(policy, kvpress.get_adapter(model))
    if row_start is not None:
        cache.set_left_padding(torch.tensor(row_start))
    return cache.layers[0]


def filled(layer, length, batch, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(batch, 2, length, 16, generator=g), torch.randn(batch, 2, length, 16, generator=g)
    layer.ingest_prefill(k, v)
    return k, v


@pytest.mark.parametrize("reduction", ["max", "softmax_max", "mean", "softmax_mean"])
def test_selection_is_the_brute_force_top_k_of_exact_scores(model, reduction):
    sinks, window, budget = 4, 8, 40
    layer = topk_layer(model, budget=budget, sink_tokens=sinks, window_size=window, group_reduction=reduction)
    k, _ = filled(layer, 157, batch=2, seed=0)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    index = layer.select(q, 0.25)
    mask = index.token_mask(157)  # (B, H_kv, T)
    # brute force: per (row, KV head) reduce the group's scaled logits, top-k among the candidates
    logits = torch.einsum("bhgd,bhtd->bhgt", q.view(2, 2, 2, 16), k) * 0.25
    if reduction.startswith("softmax"):
        logits = torch.softmax(logits[..., sinks : 157 - window], -1)
    else:
        logits = logits[..., sinks : 157 - window]
    scores = logits.mean(2) if reduction.endswith("mean") else logits.amax(2)
    want = torch.zeros(2, 2, 157, dtype=torch.bool)
    want[..., :sinks] = True
    want[..., 157 - window :] = True
    top = torch.topk(scores, budget - sinks - window, dim=-1).indices + sinks
    want.scatter_(2, top, True)
    assert torch.equal(mask, want)
    assert index.num_attended().tolist() == [[budget, budget], [budget, budget]]


def test_decode_equals_dense_attention_over_the_selected_tokens(model):
    layer = topk_layer(model, budget=32, sink_tokens=2, window_size=6)
    k, v = filled(layer, 90, batch=1, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k_new, v_new = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    out = layer.attend(q, k_new, v_new, 0.25)
    keys, values = torch.cat([k, k_new], 2), torch.cat([v, v_new], 2)
    # the same choice, made independently: group max of exact logits among [2, 91 - 6)
    logits = torch.einsum("bhgd,bhtd->bhgt", q[:, :, 0].view(1, 2, 2, 16), keys) * 0.25
    keep = torch.zeros(1, 2, 91, dtype=torch.bool)
    keep[..., :2] = keep[..., 85:] = True
    keep.scatter_(2, torch.topk(logits.amax(2)[..., 2:85], 24, dim=-1).indices + 2, True)
    for h in range(2):
        sel = keep[0, h].nonzero().squeeze(1)
        ref = dense_causal_attention(q[:, 2 * h : 2 * h + 2], keys[:, h : h + 1, sel], values[:, h : h + 1, sel], 0.25,
                                     q_start=len(sel) - 1)
        torch.testing.assert_close(out[:, 2 * h : 2 * h + 2], ref, rtol=1e-5, atol=1e-5)


def test_a_planted_key_is_attended_wherever_it_sits(model):
    layer = topk_layer(model, budget=16, sink_tokens=0, window_size=4)
    k, v = filled(layer, 200, batch=1, seed=4)
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(5))
    for pos in (0, 77, 195):  # a sink slot, the middle, just before the window
        layer.buffer.k[0, 1, pos] = 10 * q[0, 2] / q[0, 2].norm()  # query heads 2, 3 read KV head 1
        assert bool(layer.select(q, 0.25).token_mask(200)[0, 1, pos])
        layer.buffer.k[0, 1, pos] = k[0, 1, pos]


@pytest.mark.parametrize("fields,allowed", [
    (dict(budget=12, sink_tokens=4, window_size=8), "budget >= 13"),
    (dict(window_size=0), "window_size"),
    (dict(group_reduction="sum"), "softmax_max"),
    (dict(budget=0), "budget"),
])
def test_bad_fields_are_clear_errors(fields, allowed):
    with pytest.raises(ValueError, match=allowed):
        kvpress.get_policy("exact_topk", **fields)


def test_dense_layers_attend_densely_and_are_checked_against_the_model(model):
    from kvpress.layers import DenseLayer
    from kvpress.policies.exact_topk import ExactTopKLayer

    cache = PolicyCache(kvpress.get_policy("exact_topk", dense_layers=1), kvpress.get_adapter(model))
    assert type(cache.layers[0]) is DenseLayer and isinstance(cache.layers[1], ExactTopKLayer)
    with pytest.raises(ValueError, match="dense_layers"), kvpress.apply(model, kvpress.get_policy("exact_topk", dense_layers=3)):
        pass  # 2 layers: apply() checks the field against the model
    with pytest.raises(ValueError, match="dense_layers"):
        kvpress.get_policy("exact_topk", dense_layers=-1)
