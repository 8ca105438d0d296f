"""TidalDecode: selection reuse and refresh, exact budgets, layer defaults, the layer finder, bad input."""

import dataclasses
import warnings

import pytest
import torch

import kvpress
from kvpress.attention import dense_causal_attention
from kvpress.cache import PolicyCache
from kvpress.evals.tidal_layers import layer_recalls, pair_score, pick_layers
from kvpress.policies.tidal import artifact_name, measured_layers

from conftest import tiny_model
from smollm2_needle import beside_full


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=4)  # 4 query heads, 2 KV heads, head_dim 16


def make_cache(model, **fields):
    policy = kvpress.get_policy("tidal", **{"selection_layer": 1, "reselection_layer": 2, "budget": 20,
                                            "sink_tokens": 2, "recent_tokens": 3, **fields})
    return PolicyCache(policy, kvpress.get_adapter(model))


def prefill(cache, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        layer.ingest_prefill(torch.randn(1, 2, length, 16, generator=g), torch.randn(1, 2, length, 16, generator=g))


def decode(cache, layer_ids, seed=1):
    g = torch.Generator().manual_seed(seed)
    outs = {}
    for i in layer_ids:
        q, k, v = (torch.randn(1, h, 1, 16, generator=g) for h in (4, 2, 2))
        outs[i] = cache.layers[i].attend(q, k, v, 0.25)
    return outs


def test_selection_layers_select_and_the_others_reuse(model):
    cache = make_cache(model)
    assert [type(l).__name__ for l in cache.layers] == ["DenseLayer", "TidalLayer", "TidalLayer", "TidalLayer"]
    assert [getattr(l, "selects", None) for l in cache.layers] == [None, True, True, False]
    prefill(cache, 64)
    decode(cache, [0, 1])
    first = cache.step_shared["tidal_index"][65]  # the selection for sequence length 65
    decode(cache, [2])
    refreshed = cache.step_shared["tidal_index"][65]
    assert refreshed is not first  # the re-selection layer replaced the selection
    assert refreshed.num_attended().tolist() == [[20, 20]]  # sinks + recent + top tokens == budget
    mask = refreshed.token_mask(65)[0]
    assert mask[:, :2].all() and mask[:, 62:65].all()  # sinks and recent tokens never dropped
    calls = []
    layer3 = cache.layers[3]
    original = layer3.sparse_attend
    layer3.sparse_attend = lambda q, index, scaling: (calls.append(index), original(q, index, scaling))[1]
    decode(cache, [3])
    assert calls == [refreshed]


def test_selected_tokens_are_the_top_exact_scores(model):
    cache = make_cache(model, reselection_layer=-1, sink_tokens=0, recent_tokens=1, budget=9)
    prefill(cache, 50)
    layer = cache.layers[1]
    q = torch.randn(1, 4, 1, 16)
    out = layer.attend(q, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0.25)
    index = cache.step_shared["tidal_index"][51]
    keys = layer.buffer.keys[0]  # (H_kv, 51, D)
    # the selection layer itself attends every token (its q . k also feeds the selection)
    dense = dense_causal_attention(q, layer.buffer.keys, layer.buffer.values, 0.25, q_start=50)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    for h in range(2):
        probs = torch.softmax(q[0, 2 * h : 2 * h + 2, 0] @ keys[h, :50].T * 0.25, -1).amax(0)  # group softmax-max
        want = set(torch.topk(probs, 8).indices.tolist())
        assert set(index.block_idx[0, h, : int(index.block_cnt[0, h])].tolist()) == want


def test_shared_selection_gives_every_kv_head_the_tokens_any_head_ranks_highest(model):
    cache = make_cache(model, reselection_layer=-1, sink_tokens=0, recent_tokens=1, budget=9, shared_selection=True)
    prefill(cache, 50)
    layer = cache.layers[1]
    q = torch.randn(1, 4, 1, 16)
    layer.attend(q, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0.25)
    index = cache.step_shared["tidal_index"][51]
    keys = layer.buffer.keys[0]  # (H_kv, 51, D)
    probs = torch.stack([torch.softmax(q[0, 2 * h : 2 * h + 2, 0] @ keys[h, :50].T * 0.25, -1).amax(0)
                         for h in range(2)]).amax(0)  # group softmax-max, then max over the KV heads
    want = set(torch.topk(probs, 8).indices.tolist())
    for h in range(2):
        assert set(index.block_idx[0, h, : int(index.block_cnt[0, h])].tolist()) == want


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("sinks,recent", [(0, 1), (2, 3)])
def test_unpadded_hot_path_selects_what_the_masked_path_selects(model, sinks, recent, shared):
    cache = make_cache(model, reselection_layer=-1, sink_tokens=sinks, recent_tokens=recent, budget=17,
                       shared_selection=shared)
    prefill(cache, 90, seed=5)
    layer = cache.layers[1]
    layer.buffer.append(torch.randn(2, 2, 1, 16)[:1], torch.randn(2, 2, 1, 16)[:1])  # the step's token
    layer.seen += 1
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(6))
    out_fast, fast = layer._attend_and_select(q, 0.25)
    cache.set_left_padding(torch.zeros(1, dtype=torch.long))  # no row padded, but the masked path runs
    out_slow, slow = layer._attend_and_select(q, 0.25)
    assert fast.id_range == (sinks, 91 - recent - 1) and slow.id_range is None  # the hot path really ran
    torch.testing.assert_close(out_fast, out_slow, rtol=0, atol=0)
    assert torch.equal(fast.token_mask(91), slow.token_mask(91))
    assert fast.num_attended().tolist() == [[17, 17]]
    fast.validate()


