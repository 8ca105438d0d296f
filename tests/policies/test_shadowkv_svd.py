"""ShadowKV's query-weighted SVD (``svd="query"``): the weighted factorisation and its metric, the
weights from the prompt's queries (through a crop, a prompt in pieces, left padding), folds."""
import sys
from pathlib import Path

import pytest
import torch

import kvpress
from kvpress.compat import cache_kwargs
from kvpress.policies._shadowkv_store import low_rank, project, query_pair_weights
from kvpress.prefill import cache_from_dense, dense_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import random_ids  # noqa: E402
from shadowkv_helpers import PROMPT, model, small_policy  # noqa: E402,F401  (model: the fixture)


def policy(**kw):
    return small_policy(**{"svd": "query", **kw})


def test_weighted_factors_are_best_in_their_metric_and_exact_at_full_rank():
    gen = torch.Generator().manual_seed(0)
    B, T, H, D, R = 2, 40, 2, 8, 4
    k = torch.randn(B, T, H * D, generator=gen) * torch.linspace(0.2, 3, H * D)
    w = torch.rand(B, H * D, generator=gen) * 4 + 0.05
    start = torch.zeros(B, dtype=torch.long)
    f_w, b_w = low_rank(k, start, R, H, torch.float32, w)
    f_p, b_p = low_rank(k, start, R, H, torch.float32)
    err_w = k - f_w @ b_w.reshape(B, R, -1)
    err_p = k - f_p @ b_p.reshape(B, R, -1)
    assert (err_w.square() * w[:, None]).sum() < (err_p.square() * w[:, None]).sum()  # best in the metric
    assert err_p.square().sum() < err_w.square().sum()  # the plain SVD is best in squared error
    torch.testing.assert_close(project(k, b_w, w), f_w, atol=1e-4, rtol=1e-4)  # its own keys project back
    f_full, b_full = low_rank(k, start, H * D, H, torch.float32, w)
    torch.testing.assert_close(f_full @ b_full.reshape(B, H * D, -1), k, atol=1e-4, rtol=1e-4)


def test_pair_weights_are_the_same_before_and_after_rope():
    """A rotary pair (c, c + D/2) keeps its squared norm under any rotation, so the weights from
    post-RoPE queries (what the attention sees) equal those from pre-RoPE ones; only real
    positions count."""
    gen = torch.Generator().manual_seed(1)
    B, H, G, T, D = 2, 2, 3, 20, 8
    q = torch.randn(B, H * G, T, D, generator=gen)
    angle = torch.rand(T, D // 2, generator=gen) * 6.3
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    rotated = q * cos + torch.cat([-q[..., D // 2:], q[..., : D // 2]], -1) * sin
    real = torch.arange(T)[None] >= torch.tensor([[0], [7]])
    sq = lambda x: x.square().view(B, H, G, T, D).mean(2)  # noqa: E731
    w = query_pair_weights(sq(q), real)
    torch.testing.assert_close(query_pair_weights(sq(rotated), real), w)
    expect = sq(q)[1, :, 7:].mean(1)  # row 1: its 13 real positions
    torch.testing.assert_close(w[1].view(H, D), ((expect + expect.roll(D // 2, -1)) / 2))


def test_svd_query_runs_its_own_prefill_and_bad_values_are_clear_errors(model):
    with pytest.raises(ValueError, match="svd='cov' is not supported"):
        policy(svd="cov")
    assert policy().prefills_densely() is False and policy(svd="plain").prefills_densely()
    _, dense = dense_prefill(model, random_ids(PROMPT))
    with pytest.raises(ValueError, match="prefill"):
        cache_from_dense(model, policy(), dense)


def test_key_weights_come_from_the_prompts_queries(model):
    """Each layer's weights are the pair-averaged mean squares of its prompt's queries (read here
    before RoPE from ``q_proj``), and its basis is orthonormal in that metric."""
    ids = random_ids(PROMPT, seed=2)
    grabbed = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, o, i=i: grabbed.__setitem__(i, o))
             for i, layer in enumerate(model.model.layers)]
    pol = policy()
    cache = kvpress.make_cache(model, pol)
    try:
        with torch.no_grad(), kvpress.apply(model, pol):
            model(ids, use_cache=True, **cache_kwargs(model, cache))
    finally:
        for h in hooks:
            h.remove()
    adapter = kvpress.get_adapter(model)
    H, G, D = adapter.num_kv_heads, adapter.group_size, adapter.head_dim
    for i, layer in enumerate(cache.layers):
        q = grabbed[i].view(1, PROMPT, H * G, D).transpose(1, 2)
        expect = query_pair_weights(q.square().view(1, H, G, PROMPT, D).mean(2), torch.ones(1, PROMPT, dtype=torch.bool))
        torch.testing.assert_close(layer.key_weight, expect, atol=1e-5, rtol=1e-4)
        b = layer.basis.reshape(1, 8, H * D) * layer.key_weight.sqrt()[:, None]
        torch.testing.assert_close(b @ b.transpose(1, 2), torch.eye(8)[None], atol=1e-4, rtol=0)


def _decode(model, pol, pieces, crop=0, steps=4, in_prompt_block=False):
    cache = kvpress.make_cache(model, pol)
    with torch.no_grad(), kvpress.apply(model, pol):
        if crop is not None:
            cache.activate_past_recording()
        if in_prompt_block:
            with cache.prompt():
                for p in pieces:
                    model(p, use_cache=True, **cache_kwargs(model, cache))
        else:
            for p in pieces:
                model(p, use_cache=True, **cache_kwargs(model, cache))
        if crop is not None:
            cache.crop(-crop)
        out, nxt = [], torch.tensor([[5]])
        for _ in range(steps):
            logits = model(nxt, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
            out.append(logits)
            nxt = logits.argmax(-1, keepdim=True)
    return torch.stack(out, 1), cache


def test_a_cropped_prompt_and_a_prompt_in_pieces_weigh_as_the_prompt_alone(model):
    ids = random_ids(PROMPT + 20, seed=3)
    ref, ref_cache = _decode(model, policy(), [ids[:, :PROMPT]])
    got, cache = _decode(model, policy(), [ids], crop=20)  # assisted decoding's first verification
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.layers[1].key_weight, ref_cache.layers[1].key_weight)
    pieces, cache = _decode(model, policy(), list(ids[:, :PROMPT].split(48, dim=1)), crop=None, in_prompt_block=True)
    torch.testing.assert_close(pieces, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.layers[1].key_weight, ref_cache.layers[1].key_weight, atol=1e-6, rtol=1e-5)


def test_a_left_padded_row_weighs_as_when_run_alone(model):
    ids = random_ids(PROMPT, batch=2, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :24] = 0
    with torch.no_grad(), kvpress.apply(model, policy()):
        both = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                              return_dict_in_generate=True, output_scores=True)
        alone = model.generate(ids[1:, 24:], max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                               output_scores=True)
    assert torch.equal(both.sequences[1, PROMPT:], alone.sequences[0, PROMPT - 24:])
    torch.testing.assert_close(torch.stack(both.scores)[:, 1], torch.stack(alone.scores)[:, 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(both.past_key_values.layers[1].key_weight[1],
                               alone.past_key_values.layers[1].key_weight[0], atol=1e-5, rtol=1e-4)
