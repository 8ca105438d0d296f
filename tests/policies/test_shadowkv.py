"""ShadowKV policy: errors, honest device / host accounting, transfers, low-rank rebuild, budget."""
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

import kvpress
from kvpress.kernels import attend_rows
from kvpress.policies._shadowkv_store import TransferCounters, default_rank, fetch_tables, to_host
from kvpress.policies.shadowkv import transfer_summary
from kvpress.prefill import cache_from_dense, dense_prefill
from kvpress.stats import tensor_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import random_ids, tiny_model  # noqa: E402
from shadowkv_helpers import PROMPT, model, small_policy as policy  # noqa: E402,F401  (model: the fixture)
from smollm2_needle import needle_run  # noqa: E402


def attend_selected(layer, q0, k_sel, allow, scaling):
    """The chosen chunks (or tokens) alone attended in torch: ``(out, lse, ids, values)``."""
    keys, rows, ids, values, cnt = layer.selected_rows(q0, k_sel, allow, scaling)
    return (*attend_rows(q0, [(keys, rows, cnt, keys.shape[2])], scale=scaling, backend="torch"), ids, values)


def generate(model, pol, ids, new=6):
    with torch.no_grad(), kvpress.apply(model, pol):
        return model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)


@pytest.mark.parametrize("kw, match", [(dict(chunk_size=12), "chunk_size=12 is not supported"),
                                       (dict(rank=0), "rank=0 is out of range"),
                                       (dict(backend="cuda"), "backend='cuda' is not supported"),
                                       (dict(rerank=0), "rerank=0 is out of range"),
                                       (dict(tail_chunk=12), "multiple of chunk_size=8"),
                                       (dict(tail_chunk=-8), "tail_chunk=-8 is out of range"),
                                       (dict(select="pages"), "select=.pages. is not supported"),
                                       (dict(residual_bits=3),
                                        r"residual_bits=3 is not supported; allowed: \[0, 2, 4, 8\]"),
                                       (dict(residual_bits=4, residual_group=24), "residual_group=24 is not supported"),
                                       (dict(residual_bits=4, fetch_keys=True), "choose one")])
def test_bad_config_is_a_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        policy(**kw)


def test_rank_larger_than_key_dim_is_refused_before_anything_runs(model):
    with pytest.raises(ValueError, match="larger than the key dimension .* 1 <= rank <= 32"):
        with kvpress.apply(model, policy(rank=33)):
            pass
    with torch.no_grad():  # the model is untouched
        model(random_ids(5))


def test_residual_group_not_dividing_head_dim_is_refused_before_anything_runs(model):
    with pytest.raises(ValueError,
                       match="head_dim=16 is not divisible by residual_group=32; allowed for this model: \\[8, 16\\]"):
        with kvpress.apply(model, policy(residual_bits=4, residual_group=32)):
            pass
    with torch.no_grad():
        model(random_ids(5))


def test_device_and_host_bytes_are_separate_and_honest(model):
    out = generate(model, policy(), random_ids(PROMPT))
    cache = out.past_key_values
    stats = kvpress.cache_stats(cache)
    layer = cache.layers[0]
    assert layer.v_host.device.type == "cpu" and "v_host" not in layer.state_tensors()
    assert stats.offloaded_bytes == sum(l.v_host.numel() * l.v_host.element_size() for l in cache.layers)
    assert stats.offloaded_bytes >= stats.dense_bytes // 2 - 2 * 8 * 16 * 4 * 2  # every prompt value, host side
    full = kvpress.cache_stats(generate(model, kvpress.get_policy("full"), random_ids(PROMPT)).past_key_values)
    assert stats.resident_bytes < 0.75 * full.resident_bytes  # low rank + landmarks + exact parts only
    assert layer.factor.shape[-1] == 8 and not bool(layer.row_exact.all())


def test_transfers_are_counted_and_budget_respected(model):
    pol = policy()
    cache = generate(model, pol, random_ids(PROMPT), new=8).past_key_values
    summary = transfer_summary(cache)
    assert summary["steps"] == 7  # the last sampled token is never fed back
    assert summary["fetched_bytes"] > 0 and 0.0 <= summary["reuse_rate"] <= 1.0
    assert summary["requested_chunks"] >= summary["reused_chunks"]
    for layer in cache.layers:
        assert layer.max_attended <= pol.budget
        assert layer.counters.fetched_bytes % (8 * 16 * 4) == 0  # whole fp32 chunks of 8 x 16


def test_fetch_reuses_previous_chunks_and_returns_host_values():
    host = to_host(torch.randn(2, 3, 10, 8, 4))
    counters = TransferCounters()
    ids = torch.tensor([[0, 4, -1], [1, 2, 3], [9, 8, 7]], dtype=torch.int32).expand(2, 3, 3).contiguous()
    first, = fetch_tables([host], ids, None, [None], counters, torch.device("cpu"))
    for b in range(2):
        for h in range(3):
            for s, c in enumerate(ids[b, h].tolist()):
                expect = host[b, h, c] if c >= 0 else torch.zeros(8, 4)
                assert torch.equal(first[b, h, s], expect)
    chunk_bytes = 8 * 4 * 4
    assert counters.fetched_bytes == 2 * 8 * chunk_bytes
    again, = fetch_tables([host], ids.flip(-1).contiguous(), ids, [first], counters, torch.device("cpu"))
    assert torch.equal(again, first.flip(2))
    assert counters.last_fetched_bytes == 0 and counters.reuse_rate == pytest.approx(0.5)


