"""Quest: incremental page bounds, exact budgets, always-on tokens, identity, bad input, SmolLM2 smoke."""

import pytest
import torch

import kvpress
from kvpress.attention import dense_causal_attention
from kvpress.cache import PolicyCache
from kvpress.kernels import page_min_max
from kvpress.policies._quest_pages import PageStats

from conftest import tiny_model
from smollm2_needle import beside_full


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")  # 4 query heads, 2 KV heads, head_dim 16, 2 layers


def quest_layer(model, row_start=None, **fields):
    policy = kvpress.get_policy("quest", **{"dense_layers": 0, "page_size": 8, **fields})
    cache = PolicyCache(policy, kvpress.get_adapter(model))
    if row_start is not None:
        cache.set_left_padding(torch.tensor(row_start))
    return cache.layers[1]


def prefill(layer, length, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(batch, 2, length, 16, generator=g), torch.randn(batch, 2, length, 16, generator=g)
    layer.ingest_prefill(k, v)
    return k, v


def test_page_bounds_are_updated_incrementally_and_match_a_recompute():
    g = torch.Generator().manual_seed(0)
    stats = PageStats(page_size=8, grow_pages=2)
    keys = torch.randn(2, 3, 61, 16, generator=g)
    row_start = torch.tensor([0, 5])
    stats.append(keys[:, :, :37], None, 0, row_start)  # a prompt ending mid-page
    for t in range(37, 61):  # decode appends, crossing page boundaries and capacity growth
        stats.append(keys[:, :, t : t + 1], None, t, row_start)
    for b in range(2):
        rel = keys[b : b + 1, :, int(row_start[b]) :]  # pages count from the row's first real token
        mn, mx = page_min_max(rel, 8)
        got_min, got_max = stats.bounds(mn.shape[2])
        torch.testing.assert_close(got_min[b : b + 1], mn, rtol=0, atol=0)
        torch.testing.assert_close(got_max[b : b + 1], mx, rtol=0, atol=0)


def test_unpadded_decode_appends_update_one_page_in_place_like_a_recompute():
    g = torch.Generator().manual_seed(1)
    stats = PageStats(page_size=8, grow_pages=2)
    keys = torch.randn(2, 3, 45, 16, generator=g)
    stats.append(keys[:, :, :13], None, 0, None)
    for t in range(13, 45):  # the one-token fast path, across page boundaries and growth
        stats.append(keys[:, :, t : t + 1], None, t, None)
    mn, mx = page_min_max(keys, 8)
    got_min, got_max = stats.bounds(mn.shape[2])
    torch.testing.assert_close(got_min, mn, rtol=0, atol=0)
    torch.testing.assert_close(got_max, mx, rtol=0, atol=0)


@pytest.mark.parametrize("sinks,reduction", [(0, "softmax_max"), (8, "softmax_max"), (8, "max"), (0, "mean")])
def test_unpadded_hot_path_selects_what_the_masked_path_selects(model, sinks, reduction):
    layer = quest_layer(model, budget=48, sink_tokens=sinks, score_reduction=reduction)
    prefill(layer, 203, batch=2, seed=3)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):  # decode appends keep both paths in step
        q = torch.randn(2, 4, 16, generator=g)
        fast, slow = layer.select(q, 0.25), layer._select_masked(q, 0.25)
        assert fast.id_range is not None and slow.id_range is None  # the hot path really ran
        T = layer.buffer.k.shape[2]
        assert torch.equal(fast.token_mask(T), slow.token_mask(T))
        assert fast.num_attended().tolist() == [[48, 48], [48, 48]]
        fast.validate()
        k, v = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
        layer.attend(q[:, :, None], k, v, 0.25)


@pytest.mark.parametrize("sinks", [0, 8])
def test_attended_tokens_equal_budget_and_always_on_tokens_are_kept(model, sinks):
    layer = quest_layer(model, budget=36, sink_tokens=sinks)
    policy = layer.policy
    prefill(layer, 101)
    q = torch.randn(1, 4, 16)
    index = layer.select(q, 0.25)
    assert index.num_attended().tolist() == [[36, 36]]
    mask = index.token_mask(layer.buffer.k.shape[2])[0]  # (H_kv, T_cap)
    assert mask[:, :sinks].all() and mask[:, 101 - policy.dense_tail : 101].all()
    assert policy.dense_tail >= policy.page_size  # the current (partial) page is always attended
    assert not mask[:, 101:].any()


def test_left_padded_rows_page_from_their_first_token_with_exact_budget(model):
    layer = quest_layer(model, row_start=[0, 5], budget=28)
    prefill(layer, 70, batch=2)
    index = layer.select(torch.randn(2, 4, 16), 0.25)
    assert index.block_size == 1  # misaligned rows: pages expanded to tokens
    assert index.num_attended().tolist() == [[28, 28], [28, 28]]
    assert not index.token_mask(layer.buffer.k.shape[2])[1, :, :5].any()  # padding never attended


def test_row_covered_by_budget_attends_everything_in_a_batch_with_longer_rows(model):
    layer = quest_layer(model, row_start=[0, 40], budget=32)
    prefill(layer, 64, batch=2)  # row 1 has 24 real tokens <= budget
    index = layer.select(torch.randn(2, 4, 16), 0.25)
    assert index.num_attended()[1].tolist() == [24, 24]
    assert index.num_attended()[0].tolist() == [32, 32]


