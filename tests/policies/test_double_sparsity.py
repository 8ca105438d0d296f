"""Double Sparsity: artifact checks, label cache, honest budget, identity, calibration ranking."""

import pytest
import torch

import kvpress
from kvpress.calibration import CALIBRATORS, save_artifact, shipped_artifact
from kvpress.kernels import build_labels, native
from kvpress.policies import _double_sparsity_calib as calib
from kvpress.policies.double_sparsity import dequantize_labels, quantize_labels, synthetic_artifact

from conftest import random_ids, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def adapter(model):
    return kvpress.get_adapter(model)


@pytest.fixture(scope="module")
def artifact(adapter):
    return str(synthetic_artifact(adapter))


def policy(artifact, **kw):
    kw = {"budget": 20, "sink_tokens": 2, "window_size": 4, "label_channels": 2, **kw}
    return kvpress.get_policy("double_sparsity", artifact=artifact, **kw)


def prefill_then_decode(model, pol, ids, steps):
    """Greedy decode ``steps`` tokens by hand; returns the cache and the last logits."""
    with torch.no_grad(), kvpress.apply(model, pol):
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1]


# ----------------------------------------------------------------------------- artifact
def test_artifact_round_trip_and_metadata(adapter, artifact, tmp_path):
    tensors, meta = kvpress.calibration.load_artifact(artifact, policy="double_sparsity", version=calib.VERSION)
    assert meta["num_layers"] == "2" and meta["num_kv_heads"] == "2" and meta["head_dim"] == "16"
    assert meta["num_heads"] == "4" and meta["rope_layout"] == "rotate_half"
    path = calib.save(tmp_path / "a.safetensors", tensors, adapter)
    rank = calib.load(path, adapter)
    assert torch.equal(rank, tensors["channel_rank"].long())
    assert torch.equal(rank, calib.rank_channels(tensors["importance"]).long())


@pytest.mark.parametrize("other", [dict(layers=3), dict(heads=2, kv_heads=1), dict(heads=8, kv_heads=2)])
def test_artifact_for_another_model_is_a_clear_error(artifact, other):
    # another layer count, KV-head count, or query-head count than the artifact's model
    wrong = tiny_model("llama", **other)
    with pytest.raises(ValueError, match="calibrated for another model"):
        with kvpress.apply(wrong, policy(artifact)):
            pass


def test_head_dim_mismatch_is_a_clear_error(adapter, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    other = LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="head_dim: artifact 16 vs model 32"):
        kvpress.make_cache(other, policy(str(synthetic_artifact(adapter)), label_channels=2))


def test_model_name_and_shape_checks(adapter, artifact, tmp_path):
    tensors, _ = kvpress.calibration.load_artifact(artifact, policy="double_sparsity", version=calib.VERSION)

    class Renamed:  # the same shapes, another model name
        def __getattr__(self, name):
            return "someorg/other-model" if name == "model_id" else getattr(adapter, name)

    path = save_artifact(tmp_path / "b.safetensors", tensors, policy="double_sparsity", version=calib.VERSION,
                         adapter=Renamed())
    with pytest.raises(ValueError, match="other-model"):
        calib.load(path, adapter)
    bad = save_artifact(tmp_path / "c.safetensors", {"channel_rank": torch.zeros(2, 2, 16, dtype=torch.int16)},
                        policy="double_sparsity", version=calib.VERSION, adapter=adapter)
    with pytest.raises(ValueError, match="permutations"):
        calib.load(bad, adapter)
    with pytest.raises(ValueError, match="version"):
        kvpress.calibration.load_artifact(artifact, policy="double_sparsity", version=calib.VERSION + 1)


def test_missing_artifact_names_the_calibrate_command(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="kvpress calibrate double_sparsity"):
        kvpress.make_cache(model, policy(str(tmp_path / "none.safetensors")))
    # no artifact given and the model is not SmolLM2: the error tells how to make one
    with pytest.raises(ValueError, match="kvpress calibrate double_sparsity"):
        kvpress.make_cache(model, kvpress.get_policy("double_sparsity"))
    assert "double_sparsity" in CALIBRATORS
    assert shipped_artifact(calib.SHIPPED).is_file()


