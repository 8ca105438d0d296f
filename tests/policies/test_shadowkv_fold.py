"""ShadowKV's tokens after the prompt folded into its store (``fold_size``): the budget and the
device bytes stay bounded over a long generation, folded keys / values are the generated ones,
a budget covering everything still equals ``full``, batch rows equal their runs alone, and a
fold inside a verification is taken back by ``crop``."""
import sys
from pathlib import Path

import pytest
import torch

import kvpress
from kvpress.compat import cache_kwargs
from kvpress.kernels import shadowkv_rebuild

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import random_ids  # noqa: E402
from shadowkv_helpers import PROMPT, model, small_policy  # noqa: E402,F401  (model: the fixture)


def policy(**kw):
    return small_policy(**{"budget": 72, "fold_size": 16, **kw})


def feed(model, pol, ids, steps, *, record=False):
    """The prompt ``ids``, then the tokens of ``steps`` (B, n) one forward each (teacher forced):
    the steps' last logits (B, n, V) and the cache."""
    cache = kvpress.make_cache(model, pol)
    logits = []
    with torch.no_grad(), kvpress.apply(model, pol):
        if record:
            cache.activate_past_recording()
        model(ids, use_cache=True, **cache_kwargs(model, cache))
        for t in range(steps.shape[1]):
            logits.append(model(steps[:, t:t + 1], use_cache=True, **cache_kwargs(model, cache)).logits[:, -1])
    return torch.stack(logits, 1), cache


@pytest.mark.parametrize("kw, match", [(dict(fold_size=12), "fold_size=12 must be 0 .* multiple of chunk_size=8"),
                                       (dict(fold_size=16, tail_chunk=32), "multiple of tail_chunk=32"),
                                       (dict(fold_size=-8), "fold_size=-8 is out of range")])
def test_bad_fold_size_is_a_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        policy(**kw)