@pytest.mark.parametrize("rank, min_sqnr, family", [(32, 80.0, "llama"), (8, 3.0, "llama"), (32, 80.0, "smollm3")])
def test_rebuilt_keys_match_original_post_rope_keys(model, rank, min_sqnr, family):
    """Full rank rebuilds the keys exactly (RoPE inversion + rotation round trip); low rank is lossy.
    ``smollm3``: its layer 1 applies no RoPE, so its keys are stored and rebuilt unrotated."""
    from kvpress.kernels import shadowkv_rebuild

    if family != "llama":
        model = tiny_model(family)
        assert kvpress.get_adapter(model).nope_layers == (1,)
    ids = random_ids(PROMPT - 3, seed=3)  # 157 tokens: the chunks are shifted by 3
    _, dense = dense_prefill(model, ids)
    cache = cache_from_dense(model, policy(rank=rank), dense)
    layer = cache.layers[1]
    B, H, C, _ = layer.landmarks.shape
    chunks = torch.arange(C, dtype=torch.int32)[None, None].expand(B, H, C)
    chunks = torch.where(layer.selectable, chunks, -1).contiguous()
    keys = shadowkv_rebuild(layer.factor, layer.basis, chunks, layer._rope_inv_freq("cpu"), layer.rope_start,
                            chunk_size=8).view(B, H, C, 8, -1)
    shift = (-ids.shape[1]) % 8
    orig = torch.nn.functional.pad(dense.layers[1].keys, (0, 0, shift, 0)).view(B, H, C, 8, -1)
    sel = layer.selectable[..., None, None].expand_as(orig)
    err = (keys - orig)[sel].double()
    sqnr = 10 * torch.log10(orig[sel].double().pow(2).sum() / err.pow(2).sum())
    assert sqnr > min_sqnr


def _turn_logits(model, pol, ids, more, *, record, one_at_a_time=False, rank_check=False):
    cache = kvpress.make_cache(model, pol)
    with torch.no_grad(), kvpress.apply(model, pol):
        if record:
            cache.activate_past_recording()
        model(ids, past_key_values=cache, use_cache=True)
        pieces = [more[:, i:i + 1] for i in range(more.shape[1])] if one_at_a_time else [more]
        logits = torch.cat([model(p, past_key_values=cache, use_cache=True).logits for p in pieces], 1)
    return logits, cache


def test_verification_forward_after_prefill_equals_one_token_steps(model):
    """With past recording on (assisted decoding) several tokens after the prompt run as decode steps."""
    pol, ids, more = policy(), random_ids(PROMPT, seed=5), random_ids(3, seed=6)
    together, _ = _turn_logits(model, pol, ids, more, record=True)
    steps, _ = _turn_logits(model, pol, ids, more, record=False, one_at_a_time=True)
    torch.testing.assert_close(together, steps, atol=1e-5, rtol=0)


def test_new_turn_attends_the_rebuilt_keys_with_their_residual(model):
    """A new turn's dense pass fetches every selectable chunk's residual beside its values: at rank
    4 of 32 with an 8-bit residual it comes within the residual's step of ``full``'s continuation,
    where the rank-4 keys alone are far off; both fetches are counted as one step."""
    ids, more = random_ids(PROMPT, seed=5), random_ids(20, seed=6)
    full, _ = _turn_logits(model, kvpress.get_policy("full"), ids, more, record=False)
    plain, plain_cache = _turn_logits(model, policy(rank=4), ids, more, record=False)
    fixed, cache = _turn_logits(model, policy(rank=4, residual_bits=8, residual_group=16), ids, more, record=False)
    far, near = (plain - full).abs().max(), (fixed - full).abs().max()
    assert near < far / 20 and near < 1e-2
    a, b = plain_cache.layers[1].counters, cache.layers[1].counters
    assert a.steps == b.steps == 1 and b.fetched_bytes > a.fetched_bytes


def test_new_turn_attends_every_chunk_densely_then_keeps_its_tokens_exact(model):
    """A new turn (no recording) is a prompt continuation: with exact keys (rank = the key
    dimension) it equals ``full``'s continuation; its tokens become generated tokens, its fetch of
    every selectable chunk is counted, and decoding goes on sparsely from there."""
    ids, more = random_ids(PROMPT, seed=5), random_ids(20, seed=6)
    exact_keys = policy(rank=32)  # 2 KV heads x head_dim 16
    turn, cache = _turn_logits(model, exact_keys, ids, more, record=False)
    full, _ = _turn_logits(model, kvpress.get_policy("full"), ids, more, record=False)
    torch.testing.assert_close(turn, full, atol=1e-4, rtol=0)
    layer = cache.layers[1]
    assert layer.gen_len == 20 and layer.seen == PROMPT + 20
    chunks = int(layer.selectable.sum())
    assert layer.counters.steps == 1 and layer.counters.fetched_bytes == chunks * 8 * 16 * 4  # fp32 values
    # the default rank: every token still sees the whole prompt, unlike one decode step per token
    low, _ = _turn_logits(model, policy(), ids, more, record=False)
    steps, _ = _turn_logits(model, policy(), ids, more, record=False, one_at_a_time=True)
    assert (low - full).abs().max() < (steps - full).abs().max()
    with torch.no_grad(), kvpress.apply(model, exact_keys):  # decoding goes on (here the generated
        model(more[:, :1], past_key_values=cache, use_cache=True)  # tokens fill the budget: no chunk)
    assert layer.gen_len == 21 and layer.seen == PROMPT + 21 and layer.counters.steps == 1