def test_decode_with_budget_covering_the_sequence_is_dense_attention(model):
    layer = quest_layer(model, budget=64)
    k, v = prefill(layer, 40)
    q, k1, v1 = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    out = layer.attend(q, k1, v1, 0.25)
    ref = dense_causal_attention(q, torch.cat([k, k1], 2), torch.cat([v, v1], 2), 0.25, q_start=40)
    assert torch.equal(out, ref)


def test_sparse_decode_matches_attention_over_the_selected_tokens(model):
    layer = quest_layer(model, budget=24)
    k, v = prefill(layer, 60)
    q, k1, v1 = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    out = layer.attend(q, k1, v1, 0.25)
    index = layer.select(q[:, :, 0], 0.25)
    mask = index.token_mask(61)[0]  # (H_kv, 61)
    keys, values = torch.cat([k, k1], 2)[0], torch.cat([v, v1], 2)[0]
    for h in range(4):
        sel = mask[h // 2]
        w = torch.softmax(q[0, h, 0] @ keys[h // 2, sel].T * 0.25, -1)
        torch.testing.assert_close(out[0, h, 0], w @ values[h // 2, sel], atol=1e-5, rtol=1e-5)


def test_bad_input_is_a_clear_error(model):
    with pytest.raises(ValueError, match="page_size"):
        kvpress.get_policy("quest", page_size=12)
    with pytest.raises(ValueError, match="budget >= 16"):
        kvpress.get_policy("quest", budget=8)
    with pytest.raises(ValueError, match="multiple of page_size"):
        kvpress.get_policy("quest", sink_tokens=4)
    with pytest.raises(ValueError, match="dense_layers"):
        with kvpress.apply(model, kvpress.get_policy("quest", dense_layers=3)):
            pass


@pytest.mark.smollm2
def test_smollm2_sparse_decode_follows_full_when_few_tokens_are_dropped():
    ref, res = beside_full(kvpress.get_policy("quest", budget=480))
    assert torch.equal(res.tokens, ref.tokens)
    assert res.stats.resident_bytes > ref.stats.resident_bytes  # the whole cache plus page bounds


def _plant(keys, q, row, head, token, strength=6.0):
    """Make the key at ``token`` of KV head ``head`` point along query head ``2 * head``."""
    keys[row, head, token] = strength * q[row, 2 * head] / q[row, 2 * head].norm()


@pytest.mark.parametrize("row_start, token", [(None, 2), (None, 37), ([0, 5], 6), ([0, 5], 93)])
def test_a_page_holding_one_heads_strongest_key_is_selected(model, row_start, token):
    """Regression: a needle right after the first token (depth 0) or mid-context, read by ONE query
    head of the GQA group, left-padded or not, must be attended by its KV head."""
    layer = quest_layer(model, row_start=row_start, budget=32)  # 2 selected pages of 8 + a tail of 16
    B = 1 if row_start is None else 2
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(B, 2, 130, 16, generator=g) * 0.3, torch.randn(B, 2, 130, 16, generator=g)
    q = torch.randn(B, 4, 16, generator=g)
    for b in range(B):
        for h in range(2):
            _plant(keys, q, b, h, token + (0 if row_start is None else row_start[b]))
    layer.ingest_prefill(keys, values)
    index = layer.select(q, 0.25)
    mask = index.token_mask(layer.buffer.k.shape[2])  # (B, H_kv, T_cap)
    for b in range(B):
        t = token + (0 if row_start is None else row_start[b])
        assert mask[b, :, t].all(), f"row {b}: planted token {t} not attended"
    assert index.num_attended().tolist() == [[32, 32]] * B


def test_page_bounds_stay_upper_bounds_of_every_score_while_decoding(model):
    """Regression for page bookkeeping after prefill: at every decode step the Quest bound of each
    page is >= the exact q . k of each of its tokens, and the page holding the argmax is selected."""
    layer = quest_layer(model, budget=40)
    g = torch.Generator().manual_seed(2)
    layer.ingest_prefill(torch.randn(1, 2, 75, 16, generator=g), torch.randn(1, 2, 75, 16, generator=g))
    for step in range(20):  # crosses page boundaries (75 -> 95)
        q = torch.randn(1, 4, 1, 16, generator=g)
        layer.attend(q, torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g), 0.25)
        T = layer.seen
        num_pages = -(-T // 8)
        mn, mx = layer.pages.bounds(num_pages)
        keys = layer.buffer.keys[0]  # (H_kv, T, D)
        for h in range(4):
            s = keys[h // 2] @ q[0, h, 0] * 0.25  # (T,)
            bound = (torch.maximum(q[0, h, 0] * mn[0, h // 2], q[0, h, 0] * mx[0, h // 2])).sum(-1) * 0.25
            per_page = torch.nn.functional.pad(s, (0, num_pages * 8 - T), value=float("-inf")).view(num_pages, 8)
            assert (per_page.amax(-1) <= bound + 1e-5).all(), f"step {step}: bound below a real score"