def test_bad_config_values(model, artifact):
    with pytest.raises(ValueError, match="always-attended"):
        policy(artifact, budget=6)  # 2 sinks + 4 window
    with pytest.raises(ValueError, match="always-attended"):
        policy(artifact).with_budget(5)
    with pytest.raises(ValueError, match="label_bits"):
        policy(artifact, label_bits=8)
    with pytest.raises(ValueError, match=r"1 <= label_channels <= 4"):  # head_dim 16: r in 16/16 .. 16/4
        kvpress.make_cache(model, policy(artifact, label_channels=5))
    with pytest.raises(ValueError, match="rerank=0 is out of range"):
        policy(artifact, rerank=0)


# ----------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("bits", [16, 4])
def test_label_cache_equals_recompute_after_appends(model, artifact, bits):
    pol = policy(artifact, label_bits=bits)
    cache, _ = prefill_then_decode(model, pol, random_ids(30, seed=7), steps=5)
    for layer in cache.layers:
        keys = layer.buffer.keys  # (B, H_kv, T, D)
        expected = build_labels(keys, layer.label_cache.channels)  # (B, H_kv, T, r)
        assert layer.label_cache.length == keys.shape[2] == 35
        if bits == 16:
            assert torch.equal(layer.label_cache.view(), expected)
        else:
            err = (layer.label_cache.view() - expected.float()).abs()
            span = expected.float().amax(-1, keepdim=True) - expected.float().amin(-1, keepdim=True)
            assert bool((err <= span / 30 + 1e-3).all())  # half a 4-bit step (+ fp16 scale rounding)
            assert layer.label_cache.label_codes.dtype == torch.uint8 and layer.label_cache.labels is None
        named = layer.state_tensors()
        assert named["labels" if bits == 16 else "label_codes"] is not None


def test_quantize_labels_round_trip_odd_r():
    x = torch.randn(2, 3, 5, 3)
    packed, scale, zero = quantize_labels(x)
    assert packed.shape == (2, 3, 5, 2) and packed.dtype == torch.uint8
    back = dequantize_labels(packed, scale, zero, 3)
    assert bool(((back - x).abs() <= scale.float() / 2 + 1e-3).all())


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_label_bytes_are_counted(model, artifact, backend):
    if backend == "auto" and not native.available():
        pytest.skip("native CPU kernels not built here")
    ids = random_ids(30, seed=8)
    stats = {}
    for bits in (16, 4):
        pol = policy(artifact, label_bits=bits, backend=backend, tail_chunk=0)  # labels only: no tail sums
        cache, _ = prefill_then_decode(model, pol, ids, steps=1)
        stats[bits] = kvpress.cache_stats(cache).resident_bytes
    full, _ = prefill_then_decode(model, kvpress.get_policy("full"), ids, steps=1)
    dense = kvpress.cache_stats(full).resident_bytes
    # KV buffers (capacity 128) + r=2 fp32 labels per key; 4-bit: 1 code byte + 2+2 bytes scale/zero
    per_layer_tokens = 2 * 128  # batch 1 x 2 KV heads x capacity
    # + the decode hot path's cached constants: torch: query channel index (B, H_q, r) int64, fp32
    # zero; native (16-bit labels): the index's per-head count (B, H_kv) int32
    hot = 1 * 4 * 2 * 8 + 4 if backend == "torch" else 1 * 2 * 4
    assert stats[16] - dense == 2 * (per_layer_tokens * 2 * 4 + 2 * 2 * 8 + hot)  # labels + channels (int64)
    assert stats[4] - dense == 2 * (per_layer_tokens * (1 + 2 + 2) + 2 * 2 * 8)