def test_a_sparse_layer_without_a_fresh_selection_refuses(model):
    cache = make_cache(model)
    prefill(cache, 64)
    with pytest.raises(RuntimeError, match="no selection for this step"):
        decode(cache, [3])


def test_default_layers_come_from_the_measurement_or_the_paper(model):
    adapter = kvpress.get_adapter(model)
    policy = kvpress.get_policy("tidal", selection_layer=0)
    with pytest.warns(UserWarning, match="middle layer 2"):
        assert policy.layers_for(adapter) == (0, 2)
    assert policy.replace(reselection_layer=-1).layers_for(adapter) == (0, None)
    # unmeasured model: the paper's selection layer 2 (4 layers: the middle is 2, so no re-selection)
    assert kvpress.get_policy("tidal").layers_for(adapter) == (2, None)
    # the shipped SmolLM2 measurement (both layers) is found by model name and shape
    smol = dataclasses.replace(adapter, model_id="HuggingFaceTB/SmolLM2-135M-Instruct", num_layers=30,
                               num_kv_heads=3, head_dim=64)
    measured = measured_layers(smol.model_id, 30, 3, 64)
    assert measured is not None and 0 < measured[0] < measured[1] < 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kvpress.get_policy("tidal").layers_for(smol) == measured
        # a measured pair whose re-selection sits right after the selection layer leaves every later
        # layer on a stale selection: the SmolLM2 needles failed even at budget 1024 with (2, 3)
        assert measured[1] - measured[0] > 2
    assert artifact_name("/x/kvpress/smollm2-135m-instruct/tf-5.23.0-abc") == artifact_name(smol.model_id)