def test_low_budget_still_attends_exact_parts(model):
    """A budget below the always-on parts selects no chunk but still decodes (honestly counted)."""
    pol = policy(budget=1)
    cache = generate(model, pol, random_ids(PROMPT), new=3).past_key_values
    layer = cache.layers[0]
    assert layer.counters.steps == 0 and layer.max_attended == layer.exact_max + 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [{}, {"fetch_keys": True},
                                   # a configuration that keeps SmolLM2's 8k needles
                                   {"fetch_keys": True, "svd": "query", "select": "tokens", "rerank": 32},
                                   {"residual_bits": 4, "select": "tokens", "rerank": 32}],
                         ids=["default", "fetch_keys", "fetch_keys-svd_query-tokens", "residual4-tokens"])
def test_cuda_pinned_host_tier_and_triton_path_match_torch_path(extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).cuda().eval()  # head_dim 64: the Triton kernels apply (attend_rows too)
    ids = random_ids(300).cuda()
    outs = {}
    for backend in ("torch", "triton"):
        out = generate(model, policy(budget=96, rank=32, backend=backend, **extra), ids, new=8)
        outs[backend] = out.sequences
        layer = out.past_key_values.layers[0]
        assert layer.v_host.device.type == "cpu" and layer.v_host.is_pinned()
        assert not extra or ((layer.k_host if layer.policy.fetch_keys else layer.kr_host).is_pinned()
                             and layer.sel_keys.is_cuda)
        assert layer.factor.is_cuda and layer.counters.fetched_bytes > 0
    assert torch.equal(outs["torch"], outs["triton"])


def test_batch_select_reorders_the_host_side_budget_tables(model):
    """Beam reorder / batch pruning must move the per-head budget tables kept on the host too."""
    ids = random_ids(PROMPT, batch=2, seed=7)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0 left-padded: its partial first chunk is exact, so its counts differ
    pol = policy()
    with torch.no_grad(), kvpress.apply(model, pol):
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        for layer in cache.layers:
            assert not torch.equal(layer.exact_cnt[0], layer.exact_cnt[1])
        cache.reorder_cache(torch.tensor([1, 1]))
        for layer in cache.layers:
            assert torch.equal(layer._exact_cnt_cpu, layer.exact_cnt.cpu())
            assert torch.equal(layer._sel_cnt_cpu, layer.selectable.sum(-1).cpu())


def _chosen_chunks(layer, q0, k_sel, scaling):
    allow = torch.full(layer.selectable.shape[:2], k_sel)
    layer.sel_idx = layer.sel_values = None
    attend_selected(layer, q0, k_sel, allow, scaling)
    return layer.sel_idx


@pytest.mark.parametrize("reduction", ["max", "softmax_max", "softmax_mean"])
def test_rerank_finds_the_chunk_whose_landmark_hides_a_matching_key(model, reduction):
    """A chunk whose mean key points away from the query but holds one matching key (a needle in
    filler) is missed by landmark scores alone; re-ranking the shortlist by rebuilt keys finds it,
    and with every chunk shortlisted the choice equals the top chunks by exact key scores."""
    from kvpress.kernels import exact_scores, shadowkv_rebuild

    ids = random_ids(PROMPT, seed=11)
    _, dense = dense_prefill(model, ids)
    picks = {}
    for rerank in (1, 32):
        pol = policy(rank=32, score_reduction=reduction, rerank=rerank)  # full rank: rebuilt keys are exact
        layer = cache_from_dense(model, pol, dense).layers[1]
        B, H, C, D = layer.landmarks.shape
        target = int(layer.selectable[0, 0].nonzero()[0])  # the first selectable chunk of KV head 0
        needle = dense.layers[1].keys[0, 0, target * 8 + 3]  # (D,) chunk starts at 0: PROMPT % 8 == 0
        q0 = (needle * 4.0).expand(1, 4, D).contiguous()  # every query head of the batch looks for it
        layer.landmarks[0, 0, target] = -needle * 10  # the landmark points away: landmark top-k misses it
        picks[rerank] = chosen = _chosen_chunks(layer, q0, 3, 0.25)
        if rerank == 32:
            chunks = torch.where(layer.selectable, torch.arange(C, dtype=torch.int32), -1).contiguous()
            keys = shadowkv_rebuild(layer.factor, layer.basis, chunks, layer._rope_inv_freq("cpu"),
                                    layer.rope_start, chunk_size=8)  # (B, H, C*8, D)
            exact = exact_scores(q0, keys, block_size=8, scale=0.25, reduction="max")
            exact = exact.masked_fill(~layer.selectable, float("-inf"))
            expect = exact.topk(3, dim=-1).indices.sort(-1).values.to(torch.int32)
            assert torch.equal(chosen, expect)
    assert target not in picks[1][0, 0].tolist()
    assert target in picks[32][0, 0].tolist()