def test_long_generation_keeps_the_budget_and_one_chunk_grid(model):
    """200 tokens after a 160-token prompt: without folding the generated tokens alone push every
    step past the budget and stay on the device at full precision; with it the store grows by
    whole chunks that steps select, the budget holds and fewer bytes stay on the device."""
    ids, steps = random_ids(PROMPT, seed=1), random_ids(200, seed=2)
    _, folded = feed(model, policy(), ids, steps)
    _, kept = feed(model, policy(fold_size=0), ids, steps)
    for layer, ref in zip(folded.layers, kept.layers):
        assert layer.gen_len < 16 + 16 and layer.seen == ref.seen == PROMPT + 200
        C = layer.n_chunks
        assert C * 8 + layer.gen_len == layer.seen and C > PROMPT // 8
        assert layer.factor.shape[1] == C * 8 and layer.landmarks.shape[2] == layer.selectable.shape[2] == C
        assert layer.v_host.shape[2] == C and bool(layer.selectable[:, :, PROMPT // 8:].all())
        assert layer.max_attended <= 72 < ref.max_attended
        assert torch.equal(layer._sel_cnt_cpu, layer.selectable.sum(-1).cpu())
    assert kvpress.cache_stats(folded).resident_bytes < kvpress.cache_stats(kept).resident_bytes
    assert kvpress.cache_stats(folded).offloaded_bytes > kvpress.cache_stats(kept).offloaded_bytes


@pytest.mark.parametrize("tail_chunk, fetch_keys, svd", [(0, False, "plain"), (16, False, "plain"), (0, True, "plain"),
                                                      (0, False, "query")])
def test_folded_keys_and_values_are_the_generated_ones(model, tail_chunk, fetch_keys, svd):
    """The first layer's keys do not depend on attention, so the run without folding holds the
    same generated keys exactly: at full rank (the key dimension, 32) the folded chunks' keys
    rebuilt from their factors with RoPE equal them, and the host tier holds their values (with
    ``fetch_keys`` their exact keys too); with ``svd="query"`` folded keys are projected in the
    basis' own metric."""
    ids, steps = random_ids(PROMPT, seed=3), random_ids(50, seed=4)  # folds before steps 33 and 49
    _, folded = feed(model, policy(rank=32, tail_chunk=tail_chunk, fetch_keys=fetch_keys, svd=svd), ids, steps)
    _, kept = feed(model, policy(rank=32, fold_size=0), ids, steps)
    layer, ref = folded.layers[0], kept.layers[0]
    first, C = PROMPT // 8, layer.n_chunks
    n = (C - first) * 8  # folded tokens
    assert n == 32
    B, H = layer.selectable.shape[:2]
    chunks = torch.arange(first, C, dtype=torch.int32)[None, None].expand(B, H, -1).contiguous()
    keys = shadowkv_rebuild(layer.factor, layer.basis, chunks, layer._rope_inv_freq("cpu"), layer.rope_start,
                            chunk_size=8)  # (B, H, n, D)
    torch.testing.assert_close(keys, ref.gen_k[:, :, :n], atol=1e-4, rtol=0)
    assert torch.equal(layer.v_host[:, :, first:].reshape(B, H, n, -1), ref.gen_v[:, :, :n])
    if fetch_keys:
        assert torch.equal(layer.k_host[:, :, first:].reshape(B, H, n, -1), ref.gen_k[:, :, :n])
    else:
        assert layer.k_host is None
    torch.testing.assert_close(layer.gen_k[:, :, :layer.gen_len], ref.gen_k[:, :, n:ref.gen_len])
    if tail_chunk:  # the folded groups' value sums continue the prompt's (groups of two chunks)
        sums = ref.gen_v[:, :, :n].float().reshape(B, H, n // 16, 16, -1).sum(3)
        torch.testing.assert_close(layer.tail_v_sum[:, :, -(n // 16):], sums, atol=1e-4, rtol=0)


def test_folded_chunks_carry_their_residual_to_the_host_tier(model):
    """With ``residual_bits`` a fold also appends the folded keys' residual rows -- the generated
    keys less their rebuild at rank 4 of 32, quantized -- so rebuilt plus residual gives the
    generated keys back within the residual's 8-bit step, where the rebuild alone is far off."""
    from kvpress.policies._shadowkv_store import add_residual

    ids, steps = random_ids(PROMPT, seed=3), random_ids(50, seed=4)
    _, folded = feed(model, policy(rank=4, residual_bits=8, residual_group=16), ids, steps)
    _, kept = feed(model, policy(rank=4, fold_size=0), ids, steps)
    layer, ref = folded.layers[0], kept.layers[0]
    first, C = PROMPT // 8, layer.n_chunks
    n = (C - first) * 8
    assert n == 32 and layer.kr_host.shape[2] == C == layer.v_host.shape[2]
    B, H = layer.selectable.shape[:2]
    chunks = torch.arange(first, C, dtype=torch.int32)[None, None].expand(B, H, -1).contiguous()
    rebuilt = shadowkv_rebuild(layer.factor, layer.basis, chunks, layer._rope_inv_freq("cpu"), layer.rope_start,
                               chunk_size=8)  # (B, H, n, D)
    exact = ref.gen_k[:, :, :n]
    keys = add_residual(rebuilt, layer.kr_host[:, :, first:].reshape(B, H, n, -1), 8, 16)
    assert (rebuilt - exact).norm() > 0.3 * exact.norm()
    assert (keys - exact).norm() < 0.01 * exact.norm()


def test_a_budget_covering_everything_still_equals_full(model):
    """Rows whose tokens fit the budget fold into their exact tokens: no factorisation, ``full``'s logits."""
    ids, steps = random_ids(PROMPT, seed=5), random_ids(50, seed=6)  # folds before steps 33 and 49
    got, cache = feed(model, policy(budget=PROMPT + 50), ids, steps)
    ref, _ = feed(model, kvpress.get_policy("full"), ids, steps)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    layer = cache.layers[1]
    assert layer.factor is None and layer.n_chunks == PROMPT // 8 + 4 and bool(layer.row_exact.all())
    assert int(layer.exact_cnt.min()) == PROMPT + 32 and layer.max_attended == PROMPT + 50


@pytest.mark.parametrize("svd", ["plain", "query"])
def test_batch_rows_equal_their_runs_alone_across_folds(model, svd):
    """Row 1 is left-padded to 48 real tokens: it fits the budget (72) and keeps its first folded
    tokens exact; the second fold makes it pass, so it factors those keys on their own (as alone,
    where no prompt was factorised); row 0 folds onto its prompt's basis. Each row's logits equal
    its run alone (with ``svd="query"`` in the metric of its own prompt's queries)."""
    ids, steps = random_ids(PROMPT, batch=2, seed=7), random_ids(50, batch=2, seed=8)
    pad = PROMPT - 48
    mask = torch.ones(2, PROMPT + 50, dtype=torch.long)
    mask[1, :pad] = 0
    pol = policy(svd=svd)
    cache = kvpress.make_cache(model, pol)
    got = []
    with torch.no_grad(), kvpress.apply(model, pol):
        model(ids, attention_mask=mask[:, :PROMPT], use_cache=True, **cache_kwargs(model, cache))
        for t in range(50):
            out = model(steps[:, t:t + 1], attention_mask=mask[:, :PROMPT + t + 1], use_cache=True,
                        **cache_kwargs(model, cache))
            got.append(out.logits[:, -1])
    got = torch.stack(got, 1)
    layer = cache.layers[1]
    assert not bool(layer.row_exact[1]) and bool(layer.has_basis.all())
    for row, prompt in ((0, ids[:1]), (1, ids[1:, pad:])):
        alone, _ = feed(model, pol, prompt, steps[row:row + 1])
        torch.testing.assert_close(got[row:row + 1], alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize("keep", [2, 5])
def test_crop_takes_back_a_fold_inside_a_verification(model, keep):
    """After 30 generated tokens a verification of 6 runs as decode steps and folds before its
    third (generated tokens reach local_window + fold_size = 32). Cropped to 2 tokens the fold is
    taken back, to 5 it stays; either way the cache holds what the kept steps leave, and the next
    steps (the first of which folds after a crop to 2) give the same logits."""
    ids, before, turn, after = (random_ids(n, seed=s) for n, s in ((PROMPT, 9), (30, 10), (6, 11), (4, 12)))
    pol = policy()
    caches, chunks, logits = [], [], []
    for record in (True, False):
        _, cache = feed(model, pol, ids, before, record=record)
        with torch.no_grad(), kvpress.apply(model, pol):
            if record:
                model(turn, use_cache=True, **cache_kwargs(model, cache))
                assert all(layer.n_chunks == PROMPT // 8 + 2 for layer in cache.layers)  # folded
                cache.crop(-(6 - keep))
            else:
                for t in range(keep):
                    model(turn[:, t:t + 1], use_cache=True, **cache_kwargs(model, cache))
            chunks.append([layer.n_chunks for layer in cache.layers])
            logits.append(torch.stack([model(after[:, t:t + 1], use_cache=True, **cache_kwargs(model, cache))
                                       .logits[:, -1] for t in range(4)], 1))
        caches.append(cache)
    assert chunks[0] == chunks[1] == [PROMPT // 8 + (2 if keep == 5 else 0)] * 2
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    for got, ref in zip(*(c.layers for c in caches)):
        assert (got.seen, got.gen_len, got.n_chunks) == (ref.seen, ref.gen_len, ref.n_chunks)
        for name in ("factor", "basis", "landmarks", "selectable", "exact_k", "exact_cnt"):
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), atol=1e-5, rtol=0)
        n = got.gen_len
        torch.testing.assert_close(got.gen_k[:, :, :n], ref.gen_k[:, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.v_host, ref.v_host, atol=1e-5, rtol=0)


def test_tokens_folded_for_good_are_not_taken_back(model):
    """Outside a recorded verification a fold is final: a crop reaching into folded tokens is
    refused with the limit, and the cache is unchanged."""
    _, cache = feed(model, policy(), random_ids(PROMPT, seed=13), random_ids(40, seed=14))
    layer = cache.layers[0]
    seen, gen_len = layer.seen, layer.gen_len
    assert layer.n_chunks > PROMPT // 8 and 0 < gen_len < 40
    with pytest.raises(ValueError, match=f"at most {gen_len} can be taken back now .*not yet folded"):
        cache.crop(-(gen_len + 1))
    assert (layer.seen, layer.gen_len) == (seen, gen_len)
    cache.crop(-gen_len)
    assert layer.seen == seen - gen_len and layer.gen_len == 0