def _records(num_layers, planted_from, T=48, M=4, H_kv=2, G=2, D=16, seed=0):
    """Finder records: random heads, except that from layer ``planted_from`` on one head of each
    group reads one far-away token per query (a retrieval head), which no earlier layer attends."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for layer in range(num_layers):
        k = torch.randn(1, H_kv, T, D, generator=g) * 0.3
        q = torch.randn(1, H_kv * G, M, D, generator=g) * 0.3
        if layer >= planted_from:
            for h in range(H_kv):
                for m in range(M):
                    target = 3 + 5 * m + h
                    k[0, h, target] = torch.randn(D, generator=g)
                    q[0, h * G, m] = 8 * k[0, h, target]
        records.append((q, k, 0.25))
    return records


def test_layer_finder_recall_is_one_when_the_budget_covers_everything():
    records = _records(4, planted_from=2)
    full = layer_recalls(records, budget=48)
    assert all(torch.allclose(r, torch.ones_like(r)) for per in full.values() for r in per.values())
    partial = layer_recalls(records, budget=4)
    assert all(((0 <= r) & (r <= 1 + 1e-6)).all() for per in partial.values() for r in per.values())


def test_layer_finder_refreshes_where_retrieval_heads_start_and_prefers_an_early_selection_layer():
    records = _records(6, planted_from=3)
    recall = layer_recalls(records, budget=6)
    # layer 3's own selection holds the planted tokens; layer 1's does not
    assert float(recall[3][4][0].min()) > 0.9 and float(recall[1][4][0].max()) < 0.5
    (sel, resel), scores = pick_layers(recall, selection_layers=[1, 2], tolerance=0.0)
    assert (sel, resel) == (2, 3)  # best score: layer 2 is exact, layer 3 refreshes for the retrieval heads
    assert scores[(1, 3)] > scores[(1, 2)] and scores[(1, 3)] > scores[(1, -1)]  # (1, 2): refresh too early
    margin = scores[(2, 3)] - scores[(1, 3)]
    assert pick_layers(recall, [1, 2], tolerance=margin + 1e-6)[0] == (1, 3)  # the earlier layer within tolerance
    assert pair_score(recall, 3, -1) > pair_score(recall, 1, -1)


def test_bad_input_is_a_clear_error(model):
    with pytest.raises(ValueError, match="budget >= 5"):
        kvpress.get_policy("tidal", budget=4, sink_tokens=4, recent_tokens=1)
    with pytest.raises(ValueError, match="reselection_layer"):
        kvpress.get_policy("tidal", selection_layer=3, reselection_layer=2)
    with pytest.raises(ValueError, match="recent_tokens"):
        kvpress.get_policy("tidal", recent_tokens=0)
    with pytest.raises(ValueError, match="selection_layer"):
        with kvpress.apply(model, kvpress.get_policy("tidal", selection_layer=4, reselection_layer=-1)):
            pass
    with pytest.raises(ValueError, match="reselection_layer"):
        with kvpress.apply(model, kvpress.get_policy("tidal", selection_layer=1, reselection_layer=4)):
            pass


@pytest.mark.smollm2
def test_smollm2_sparse_decode_follows_full_when_few_tokens_are_dropped():
    ref, res = beside_full(kvpress.get_policy("tidal", budget=500))
    assert torch.equal(res.tokens, ref.tokens)  # 12+ of 512 tokens dropped per step in 26 layers
    assert res.stats.resident_bytes == ref.stats.resident_bytes  # tidal keeps the whole cache


def test_layer_finder_on_passkey_prompts_reads_the_answer_queries(model):
    """``--text passkey``: the queries are each prompt's teacher-forced answer tokens, joined
    over the prompts along the query axis."""
    import random

    from kvpress.evals.models import byte_tokenizer
    from kvpress.evals.tidal_layers import calibration_recalls
    from kvpress.policies._duo_calibrate import passkey_sample

    tok = byte_tokenizer()
    rng = random.Random(0)
    answers = [ids.shape[1] - start for ids, start in
               (passkey_sample(tok, 400, rng, num_passkeys=4, passkey_words=3) for _ in range(2))]
    recall = calibration_recalls(model, tok, "passkey", 400, queries=0, budget=32, min_source=1, samples=2)
    assert sorted(recall) == [1, 2, 3] and sorted(recall[1]) == [2, 3]
    for by_layer in recall.values():
        for values in by_layer.values():
            assert values.shape == (4, sum(answers)) and bool(((values >= 0) & (values <= 1 + 1e-5)).all())
    covered = calibration_recalls(model, tok, "passkey", 400, queries=0, budget=10_000, min_source=1, samples=2)
    assert all(torch.allclose(v, torch.ones_like(v)) for per in covered.values() for v in per.values())


def test_layer_finder_skips_layers_the_model_slides():
    """With only some layers recorded (a model's full-attention layers), recalls, pair scores and
    the chosen pair use those layers alone; a selection layer without a later one never wins."""
    records = _records(6, planted_from=3)
    recorded = {i: records[i] for i in (0, 1, 3, 5)}  # layers 2 and 4 slide
    recall = layer_recalls(recorded, budget=6)
    assert sorted(recall) == [0, 1, 3, 5] and sorted(recall[1]) == [3, 5] and recall[5] == {}
    for s in recall:
        for l, r in recall[s].items():
            torch.testing.assert_close(r, layer_recalls(records, budget=6)[s][l])  # the same numbers
    (sel, resel), scores = pick_layers(recall, selection_layers=[1, 2, 5], tolerance=0.0)
    assert {s for s, _ in scores} == {1} and {r for _, r in scores} == {-1, 3, 5}
    assert (sel, resel) == (1, 3)  # layer 3 refreshes for the retrieval heads planted from layer 3
    with pytest.raises(ValueError, match="none of the selection layers"):
        pick_layers(recall, selection_layers=[2, 5])