def test_default_rank_is_a_quarter_of_the_key_dimension_and_at_least_half_a_head(model):
    """rank=None keeps num_kv_heads * head_dim / 4 components (8 of the tiny model's 32), and at least
    head_dim / 2 (a single-KV-head model keeps half its keys' dimension)."""
    assert default_rank(192, 64) == 48  # SmolLM2: 3 KV heads of 64
    assert default_rank(1024, 128) == 256  # Llama-3-8B: 8 KV heads of 128
    assert default_rank(256, 256) == 128  # Gemma 3 270M: one KV head of 256
    _, dense = dense_prefill(model, random_ids(PROMPT, seed=13))
    layer = cache_from_dense(model, policy(rank=None), dense).layers[0]
    assert layer.factor.shape[-1] == 8 and layer.basis.shape[1] == 8


@pytest.mark.slow
def test_smollm2_4k_needle_at_depth_0_is_found_at_a_3_percent_budget():
    """The case that exposed landmark-only selection: SmolLM2, 4k niah_single, needle at depth 0,
    budget 232 (3% of 4k + the always-on chunks); landmarks alone ranked the needle chunk too low."""
    score, stats = needle_run(kvpress.get_policy("shadowkv", budget=232))
    assert score == 1.0
    assert stats.resident_bytes < 0.3 * stats.dense_bytes