@pytest.mark.parametrize("batch_pad", [False, True])
def test_attended_tokens_equal_budget(model, artifact, batch_pad):
    pol = policy(artifact)
    if batch_pad:
        ids = torch.cat([random_ids(40, seed=9), torch.cat([torch.zeros(1, 10, dtype=torch.long), random_ids(30, seed=10)], 1)])
        mask = torch.ones_like(ids)
        mask[1, :10] = 0
    else:
        ids, mask = random_ids(40, seed=9), None
    with torch.no_grad(), kvpress.apply(model, pol):
        out = model(ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        mask = None if mask is None else torch.cat([mask, torch.ones_like(nxt)], 1)
        model(nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
    q = torch.randn(ids.shape[0], 4, 16)
    for layer in cache.layers:
        index = layer.select(q, 0.25)
        index.validate(num_kv_heads=2, capacity=layer.buffer.k.shape[2])
        attended = index.num_attended()  # (B, H_kv)
        assert index.block_size == 1
        assert bool((attended == pol.budget).all()), attended
        # sinks and the recent window are always attended
        mask_t = index.token_mask(layer.seen)
        start = 0 if layer.row_start is None else layer.row_start
        for b in range(ids.shape[0]):
            s = 0 if layer.row_start is None else int(start[b])
            assert bool(mask_t[b, :, s : s + pol.sink_tokens].all())
            assert bool(mask_t[b, :, layer.seen - pol.window_size :].all())
            assert not bool(mask_t[b, :, :s].any())


def test_selection_prefers_high_label_scores(model, artifact):
    """With ``rerank=1`` (the labels alone choose) the selected middle tokens are exactly the top
    label-score tokens (G = 2 query heads per KV head)."""
    pol = policy(artifact, group_reduction="max", rerank=1)
    cache, _ = prefill_then_decode(model, pol, random_ids(40, seed=11), steps=1)
    layer = cache.layers[1]
    q = torch.randn(1, 4, 16)
    index = layer.select(q, 0.25)
    labels = layer.label_cache.view()[0]  # (H_kv, T, r)
    qc = q[0].reshape(2, 2, 16).gather(-1, layer.label_cache.channels[:, None, :].expand(2, 2, 2))  # (H_kv, G, r)
    scores = (qc @ labels.transpose(-1, -2)).amax(1)  # (H_kv, T)
    mid = slice(pol.sink_tokens, layer.seen - pol.window_size)
    k = pol.budget - pol.sink_tokens - pol.window_size
    for h in range(2):
        want = set((scores[h, mid].topk(k).indices + pol.sink_tokens).tolist())
        got = set(index.block_idx[0, h, : index.block_cnt[0, h]].tolist())
        assert got == want


@pytest.mark.parametrize("reduction", ["max", "softmax_max", "softmax_mean"])
@pytest.mark.parametrize("batch_pad", [False, True])
def test_rerank_of_every_candidate_is_exact_top_k(model, artifact, reduction, batch_pad):
    """Labels shortlist ``rerank`` x the kept tokens, exact keys choose among them; a shortlist of
    every candidate is exact top-k selection (the same sinks, window and group reduction)."""
    ids = torch.cat([random_ids(40, seed=9), torch.cat([torch.zeros(1, 10, dtype=torch.long), random_ids(30, seed=10)], 1)])
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    if not batch_pad:
        ids, mask = ids[:1], mask[:1]
    q = torch.randn(ids.shape[0], 4, 16, generator=torch.Generator().manual_seed(0))
    chosen = {}
    for name, kw in [("exact_topk", {}), ("double_sparsity", dict(label_channels=2, rerank=100)),
                     ("double_sparsity", dict(label_channels=2, rerank=2)),
                     ("double_sparsity", dict(label_channels=2, rerank=1))]:
        pol = kvpress.get_policy(name, budget=20, sink_tokens=2, window_size=4, group_reduction=reduction,
                                 **({"artifact": artifact} if name == "double_sparsity" else {}), **kw)
        with torch.no_grad(), kvpress.apply(model, pol):
            cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        layer = cache.layers[1]
        chosen[(name, kw.get("rerank"))] = layer.select(q, 0.25).token_mask(layer.seen)
    exact = chosen[("exact_topk", None)]
    assert torch.equal(chosen[("double_sparsity", 100)], exact)
    assert not torch.equal(chosen[("double_sparsity", 1)], exact)  # labels alone choose otherwise here
    assert chosen[("double_sparsity", 2)].sum() == exact.sum()  # the budget holds with a short list too


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")
@pytest.mark.parametrize("kw", [{}, dict(rerank=3), dict(rerank=3, tail_chunk=8), dict(group_reduction="softmax_max"),
                                dict(rerank=2, tail_chunk=5, group_reduction="mean")], ids=str)
def test_native_hot_path_decodes_as_torch(model, artifact, kw, monkeypatch):
    """backend="auto" on CPU fp32 runs the compiled selection and attention (`kvpress.kernels.native`);
    the torch backend is its reference: same selections, logits to fp32 rounding."""
    calls = []
    for name in ("label_select", "sparse_decode"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    ids = random_ids(48, seed=21)
    _, ref = prefill_then_decode(model, policy(artifact, backend="torch", **kw), ids, steps=8)
    assert calls == []
    _, got = prefill_then_decode(model, policy(artifact, **kw), ids, steps=8)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert calls.count("label_select") == 2 * 8 and calls.count("sparse_decode") == 2 * 8  # 2 layers x 8 steps


@pytest.mark.parametrize("bits", [16, 4])
def test_large_budget_equals_full_and_small_budget_differs(artifact, model, bits):
    ids = random_ids(40, seed=12)
    _, ref = prefill_then_decode(model, kvpress.get_policy("full"), ids, steps=6)
    _, same = prefill_then_decode(model, policy(artifact, budget=64, label_bits=bits), ids, steps=6)
    torch.testing.assert_close(same, ref, atol=1e-5, rtol=0)
    _, small = prefill_then_decode(model, policy(artifact, budget=12, label_bits=bits), ids, steps=6)
    assert not torch.allclose(small, ref, atol=1e-4)


# ----------------------------------------------------------------------------- calibration
def test_channel_importance_matches_brute_force():
    """mean_{g,t} q_c^2 * var_s k_c: the variance of the channel's score term across keys."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 7, 8, generator=gen), torch.randn(2, 7, 8, generator=gen)
    got = calib.channel_importance(q, k)
    want = torch.zeros(2, 8)
    for kv in range(2):
        for c in range(8):
            q_sq = sum(float(q[h, t, c]) ** 2 for h in (2 * kv, 2 * kv + 1) for t in range(7)) / 14
            mean = sum(float(k[kv, s, c]) for s in range(7)) / 7
            want[kv, c] = q_sq * sum((float(k[kv, s, c]) - mean) ** 2 for s in range(7)) / 6
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_channel_importance_ignores_a_constant_key_channel():
    """A channel whose key is the same for every token adds the same score to all keys: rank last."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 16, 4, generator=gen), torch.randn(1, 16, 4, generator=gen)
    k[..., 2] = 50.0  # huge but constant: the magnitude statistic would rank it first
    got = calib.channel_importance(q, k)
    assert float(got[0, 2]) == 0.0 and calib.rank_channels(got)[0, -1] == 2
    with pytest.raises(ValueError, match="T >= 2"):
        calib.channel_importance(q[:, :1], k[:, :1])


def test_calibration_ranks_the_channels_that_carry_qk():
    """Scale the q/k projection rows of a known channel pair: calibration must rank them first."""
    m = tiny_model("llama", layers=1, heads=4, kv_heads=2, seed=3)
    attn = kvpress.get_adapter(m).attention_modules()[0]
    loud = {0: (3, 11), 1: (5, 13)}  # per KV head: channels c and c + D/2 (RoPE rotates them together)
    with torch.no_grad():
        for kv, chans in loud.items():
            for c in chans:
                attn.k_proj.weight[kv * 16 + c] *= 8
                for g in range(2):  # both query heads of the group
                    attn.q_proj.weight[(kv * 2 + g) * 16 + c] *= 8
    ids = torch.randint(3, 250, (64,), generator=torch.Generator().manual_seed(0))
    out = calib.calibrate(m, ids, seq_len=32)
    assert out["importance"].shape == (1, 2, 16) and out["channel_rank"].dtype == torch.int16
    for kv, chans in loud.items():
        assert set(out["channel_rank"][0, kv, :2].tolist()) == set(chans)
    assert m.config._attn_implementation == "sdpa"  # the observed attention is put back


# ----------------------------------------------------------------------------- SmolLM2
@pytest.mark.smollm2
def test_smollm2_shipped_artifact_smoke():
    from kvpress.evals.tasks import get_task
    from kvpress.generation import timed_generate

    model, tok = kvpress.load_model("smollm2")
    ids = torch.tensor([get_task("ppl").token_ids(tok, 160)])
    pol = kvpress.get_policy("double_sparsity", budget=64)  # shipped artifact, no path given
    res = timed_generate(model, ids, pol, max_new_tokens=3, keep_cache=True)
    assert res.tokens.shape == (1, 3)
    layer = res.cache.layers[0]
    assert layer.label_cache.channels.shape == (3, 16)  # SmolLM2: 3 KV heads, r sized from the artifact: 16
    assert layer._validated  # the sparse decode path ran
    index = layer.select(torch.randn(1, 9, 64), 0.125)
    assert bool((index.num_attended() == 64).all())
    labels = 30 * 3 * layer.buffer.k.shape[2] * 16 * 4  # fp32 labels of every layer (capacity rows)
    assert res.stats.resident_bytes == kvpress.cache_stats(res.cache).resident_bytes >= res.stats.dense_bytes + labels


def test_default_label_channels_carry_three_quarters_of_the_importance(model, adapter, tmp_path):
    """label_channels=None: the fewest channels (steps of head_dim // 16, at most head_dim // 4) whose
    calibrated importance, averaged over the heads of the full-attention layers, reaches 3/4; the
    layers keep the artifact's top channels of that count."""
    L, H, D = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
    assert D // 16 <= 1 and D // 4 >= 4  # steps of one channel up to four at this shape
    gen = torch.Generator().manual_seed(0)
    importance = torch.full((L, H, D), 0.2 / (D - 3))
    for layer in range(L):
        for head in range(H):
            top = torch.randperm(D, generator=gen)[:3]
            importance[layer, head, top] = torch.tensor([0.3, 0.3, 0.2])  # top 2: 0.6, top 3: 0.8
    path = tmp_path / "shares.safetensors"
    calib.save(path, {"importance": importance, "channel_rank": calib.rank_channels(importance)}, adapter)
    pol = kvpress.get_policy("double_sparsity", artifact=str(path), budget=20, sink_tokens=2, window_size=4)
    assert pol.channels_for(adapter) == 3
    assert calib.default_channels(path, adapter, coverage=0.5) == 2
    assert calib.default_channels(path, adapter, coverage=0.99) == D // 4  # none reaches it: the most allowed
    cache = kvpress.make_cache(model, pol)
    with kvpress.apply(model, pol):
        model(random_ids(12, seed=3), past_key_values=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        assert set(layer.label_cache.channels[0].tolist()) == set(calib.rank_channels(importance)[i, 0, :3].tolist())


def test_calibrate_command_is_registered():
    from kvpress.cli import make_parser

    args = make_parser().parse_args(["calibrate", "double_sparsity", "--out", "x.safetensors", "--tokens", "512"])
    assert args.func is calib.run_cli and args.tokens == 512 and args.model == "smollm2"


@pytest.mark.smollm2
def test_smollm2_cli_calibration_agrees_with_shipped_artifact(tmp_path, capsys):
    from kvpress.cli import main

    out = tmp_path / "ds.safetensors"
    assert main(["calibrate", "double_sparsity", "--tokens", "512", "--seq-len", "256", "--out", str(out)]) == 0
    assert "chunk 2/2" in capsys.readouterr().out  # progress is printed
    model, _ = kvpress.load_model("smollm2")
    adapter = kvpress.get_adapter(model)
    mine, shipped = calib.load(out, adapter), calib.load(shipped_artifact(calib.SHIPPED), adapter)
    # the top-16 channel sets of a 512-token calibration mostly agree with the shipped 4096-token one
    overlap = [len(set(mine[l, h, :16].tolist()) & set(shipped[l, h, :16].tolist())) / 16
               for l in range(adapter.num_layers) for h in range(adapter.num_kv_heads)]
    assert sum(overlap) / len(overlap) > 0.7


@pytest.mark.parametrize("reduction", ["softmax_max", "max", "mean", "softmax_mean"])
def test_hot_path_scores_equal_label_scores(model, artifact, reduction):
    """The decode hot path's fused candidate scoring equals `kvpress.kernels.label_scores`."""
    from kvpress.kernels import label_scores

    cache, _ = prefill_then_decode(model, policy(artifact, group_reduction=reduction), random_ids(40, seed=13), steps=1)
    layer = cache.layers[1]
    q = torch.randn(1, 4, 16)
    lo, hi = 2, layer.seen - 4
    got = layer._candidate_scores(q, 0.25, lo, hi)
    labels = layer.label_cache
    want = label_scores(q, labels.view()[:, :, lo:hi], labels.channels, scale=0.25, reduction=reduction)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_calibration_ranks_channels_after_the_q_k_norms():
    """Qwen3 normalises q and k per head before RoPE: a channel the norms' weights make loud is what
    q . k spreads over, so calibration (which reads the q / k the model attends with) ranks it first."""
    m = tiny_model("qwen3", layers=1, heads=4, kv_heads=2, seed=3)
    attn = kvpress.get_adapter(m).attention_modules()[0]
    with torch.no_grad():
        for c in (6, 14):  # a RoPE pair: c and c + D/2
            attn.q_norm.weight[c] *= 8
            attn.k_norm.weight[c] *= 8
    ids = torch.randint(3, 250, (64,), generator=torch.Generator().manual_seed(0))
    out = calib.calibrate(m, ids, seq_len=32)
    for kv in range(2):
        assert set(out["channel_rank"][0, kv, :2].tolist()) == {6, 14}