@pytest.mark.parametrize("tail_chunk", [8, 32])
def test_tail_is_the_landmark_estimate_of_the_chunks_left_out(model, tail_chunk):
    """`tail_estimate` stands for exactly the selectable chunks a step does not select: their mean keys and
    the mean value of their group's remaining tokens, as computed from the prompt's own keys / values."""
    from kvpress.kernels import reference_landmark_tail_estimate
    from kvpress.policies._shadowkv_select import tail_estimate

    ids = random_ids(PROMPT - 3, seed=17)  # chunks shifted by 3: the row-start partial chunk is exact
    _, dense = dense_prefill(model, ids)
    layer = cache_from_dense(model, policy(tail_chunk=tail_chunk), dense).layers[1]
    B, H, C, D = layer.landmarks.shape
    gen = torch.Generator().manual_seed(0)
    q0 = torch.randn(B, 4, D, generator=gen)
    selectable = [layer.selectable[0, h].nonzero().flatten() for h in range(H)]
    ids_sel = torch.full((B, H, 3), -1, dtype=torch.int32)
    ids_sel[0, 0, :2] = selectable[0][[1, -1]].int()  # two chunks for head 0, one (of another group) for head 1
    ids_sel[0, 1, :1] = selectable[1][2].int()
    values, = fetch_tables([layer.v_host], ids_sel, None, [None], TransferCounters(), torch.device("cpu"))
    out, lse = tail_estimate(q0, layer.landmarks, layer.selectable, layer.tail_v_sum, ids_sel, values,
                             chunk_size=layer.policy.chunk_size, tail_chunk=layer.policy.tail_chunk, scale=0.25)

    shift = (-ids.shape[1]) % 8
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, shift, 0))  # noqa: E731
    keep = layer.selectable.clone()
    for h in range(H):
        keep[0, h, ids_sel[0, h][ids_sel[0, h] >= 0].long()] = False
    m = tail_chunk // 8
    ref_out, ref_lse = reference_landmark_tail_estimate(q0, pad(dense.layers[1].keys), pad(dense.layers[1].values),
                                                        keep, chunk_size=8, group=m, scale=0.25, offset=(-C) % m)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def decode_logits(model, pol, ids, steps=6):
    logits = []
    with torch.no_grad(), kvpress.apply(model, pol):
        out = model(ids, use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    return out.past_key_values, torch.stack(logits, 1)


def test_tail_estimate_brings_a_diffuse_model_back_to_full(model):
    """The tiny random model attends diffusely: dropping the unselected chunks moves the logits far
    from `full`, their landmark estimate (exact keys: full rank) brings them back close."""
    ids = random_ids(200, seed=1)
    _, full = decode_logits(model, kvpress.get_policy("full"), ids)
    _, plain = decode_logits(model, policy(rank=32), ids)
    cache, tail = decode_logits(model, policy(rank=32, tail_chunk=16), ids)
    assert cache.layers[0].counters.steps > 0  # chunks really were selected and fetched
    err_plain, err_tail = (plain[:, 1:] - full[:, 1:]).abs().max(), (tail[:, 1:] - full[:, 1:]).abs().max()
    assert err_plain > 0.1 and err_tail < 0.05 * err_plain


def test_tail_value_sums_are_device_state_counted_in_cache_stats(model):
    ids = random_ids(200, seed=2)
    plain, _ = decode_logits(model, policy(), ids)
    cache, _ = decode_logits(model, policy(tail_chunk=32), ids)
    extra = 0
    for layer, base in zip(cache.layers, plain.layers):
        B, H, C, D = layer.landmarks.shape
        assert layer.tail_v_sum.shape == (B, H, -(-C // 4), D) and layer.tail_v_sum.dtype == torch.float32
        extra += layer.tail_v_sum.nbytes
    stats, base_stats = kvpress.cache_stats(cache), kvpress.cache_stats(plain)
    assert stats.resident_bytes == base_stats.resident_bytes + extra
    assert stats.offloaded_bytes == base_stats.offloaded_bytes


def test_tail_left_padded_rows_estimate_as_when_run_alone(model):
    pol = policy(tail_chunk=16)
    long, short = random_ids(PROMPT, seed=3), random_ids(PROMPT - 13, seed=4)
    batch = torch.zeros(2, PROMPT, dtype=torch.long)
    mask = torch.zeros(2, PROMPT, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 13:], mask[1, 13:] = short[0], 1

    def scores(ids, attention_mask=None):
        with torch.no_grad(), kvpress.apply(model, pol):
            out = model.generate(ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False,
                                 return_dict_in_generate=True, output_scores=True)
        return torch.stack(out.scores, 1)

    both = scores(batch, mask)
    torch.testing.assert_close(both[0], scores(long)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[1], scores(short)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not kvpress.kernels.native.available(), reason="native CPU kernels not built here")
@pytest.mark.parametrize("kw", [dict(), dict(rerank=1), dict(rerank=4, tail_chunk=16),
                                dict(score_reduction="mean", rerank=3), dict(budget=200),
                                dict(select="tokens"), dict(select="tokens", rerank=4, tail_chunk=16),
                                dict(fetch_keys=True, rerank=2), dict(select="tokens", fetch_keys=True, tail_chunk=16),
                                dict(svd="query", select="tokens", rerank=4),
                                dict(residual_bits=4, residual_group=8, rerank=2),
                                dict(select="tokens", residual_bits=2, residual_group=16, tail_chunk=16)])
def test_native_step_decodes_as_the_torch_path(model, kw, monkeypatch):
    """On fp32 CPU tensors ``backend="auto"`` runs a step as `native.shadowkv_select` +
    `native.attend_rows` (+ the tail in torch): same tokens, logits and host transfers as the torch
    path, left-padded batch included; ``budget=200`` covers the prompt (no selection at all)."""
    from kvpress.kernels import native

    calls = []
    real = native.attend_rows
    monkeypatch.setattr(native, "attend_rows", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    ids = random_ids(PROMPT, batch=2, seed=8)
    mask = torch.ones_like(ids)
    mask[1, :29] = 0
    outs = {}
    for backend in ("torch", "auto"):
        with torch.no_grad(), kvpress.apply(model, policy(backend=backend, **kw)):
            outs[backend] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                           return_dict_in_generate=True, output_scores=True)
    assert len(calls) == 2 * 5  # layers x decode steps, all native under "auto", none under "torch"
    assert torch.equal(outs["torch"].sequences, outs["auto"].sequences)
    torch.testing.assert_close(torch.stack(outs["auto"].scores), torch.stack(outs["torch"].scores), atol=1e-4, rtol=0)
    for a, b in zip(outs["torch"].past_key_values.layers, outs["auto"].past_key_values.layers):
        assert a.counters.as_dict() == b.counters.as_dict()


def test_token_selection_takes_the_shortlists_top_tokens_and_attends_them(model):
    """``select="tokens"``: with every chunk shortlisted and exact (full-rank) keys, the step
    attends the top ``allow * chunk_size`` tokens by exact score (GQA group max) -- the same
    budget as chunks, without whole-chunk granularity -- over their rebuilt keys and host values."""
    from kvpress.kernels import shadowkv_rebuild

    ids = random_ids(PROMPT, seed=11)
    _, dense = dense_prefill(model, ids)
    layer = cache_from_dense(model, policy(rank=32, score_reduction="max", rerank=32, select="tokens"),
                             dense).layers[1]
    B, H, C, D = layer.landmarks.shape
    q0 = torch.randn(B, 4, D, generator=torch.Generator().manual_seed(3))
    allow = torch.tensor([[3, 2]])  # chunks' worth of tokens per KV head
    layer.sel_idx = layer.sel_values = None
    out, lse, tok, values = attend_selected(layer, q0, 3, allow, 0.25)
    chunks = torch.where(layer.selectable, torch.arange(C, dtype=torch.int32), -1).contiguous()
    keys = shadowkv_rebuild(layer.factor, layer.basis, chunks, layer._rope_inv_freq("cpu"), layer.rope_start,
                            chunk_size=8)  # (B, H, C*8, D), token c*8+j at slot c*8+j
    logits = (q0.view(B, H, 2, D) * 0.25) @ keys.transpose(-1, -2)  # (B, H, G, C*8)
    score = logits.amax(2).masked_fill(~layer.selectable.repeat_interleave(8, -1), float("-inf"))
    host = layer.v_host.view(B, H, C * 8, D)
    for h in range(H):
        n = int(allow[0, h]) * 8
        expect = score[0, h].topk(n).indices.sort().values
        got = tok[0, h]
        assert torch.equal(got[:n].long(), expect) and (got[n:] == -1).all()
        torch.testing.assert_close(values[0, h, :n], host[0, h, expect])
        p = torch.softmax(logits[0, h][:, expect], -1)  # (G, n) over the chosen tokens' rebuilt keys
        torch.testing.assert_close(out[0, 2 * h:2 * h + 2], p @ host[0, h, expect], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("select", ["chunks", "tokens"])
def test_fetch_keys_attends_the_exact_keys_of_what_the_low_rank_keys_select(model, select):
    """``fetch_keys``: the same selection as the rebuilt keys make (rank 2 of 32: poor keys), but
    attended over the exact post-RoPE keys fetched from the host tier beside the values, counted
    as bytes of the same step; device state as without it but for the fetched keys, host bytes
    doubled."""
    ids = random_ids(PROMPT, seed=12)
    _, dense = dense_prefill(model, ids)
    pol = policy(rank=2, rerank=4, select=select)
    layers = {fk: cache_from_dense(model, replace(pol, fetch_keys=fk), dense).layers[1] for fk in (False, True)}
    layer, plain = layers[True], layers[False]
    B, H, C, D = layer.landmarks.shape
    q0 = torch.randn(B, 4, D, generator=torch.Generator().manual_seed(4))
    allow = torch.tensor([[3, 2]])
    out, lse, sel, values = attend_selected(layer, q0, 3, allow, 0.25)
    ref_out, _, ref_sel, ref_values = attend_selected(plain, q0, 3, allow, 0.25)
    assert torch.equal(sel, ref_sel) and torch.equal(values, ref_values)  # the same selection and values
    assert layer.counters.fetched_bytes == 2 * plain.counters.fetched_bytes > 0
    assert layer.counters.steps == plain.counters.steps == 1
    assert layer.counters.requested_chunks == plain.counters.requested_chunks
    unit = 1 if select == "tokens" else 8
    k_exact = dense.layers[1].buffer.keys  # (B, H, T, D) post-RoPE, no shift: PROMPT is whole chunks
    v_exact = dense.layers[1].buffer.values
    for h in range(H):
        n = int(allow[0, h])
        tok = (sel[0, h, : n * 8 // unit].long()[:, None] * unit + torch.arange(unit)).flatten()
        torch.testing.assert_close(layer.sel_keys.reshape(B, H, -1, D)[0, h, : n * 8], k_exact[0, h, tok])
        logits = (q0[0, 2 * h:2 * h + 2] * 0.25) @ k_exact[0, h, tok].T  # (G, n * 8)
        torch.testing.assert_close(out[0, 2 * h:2 * h + 2], torch.softmax(logits, -1) @ v_exact[0, h, tok],
                                   atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, ref_out, atol=1e-3)  # the rebuilt rank-2 keys attend differently
    # on the device: the same state plus this step's fetched keys (kept for the next step's reuse)
    sel_bytes = layer.sel_keys.numel() * layer.sel_keys.element_size()
    assert tensor_bytes(layer.state_tensors().values()) == tensor_bytes(plain.state_tensors().values()) + sel_bytes
    assert tensor_bytes(layer.host_tensors().values()) == 2 * tensor_bytes(plain.host_tensors().values())


def test_token_tail_subtracts_the_attended_tokens():
    """`tail_estimate` of single tokens: attending whole chunks' tokens gives `tail_estimate` of those
    chunks; with a query of zeros the estimate is the mean value of every selectable token left
    out (a chunk partly attended counts for the tokens it has left)."""
    from kvpress.policies._shadowkv_select import tail_estimate, tail_value_sums

    tail_estimate_tokens = partial(tail_estimate, tokens=True)

    gen = torch.Generator().manual_seed(0)
    B, H, C, cs, D = 1, 2, 12, 8, 4
    v = torch.randn(B, H, C, cs, D, generator=gen)
    landmarks = torch.randn(B, H, C, D, generator=gen)
    selectable = torch.ones(B, H, C, dtype=torch.bool)
    selectable[:, :, :2] = False  # an outlier-like exact part
    v_sum = tail_value_sums(v, selectable, 32)
    chunk_ids = torch.tensor([[[3, 7, -1], [5, -1, -1]]], dtype=torch.int32)
    q = torch.randn(B, 4, D, generator=gen)
    ref = tail_estimate(q, landmarks, selectable, v_sum, chunk_ids, v[0][torch.arange(H)[:, None], chunk_ids[0].clamp(min=0)][None]
                        * (chunk_ids >= 0)[..., None, None], chunk_size=cs, tail_chunk=32, scale=0.5)
    tok = torch.where(chunk_ids[..., None] >= 0, chunk_ids[..., None] * cs + torch.arange(cs), -1).flatten(2)
    tok_v = v.view(B, H, C * cs, D)[0][torch.arange(H)[:, None], tok[0].clamp(min=0).long()][None] * (tok >= 0)[..., None]
    got = tail_estimate_tokens(q, landmarks, selectable, v_sum, tok.int(), tok_v, chunk_size=cs, tail_chunk=32,
                               scale=0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    part = torch.tensor([[[25, 26, 40, -1], [90, -1, -1, -1]]], dtype=torch.int32)  # chunks 3, 5 and 11 in part
    part_v = v.view(B, H, C * cs, D)[0][torch.arange(H)[:, None], part[0].clamp(min=0).long()][None] * (part >= 0)[..., None]
    out, _ = tail_estimate_tokens(torch.zeros(B, 4, D), landmarks, selectable, v_sum, part, part_v, chunk_size=cs,
                                  tail_chunk=32, scale=0.5)
    for h in range(H):
        left = selectable[0, h].repeat_interleave(cs).clone()
        left[part[0, h][part[0, h] >= 0].long()] = False
        expect = v.view(B, H, C * cs, D)[0, h][left].mean(0)
        torch.testing.assert_close(out[0, 2 * h], expect, atol=1e-5, rtol=1e-5)


def _token_tail_by_loops(q, landmarks, selectable, v, ids, *, cs, tail_chunk, scale):
    """`tail_estimate` of single tokens written token by token: group ``g`` of ``tail_chunk // cs`` chunks
    (aligned to the end) stands for its selectable tokens not in ``ids``, with key the mean of
    its chunks' landmarks weighted by the tokens each has left and value those tokens' mean."""
    B, H, C, D = landmarks.shape
    m = tail_chunk // cs
    N = -(-C // m)
    off = N * m - C
    out = torch.zeros(B, q.shape[1], D)
    G = q.shape[1] // H
    for b in range(B):
        for h in range(H):
            attended = set(int(i) for i in ids[b, h] if i >= 0)
            keys, vals, ns = [], [], []
            for g in range(N):
                chunks = [c for c in range(g * m - off, (g + 1) * m - off) if 0 <= c < C and selectable[b, h, c]]
                left = [(c, t) for c in chunks for t in range(cs) if c * cs + t not in attended]
                if not left:
                    continue
                w = {c: sum(1 for cc, _ in left if cc == c) for c in chunks}
                keys.append(sum(w[c] * landmarks[b, h, c] for c in chunks) / len(left))
                vals.append(torch.stack([v[b, h, c, t] for c, t in left]).mean(0))
                ns.append(len(left))
            for i in range(G):
                if not ns:
                    continue
                logits = torch.stack([scale * q[b, h * G + i] @ k for k in keys]) + torch.tensor(ns).float().log()
                out[b, h * G + i] = torch.softmax(logits, 0) @ torch.stack(vals)
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_token_tail_keeps_a_group_mean_key_when_under_a_chunk_is_left(compiled):
    """A group with fewer tokens left than one chunk holds (``select="tokens"``: its chunks count
    for their unattended tokens) keeps the mean of its landmarks as its key (not divided by one
    chunk, which would shrink it), in the torch code and the compiled twin."""
    from kvpress.kernels import native
    from kvpress.policies._shadowkv_select import tail_estimate, tail_value_sums

    tail_estimate_tokens = partial(tail_estimate, tokens=True)

    if compiled and not native.available():
        pytest.skip("native library not built")
    gen = torch.Generator().manual_seed(3)
    B, H, C, cs, D, tail = 1, 2, 10, 4, 8, 16
    v = torch.randn(B, H, C, cs, D, generator=gen)
    landmarks = 3 * torch.randn(B, H, C, D, generator=gen)
    selectable = torch.ones(B, H, C, dtype=torch.bool)
    selectable[:, :, 4:7] = False  # group 1 (chunks 2-5 with the offset of 2) keeps chunks 2 and 3
    ids = torch.full((B, H, 12), -1, dtype=torch.int32)
    ids[0, 0, :7] = torch.tensor([8, 9, 10, 11, 12, 13, 14])  # chunk 2 all, chunk 3 all but token 15
    ids[0, 1, :3] = torch.tensor([13, 14, 15])  # chunk 3 all but token 12: group 1 keeps 1 + 1/4 chunks
    ids[0, 1, 3:5] = torch.tensor([36, 37])  # and chunk 9, in the last group, half
    vals = v.view(B, H, C * cs, D)[0][torch.arange(H)[:, None], ids[0].clamp(min=0).long()][None] * (ids >= 0)[..., None]
    q = torch.randn(B, 4, D, generator=gen)
    kw = dict(chunk_size=cs, tail_chunk=tail, scale=0.5)
    estimate = native.shadowkv_tail if compiled else tail_estimate_tokens
    out, _ = estimate(q, landmarks, selectable, tail_value_sums(v, selectable, tail), ids, vals, **kw)
    expect = _token_tail_by_loops(q, landmarks, selectable, v, ids, cs=cs, tail_chunk=tail, scale=0.5)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tail_chunk", [0, 16])
def test_token_selection_keeps_the_budget_and_equals_full_when_it_covers(model, tail_chunk):
    """Generating past several folds (60 tokens, folds of 24 from the 40th on) under token selection."""
    pol = policy(select="tokens", rerank=4, tail_chunk=tail_chunk, budget=96)
    cache = generate(model, pol, random_ids(PROMPT), new=60).past_key_values
    for layer in cache.layers:
        assert layer.max_attended <= pol.budget and layer.n_chunks > PROMPT // 8  # folded
        assert layer.sel_idx is not None and layer.counters.fetched_bytes % (16 * 4) == 0  # whole fp32 tokens
    ids = random_ids(40, seed=5)
    wide = generate(model, policy(select="tokens", budget=4096), ids)
    ref = generate(model, kvpress.get_policy("full"), ids)
    assert torch.equal(wide.sequences, ref.sequences)


@pytest.mark.parametrize("select", ["chunks", "tokens"])
def test_residual_bits_correct_the_rebuilt_keys_with_a_fetched_residual(model, select):
    """``residual_bits``: the same selection and values as the plain rebuild (rank 2 of 32: poor
    keys), attended over the rebuilt keys plus their quantized residual, fetched from the host tier
    beside the values in one step: the keys then sit within the residual's quantization step of the
    exact ones (8 bits: near exact), and the bytes fetched and held on the host grow by the
    residual rows' width, not by a second fp32 copy of the keys."""
    from kvpress.kernels.quant import dequantize_per_token, quantize_per_token

    ids = random_ids(PROMPT, seed=12)
    _, dense = dense_prefill(model, ids)
    pol = policy(rank=2, rerank=4, select=select)
    plain = cache_from_dense(model, pol, dense).layers[1]
    k_exact = dense.layers[1].buffer.keys  # (B, H, T, D) post-RoPE, no shift: PROMPT is whole chunks
    v_exact = dense.layers[1].buffer.values
    B, H, C, D = plain.landmarks.shape
    q0 = torch.randn(B, 4, D, generator=torch.Generator().manual_seed(4))
    allow = torch.tensor([[3, 2]])
    ref_out, _, ref_sel, ref_values = attend_selected(plain, q0, 3, allow, 0.25)
    rebuilt_err = None
    for bits in (2, 4, 8):
        layer = cache_from_dense(model, replace(pol, residual_bits=bits, residual_group=8), dense).layers[1]
        out, lse, sel, values = attend_selected(layer, q0, 3, allow, 0.25)
        assert torch.equal(sel, ref_sel) and torch.equal(values, ref_values)  # the same selection and values
        width = D * bits // 8 + 4 * D // 8  # codes, then fp16 scales and zeros per group of 8 channels
        assert layer.kr_host.shape == (B, H, C, 8, width) and layer.kr_host.dtype == torch.uint8
        v_bytes = plain.counters.fetched_bytes
        assert layer.counters.fetched_bytes == v_bytes + v_bytes * width // (D * v_exact.element_size())
        assert layer.counters.steps == plain.counters.steps == 1
        unit = 1 if select == "tokens" else 8
        for h in range(H):
            n = int(allow[0, h])
            tok = (sel[0, h, : n * 8 // unit].long()[:, None] * unit + torch.arange(unit)).flatten()
            rebuilt = _rebuilt_keys(plain, sel, select)[0, h, : n * 8]
            exact = k_exact[0, h, tok]
            residual = exact - rebuilt
            codes, scale, zero = quantize_per_token(residual[None, None], bits, 8)
            keys = rebuilt + dequantize_per_token(codes, scale, zero, bits, 8)[0, 0]
            logits = (q0[0, 2 * h:2 * h + 2] * 0.25) @ keys.T  # (G, n * 8)
            torch.testing.assert_close(out[0, 2 * h:2 * h + 2], torch.softmax(logits, -1) @ v_exact[0, h, tok],
                                       atol=1e-5, rtol=1e-5)
            err = (keys - exact).norm() / exact.norm()
            if rebuilt_err is None:
                rebuilt_err = (rebuilt - exact).norm() / exact.norm()
            assert err < rebuilt_err / {2: 3, 4: 15, 8: 200}[bits]  # each 2 bits: ~4x less error
        assert not torch.allclose(out, ref_out, atol=1e-3)
        # on the device: the same state plus this step's fetched residual rows (kept for reuse)
        sel_bytes = layer.sel_keys.numel() * layer.sel_keys.element_size()
        assert tensor_bytes(layer.state_tensors().values()) == tensor_bytes(plain.state_tensors().values()) + sel_bytes
        assert (tensor_bytes(layer.host_tensors().values())
                == tensor_bytes(plain.host_tensors().values()) + layer.kr_host.numel())


def _rebuilt_keys(layer, sel, select):
    """The low-rank keys (B, H, n, D) of the chosen chunks (``tokens``: of the chosen tokens)."""
    from kvpress.kernels import shadowkv_rebuild

    B, H, C, D = layer.landmarks.shape
    if select == "chunks":
        return shadowkv_rebuild(layer.factor, layer.basis, sel, layer._rope_inv_freq("cpu"), layer.rope_start,
                                chunk_size=8)
    every = torch.arange(C, dtype=torch.int32).expand(B, H, -1).contiguous()
    keys = shadowkv_rebuild(layer.factor, layer.basis, every, layer._rope_inv_freq("cpu"), layer.rope_start,
                            chunk_size=8)  # (B, H, C * 8, D), token t at slot t
    return torch.gather(keys, 2, sel.clamp(min=0).long()[..., None].expand(-1, -1, -1, D))
