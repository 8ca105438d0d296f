"""DuoAttention: head split, per-head storage, equivalence with full/streaming, artifacts, calibration."""

import pytest
import torch

import kvpress
from kvpress.calibration import CALIBRATORS, save_artifact
from kvpress.policies._duo_calibrate import CalibrationSettings, calibrate, gated_attention
from kvpress.policies.duo import DuoPolicy, split_heads

from conftest import random_ids, tiny_model


@pytest.fixture(scope="module")
def model4():
    """Tiny Llama with 4 KV heads (8 query heads, GQA 2) and 3 layers: room for uneven splits."""
    return tiny_model("llama", layers=3, heads=8, kv_heads=4, seed=1)


GATES = ((0.9, 0.1, 0.5, 0.7), (0.2, 0.8, 0.3, 0.95), (0.6, 0.05, 0.99, 0.4))


def run(model, policy, ids, **kw):
    with torch.no_grad(), kvpress.apply(model, policy):
        return model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True, **kw)


# ------------------------------------------------------------------ head split
def test_split_heads_sparsity_threshold_and_random():
    gates = torch.tensor(GATES)
    keep = split_heads(gates, 0.5, 0.5)
    assert int((~keep).sum()) == 6
    assert float(gates[keep].min()) > float(gates[~keep].max())  # lowest gates stream
    assert torch.equal(split_heads(gates, None, 0.5), gates >= 0.5)
    assert split_heads(gates, 0.0, 0.5).all() and not split_heads(gates, 1.0, 0.5).any()
    r1, r2 = split_heads(gates, 0.5, 0.5, random_seed=1), split_heads(gates, 0.5, 0.5, random_seed=1)
    assert torch.equal(r1, r2) and int((~r1).sum()) == 6
    assert any(not torch.equal(split_heads(gates, 0.5, 0.5, random_seed=s), keep) for s in range(5))

def test_sparsity_streams_at_most_its_fraction_of_heads():
    """Three heads (Gemma 3 270M's global layers) at sparsity 0.5: one streams, not two; a count
    that is whole up to float error is not rounded down below it (0.3 * 10)."""
    assert int((~split_heads(torch.tensor([[0.9], [0.1], [0.5]]), 0.5, 0.5)).sum()) == 1
    assert int((~split_heads(torch.rand(10, 1), 0.3, 0.5)).sum()) == 3



def test_bad_config_values_are_value_errors():
    for kwargs in (dict(sparsity=1.5), dict(window_size=0), dict(sink_tokens=-1), dict(gates=((0.1,), (0.2, 0.3))),
                   dict(prefill="sparse"), dict(prefill_chunk_size=0), dict(tail_chunk=-1)):
        with pytest.raises(ValueError, match="allowed|rectangular"):
            DuoPolicy(**kwargs)
    with pytest.raises(ValueError, match="either gates or artifact"):
        DuoPolicy(gates=((1.0,),), artifact="x.safetensors")
    with pytest.raises(ValueError, match="exceed sink_tokens"):
        DuoPolicy(sink_tokens=4).with_budget(4)
    with pytest.raises(ValueError, match='tail_chunk needs prefill="chunked" or "dense"'):
        DuoPolicy(tail_chunk=64, prefill="streaming")


# ------------------------------------------------------------------ storage is split per head
def test_streaming_heads_keep_only_sinks_and_window(model4):
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6)
    retrieval = policy.retrieval_mask(kvpress.get_adapter(model4))
    sizes = {}
    for length in (40, 90):
        cache = run(model4, policy, random_ids(length, seed=length)).past_key_values
        seen = length + 3
        for layer, mask in zip(cache.layers, retrieval):
            tensors = layer.state_tensors()
            h_ret, h_str = int(mask.sum()), int((~mask).sum())
            if h_ret:
                assert tensors["retrieval_k"].shape[1] == h_ret and tensors["retrieval_k"].shape[2] >= seen
            if h_str:
                assert tensors["streaming_k"].shape[1:3] == (h_str, 8)  # sinks + window, at every length
                assert tensors["streaming_pos"].shape[1] == 8
            sizes.setdefault(layer.layer_idx, []).append(tensors.get("streaming_k", torch.empty(0)).shape)
        stats = kvpress.cache_stats(cache)
        full = kvpress.cache_stats(run(model4, kvpress.get_policy("full"), random_ids(length, seed=length)).past_key_values)
        assert stats.resident_bytes < 0.75 * full.resident_bytes
    assert all(a == b for a, b in sizes.values())


def test_beam_reorder_selects_rows_of_both_buffers(model4):
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6)
    out = run(model4, policy, random_ids(30, batch=2, seed=7))
    layer = out.past_key_values.layers[0]
    before = {k: v.clone() for k, v in layer.state_tensors().items()}
    layer.batch_select(torch.tensor([1, 1]))
    for name, tensor in layer.state_tensors().items():
        assert torch.equal(tensor[0], before[name][1]) and torch.equal(tensor[1], before[name][1])


# ------------------------------------------------------------------ equivalences
def test_all_retrieval_equals_full_and_all_streaming_equals_streaming(model4):
    ids = random_ids(40, seed=3)
    full = run(model4, kvpress.get_policy("full"), ids)
    stream = run(model4, kvpress.get_policy("streaming", sink_tokens=2, window_size=6), ids)
    duo_full = run(model4, DuoPolicy(gates=GATES, sparsity=0.0, sink_tokens=2, window_size=6), ids)
    duo_stream = run(model4, DuoPolicy(gates=GATES, sparsity=1.0, sink_tokens=2, window_size=6, prefill="streaming"), ids)
    for ref, got in ((full, duo_full), (stream, duo_stream)):
        assert torch.equal(ref.sequences, got.sequences)
        for a, b in zip(ref.scores, got.scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_mixed_prefill_matches_hard_gated_calibration_attention(model4):
    """Runtime split with the streaming prefill == the calibration's gated mix with gates at
    exactly 0/1 (per head, GQA)."""
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="streaming")
    retrieval = policy.retrieval_mask(kvpress.get_adapter(model4))
    ids = random_ids(37, seed=11)
    with torch.no_grad(), kvpress.apply(model4, policy):
        got = model4(ids, use_cache=True).logits
    logits = torch.where(retrieval, torch.tensor(float("inf")), torch.tensor(float("-inf")))
    with torch.no_grad(), gated_attention(model4, logits, sink_tokens=2, window_size=6):
        ref = model4(ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    with torch.no_grad():  # and the split really differs from full attention
        assert (model4(ids).logits - got).abs().max() > 1e-3


def test_dense_prefill_decode_matches_calibration_attention_mixed_from_the_answer(model4):
    """prefill="dense" at run time == the calibration's gated mix (hard gates) applied only from
    ``mix_from`` on: the prompt exact in every head, the decode steps split per head."""
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="dense")
    retrieval = policy.retrieval_mask(kvpress.get_adapter(model4))
    ids, prompt = random_ids(37, seed=12), 29
    with torch.no_grad(), kvpress.apply(model4, policy):
        out = model4(ids[:, :prompt], use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(prompt, ids.shape[1] - 1):  # teacher-forced decode of the rest
            out = model4(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[:, -1])
    got = torch.stack(steps, dim=1)  # predictions from positions prompt-1 .. T-2
    logits = torch.where(retrieval, torch.tensor(float("inf")), torch.tensor(float("-inf")))
    with torch.no_grad(), gated_attention(model4, logits, sink_tokens=2, window_size=6) as attention:
        attention.mix_from = prompt
        ref = model4(ids, use_cache=False).logits[:, prompt - 1 : -1]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    with torch.no_grad():
        full = model4(ids).logits[:, prompt - 1 : -1]
    torch.testing.assert_close(got[:, 0], full[:, 0], atol=1e-5, rtol=0)  # the prefill's prediction is exact
    assert (got[:, 1:] - full[:, 1:]).abs().max() > 1e-3  # decode really streams


# ------------------------------------------------------------------ prefill="dense"
def test_dense_prefill_is_full_attention_then_the_same_split_storage(model4):
    """prefill="dense": the prompt's logits are full's exactly; what stays resident is the same
    per-head split as with the paper's streaming prefill; decode streams (differs from full)."""
    ids = random_ids(45, seed=5)
    dense = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="dense")
    stream = dense.replace(prefill="streaming")
    assert dense.prefills_densely() and not stream.prefills_densely() and not type(dense).full_prefill
    with torch.no_grad():
        ref = model4(ids).logits
        with kvpress.apply(model4, dense):
            out = model4(ids, use_cache=True)
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)
    cache_d, cache_s = run(model4, dense, ids).past_key_values, run(model4, stream, ids).past_key_values
    assert kvpress.cache_stats(cache_d).resident_bytes == kvpress.cache_stats(cache_s).resident_bytes
    for ld, ls in zip(cache_d.layers, cache_s.layers):
        td, ts = ld.state_tensors(), ls.state_tensors()
        assert {k: v.shape for k, v in td.items()} == {k: v.shape for k, v in ts.items()}
        if "streaming_pos" in td:  # the same tokens kept: sinks + the last window positions
            assert torch.equal(td["streaming_pos"], ts["streaming_pos"])
    full = run(model4, kvpress.get_policy("full"), ids)
    scores_d = run(model4, dense, ids).scores
    torch.testing.assert_close(scores_d[0], full.scores[0], atol=1e-5, rtol=0)  # first token: prefill only
    assert max((a - b).abs().max() for a, b in zip(scores_d[1:], full.scores[1:])) > 1e-3


def test_dense_prefill_shares_a_dense_prefill_and_decodes_the_same(model4):
    from kvpress.evals.decode import decode_from_cache, shared_prefill
    from kvpress.prefill import cache_from_dense

    ids = random_ids(33, seed=9)
    dense = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="dense")
    own = run(model4, dense, ids)
    sp = shared_prefill(model4, ids)
    cache = cache_from_dense(model4, dense, sp.cache)
    tokens, _ = decode_from_cache(model4, dense, cache, sp.first_logits, sp.length, max_new_tokens=4, eos_token_id=[])
    assert tokens == own.sequences[0, ids.shape[1]:].tolist()
    with pytest.raises(ValueError, match="runs its own prefill"):
        cache_from_dense(model4, dense.replace(prefill="streaming"), sp.cache)


def test_dense_prefill_left_padded_batch_matches_single_rows(model4):
    dense = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="dense")
    long, short = random_ids(40, seed=4), random_ids(27, seed=5)
    batch, mask = torch.zeros(2, 40, dtype=torch.long), torch.zeros(2, 40, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 13:], mask[1, 13:] = short[0], 1
    both = run(model4, dense, batch, attention_mask=mask).sequences
    assert torch.equal(both[0, 40:], run(model4, dense, long).sequences[0, 40:])
    assert torch.equal(both[1, 40:], run(model4, dense, short).sequences[0, 27:])


def test_dense_prefill_in_several_forwards_sees_every_kept_token(model4):
    """A second multi-token forward attends densely to the kept sinks + window and to itself;
    with a window covering the prompt nothing is evicted, so chunked == one-shot == full."""
    ids = random_ids(30, seed=13)
    wide = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=64, prefill="dense")
    with torch.no_grad(), kvpress.apply(model4, wide):
        first = model4(ids[:, :17], use_cache=True)
        second = model4(ids[:, 17:], past_key_values=first.past_key_values, use_cache=True)
        ref = model4(ids).logits
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), ref, atol=1e-5, rtol=0)
    narrow = wide.replace(window_size=6)
    with torch.no_grad(), kvpress.apply(model4, narrow):
        first = model4(ids[:, :17], use_cache=True)
        second = model4(ids[:, 17:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(first.logits, ref[:, :17], atol=1e-5, rtol=0)
    assert (second.logits - ref[:, 17:]).abs().max() > 1e-3  # the middle of the first forward is gone


# ------------------------------------------------------------------ tail_chunk
def _left_padded(long_len=40, short_len=27):
    long, short = random_ids(long_len, seed=4), random_ids(short_len, seed=5)
    batch, mask = torch.zeros(2, long_len, dtype=torch.long), torch.zeros(2, long_len, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, long_len - short_len:], mask[1, long_len - short_len:] = short[0], 1
    return long, short, batch, mask


@pytest.mark.parametrize("prefill", ["chunked", "dense"])
def test_tail_of_one_token_chunks_is_full_attention(model4, prefill):
    """tail_chunk=1 keeps every evicted token as a chunk of one: prefill (in chunks) and decode
    then equal full attention for every head, left padding included."""
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill=prefill,
                       prefill_chunk_size=8, tail_chunk=1)
    _, _, batch, mask = _left_padded()
    full = run(model4, kvpress.get_policy("full"), batch, attention_mask=mask)
    got = run(model4, policy, batch, attention_mask=mask)
    assert torch.equal(full.sequences, got.sequences)
    for a, b in zip(full.scores, got.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    off = run(model4, policy.replace(tail_chunk=0), batch, attention_mask=mask)
    assert max((a - b).abs().max().item() for a, b in zip(full.scores, off.scores)) > 1e-2  # the tail is what closed it


def test_tail_left_padded_batch_matches_single_rows_and_counts_its_sums(model4):
    # (prefill="dense": the chunked prefill cuts chunks by sequence index, padding included)
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="dense", tail_chunk=4)
    long, short, batch, mask = _left_padded()
    both = run(model4, policy, batch, attention_mask=mask)
    one_long, one_short = run(model4, policy, long), run(model4, policy, short)
    assert torch.equal(both.sequences[0, 40:], one_long.sequences[0, 40:])
    assert torch.equal(both.sequences[1, 40:], one_short.sequences[0, 27:])
    for a, b, c in zip(both.scores, one_long.scores, one_short.scores):
        torch.testing.assert_close(a[0], b[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(a[1], c[0], atol=1e-4, rtol=0)
    # a streaming head's sums hold every evicted real token once: prompt + 3 decoded tokens
    # (the 4th is generated, not stored) minus 2 sinks and the 6-token window, per row
    for layer in both.past_key_values.layers:
        t = layer.state_tensors()
        if "streaming_tail_count" in t:
            counts = t["streaming_tail_count"].sum(1)
            assert counts.tolist() == [40 + 3 - 8, 27 + 3 - 8]
    plain = kvpress.cache_stats(run(model4, policy.replace(tail_chunk=0), batch, attention_mask=mask).past_key_values)
    assert kvpress.cache_stats(both.past_key_values).resident_bytes > plain.resident_bytes  # the sums are counted


def test_tail_sums_equal_the_evicted_tokens_whatever_the_forwards(model4):
    """Chunked prefill in one forward, the same prompt in three forwards, or a dense prefill:
    the sums hold exactly the evicted tokens' keys (checked against full's cache in the first
    layer, whose keys do not depend on the policy)."""
    ids = random_ids(45, seed=21)
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill_chunk_size=16, tail_chunk=4)
    _, full_cache = _prompt_logits(model4, kvpress.get_policy("full"), ids)
    caches = [_prompt_logits(model4, policy, ids)[1], _prompt_logits(model4, policy, ids, forwards=(10, 33, None))[1],
              _prompt_logits(model4, policy.replace(prefill="dense"), ids)[1]]
    for li, layer in enumerate(caches[0].layers[:1]):
        stream = layer._indices(ids.device)["str"]
        assert stream.numel()
        k_all = full_cache.layers[li].state_tensors()["k"][:, stream, :45].float()
        evicted = k_all[:, :, 2:45 - 6]  # sinks 0-1 exact, window 39-44 exact
        chunk = torch.arange(2, 39) // 4
        expect = torch.zeros(1, stream.numel(), 10, k_all.shape[-1]).index_add_(2, chunk, evicted)
        for cache in caches:
            got = cache.layers[li].state_tensors()["streaming_tail_k_sum"][:, :, :10]
            torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def test_tail_beam_search_reorders_the_sums(model4):
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, tail_chunk=4)
    out = run(model4, policy, random_ids(30, batch=2, seed=7))
    layer = next(l for l in out.past_key_values.layers if "streaming_tail_k_sum" in l.state_tensors())
    before = {k: v.clone() for k, v in layer.state_tensors().items()}
    layer.batch_select(torch.tensor([1, 1]))
    for name, tensor in layer.state_tensors().items():
        assert torch.equal(tensor[0], before[name][1]) and torch.equal(tensor[1], before[name][1])
    beams = run(model4, policy, random_ids(30, seed=8), num_beams=2)
    assert beams.sequences.shape == (1, 34)


# ------------------------------------------------------------------ prefill="chunked"
def _prompt_logits(model, policy, ids, forwards=(None,)):
    """Logits of the prompt ``ids`` fed in forwards that end at ``forwards`` (None = the end)."""
    with torch.no_grad(), kvpress.apply(model, policy):
        cache, out, start = None, [], 0
        for end in forwards:
            res = model(ids[:, start:end], past_key_values=cache, use_cache=True)
            cache, start = res.past_key_values, ids.shape[1] if end is None else end
            out.append(res.logits)
    return torch.cat(out, dim=1), cache


def test_chunked_prefill_is_dense_prefill_fed_chunk_by_chunk(model4):
    """prefill="chunked" in one forward == prefill="dense" fed one chunk per forward (the
    upstream deployment), chunks counted from the first token; the kept tokens are the same."""
    ids = random_ids(45, seed=21)
    dense = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="dense")
    chunked = dense.replace(prefill="chunked", prefill_chunk_size=16)
    one, cache_c = _prompt_logits(model4, chunked, ids)
    fed, cache_d = _prompt_logits(model4, dense, ids, forwards=(16, 32, None))
    torch.testing.assert_close(one, fed, atol=1e-5, rtol=0)
    for lc, ld in zip(cache_c.layers, cache_d.layers):
        for name, t in lc.state_tensors().items():
            torch.testing.assert_close(t, ld.state_tensors()[name], atol=1e-6, rtol=0)
    # the layer keeps only sinks + window between forwards, so a caller's own forwards cut the
    # chunks too: forwards ending at 10 and 40 give chunks ending at 10, 16, 32, 40, 45
    split, _ = _prompt_logits(model4, chunked, ids, forwards=(10, 40, None))
    cut, _ = _prompt_logits(model4, dense, ids, forwards=(10, 16, 32, 40, None))
    torch.testing.assert_close(split, cut, atol=1e-5, rtol=0)
    # the first chunk is plain causal attention; later chunks lose what fell out of the window
    full = model4(ids).logits.detach()
    torch.testing.assert_close(one[:, :16], full[:, :16], atol=1e-5, rtol=0)
    assert (one[:, 16:] - full[:, 16:]).abs().max() > 1e-3


def test_chunked_prefill_extremes_are_dense_and_per_token_streaming(model4):
    ids = random_ids(37, seed=22)
    base = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6)
    dense, _ = _prompt_logits(model4, base.replace(prefill="dense"), ids)
    one_chunk, _ = _prompt_logits(model4, base.replace(prefill="chunked", prefill_chunk_size=64), ids)
    torch.testing.assert_close(one_chunk, dense, atol=1e-5, rtol=0)
    # chunks of one token: sinks + the window before each token + the token itself, i.e. the
    # per-token streaming pattern with one more window slot
    per_token, _ = _prompt_logits(model4, base.replace(prefill="chunked", prefill_chunk_size=1), ids)
    streaming, _ = _prompt_logits(model4, base.replace(window_size=7, prefill="streaming"), ids)
    torch.testing.assert_close(per_token, streaming, atol=1e-5, rtol=0)


def test_chunked_prefill_generates_with_the_same_storage(model4):
    ids = random_ids(40, seed=23)
    chunked = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="chunked", prefill_chunk_size=8)
    out = run(model4, chunked, ids)
    stream = run(model4, chunked.replace(prefill="streaming"), ids)
    assert not chunked.prefills_densely()
    assert kvpress.cache_stats(out.past_key_values).resident_bytes == kvpress.cache_stats(stream.past_key_values).resident_bytes



@pytest.mark.parametrize("tail_chunk", [0, 4])
@pytest.mark.parametrize("pieces", [None, 5, 16])
def test_chunked_prefill_left_padded_rows_decode_as_alone(model4, tail_chunk, pieces):
    """Chunks are counted from each row's first real token: rows padded by 11, 0 and 3 (phases 3,
    0, 3 of 8-token chunks, run as two groups of rows) each give their batch-1 run's tokens and
    scores, with the prompt in one forward or in pieces of 5 / 16 (`generate(prefill_chunk_size)`)."""
    chunked = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6, prefill="chunked",
                        prefill_chunk_size=8, tail_chunk=tail_chunk)
    pads, rows = (11, 0, 3), [random_ids(40 - p, seed=24 + p) for p in (11, 0, 3)]
    batch, mask = torch.zeros(3, 40, dtype=torch.long), torch.ones(3, 40, dtype=torch.long)
    for r, (pad, ids) in enumerate(zip(pads, rows)):
        batch[r, pad:], mask[r, :pad] = ids[0], 0
    kw = {} if pieces is None else {"prefill_chunk_size": pieces}
    both = run(model4, chunked, batch, attention_mask=mask, **kw)
    for r, (pad, ids) in enumerate(zip(pads, rows)):
        alone = run(model4, chunked, ids, **kw)
        assert torch.equal(both.sequences[r, 40:], alone.sequences[0, 40 - pad:])
        for a, b in zip(both.scores, alone.scores):
            torch.testing.assert_close(a[r], b[0], atol=1e-4, rtol=0)
    # with one padding for every row the chunks start at it too (one group, phase 3)
    same = torch.stack([batch[0], batch[0]]), torch.stack([mask[0], mask[0]])
    twice = run(model4, chunked, same[0], attention_mask=same[1], **kw)
    assert torch.equal(twice.sequences[1], both.sequences[0])


# ------------------------------------------------------------------ artifacts
def test_artifact_round_trip_and_model_checks(model4, llama, tmp_path):
    adapter = kvpress.get_adapter(model4)
    path = save_artifact(tmp_path / "duo.safetensors", {"gates": torch.tensor(GATES)}, policy="duo", version=1, adapter=adapter)
    policy = kvpress.get_policy("duo", artifact=str(path), sink_tokens=2, window_size=6)
    assert torch.equal(policy.load_gates(adapter), torch.tensor(GATES))
    run(model4, policy, random_ids(20))
    with pytest.raises(ValueError, match="another model"):  # 2 layers / 2 KV heads
        with kvpress.apply(llama, policy):
            pass
    with pytest.raises(ValueError, match="another model"):
        DuoPolicy(gates=((0.1, 0.2),)).check_model(adapter)
    with pytest.raises(FileNotFoundError, match="kvpress calibrate duo"):
        DuoPolicy(artifact=str(tmp_path / "missing.safetensors")).check_model(adapter)
    with pytest.raises(ValueError, match="another model"):  # the shipped SmolLM2 artifact on a tiny model
        kvpress.get_policy("duo").check_model(adapter)


def test_random_split_of_a_given_size_needs_no_artifact(model4):
    """``random_heads_seed`` with ``sparsity`` runs on any model without calibration (speed runs on
    random weights); the split equals the one drawn against real gates of the same shape."""
    adapter = kvpress.get_adapter(model4)
    policy = kvpress.get_policy("duo", random_heads_seed=3, sink_tokens=2, window_size=6)
    mask = policy.retrieval_mask(adapter)
    assert torch.equal(mask, split_heads(torch.tensor(GATES), 0.5, 0.5, random_seed=3)) and int(mask.sum()) == 6
    out = run(model4, policy, random_ids(30))
    layers = out.past_key_values.layers
    assert [int(layer.retrieval_heads.numel()) for layer in layers] == mask.sum(dim=1).tolist()
    with pytest.raises(ValueError, match="another model"):  # the threshold split counts real gates
        DuoPolicy(random_heads_seed=3, sparsity=None).check_model(adapter)  # (the shipped SmolLM2 ones)


def test_reads_upstream_tsv_pattern(model4, tmp_path):
    run_dir = tmp_path / "lr=0.02-reg=0.05"
    run_dir.mkdir()
    (run_dir / "full_attention_heads.tsv").write_text(
        "\n".join("\t".join(f"{g:.18e}" for g in row) for row in GATES) + "\n"
    )
    adapter = kvpress.get_adapter(model4)
    for artifact in (run_dir, run_dir / "full_attention_heads.tsv"):
        gates = DuoPolicy(artifact=str(artifact)).load_gates(adapter)
        torch.testing.assert_close(gates, torch.tensor(GATES))
    (tmp_path / "ragged.tsv").write_text("1.0\t0.5\n0.3\n")
    with pytest.raises(ValueError, match="rectangular"):
        DuoPolicy(artifact=str(tmp_path / "ragged.tsv")).load_gates(adapter)
    with pytest.raises(ValueError, match="another model"):
        DuoPolicy(artifact=str(run_dir)).load_gates(kvpress.get_adapter(tiny_model("llama")))



@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_threshold_and_gates_are_refused(model4, tmp_path, bad):
    with pytest.raises(ValueError, match="threshold"):
        kvpress.get_policy("duo", threshold=bad)
    with pytest.raises(ValueError, match="threshold"):
        kvpress.get_policy(f"duo:threshold={bad}")
    rows = tuple(tuple(row) for row in GATES)
    with pytest.raises(ValueError, match="finite"):
        DuoPolicy(gates=((bad,) + rows[0][1:],) + rows[1:])
    adapter = kvpress.get_adapter(model4)
    gates = torch.tensor(GATES)
    gates[1, 0] = bad
    path = save_artifact(tmp_path / "duo.safetensors", {"gates": gates}, policy="duo", version=1, adapter=adapter)
    tsv = tmp_path / "pattern.tsv"
    tsv.write_text("\n".join("\t".join(str(float(g)) for g in row) for row in gates.tolist()) + "\n")
    for artifact in (path, tsv):
        with pytest.raises(ValueError, match=f"{artifact.name}.*NaN or inf"):
            DuoPolicy(artifact=str(artifact)).check_model(adapter)


@pytest.mark.smollm2
def test_shipped_artifact_fits_smollm2():
    model, _ = kvpress.load_model("smollm2")
    adapter = kvpress.get_adapter(model)
    policy = kvpress.get_policy("duo")
    gates = policy.load_gates(adapter)
    assert gates.shape == (adapter.num_layers, adapter.num_kv_heads)
    assert bool(((gates > 0) & (gates < 1)).all()) and float(gates.std()) > 0  # trained, not constant
    assert int(policy.retrieval_mask(adapter).sum()) == gates.numel() - gates.numel() // 2


# ------------------------------------------------------------------ calibration
def test_calibration_trains_only_gates_and_restores_model(llama):
    state = {k: v.clone() for k, v in llama.state_dict().items()}
    grads = {n: p.requires_grad for n, p in llama.named_parameters()}
    ids = random_ids(48, seed=9)
    settings = CalibrationSettings(steps=2, sink_tokens=2, window_size=6)
    gates, info = calibrate(llama, settings=settings, samples=[(ids, 40)] * 2, log=lambda *_: None)
    assert gates.shape == (2, 2) and bool(((gates > 0) & (gates < 1)).all())
    assert len(info["history"]) == 2 and all(h["distill"] >= 0 for h in info["history"])
    assert llama.config._attn_implementation == "sdpa"
    assert {n: p.requires_grad for n, p in llama.named_parameters()} == grads
    assert all(torch.equal(v, state[k]) for k, v in llama.state_dict().items())
    assert "duo" in CALIBRATORS


@pytest.mark.smollm2
def test_passkey_samples_hold_the_answer():
    import random

    from kvpress.policies._duo_calibrate import passkey_sample

    _, tokenizer = kvpress.load_model("smollm2")
    ids, start = passkey_sample(tokenizer, 600, random.Random(0), num_passkeys=3, passkey_words=2)
    assert 0.9 * 600 <= ids.shape[1] <= 1.1 * 600
    answer = tokenizer.decode(ids[0, start:])
    prompt = tokenizer.decode(ids[0, :start])
    keys = answer.split(":", 1)[1].strip(" .").split("; ")
    assert len(keys) == 3 and all(len(k.split()) == 2 and k in prompt for k in keys)


def test_distill_loss_dim_normalisation_ignores_each_dims_scale():
    from kvpress.policies._duo_calibrate import distill_loss

    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(20, 8, generator=g)
    noise = 0.1 * torch.randn(8, 8, generator=g)
    noise[:, 0] = 0.0  # the error sits in the ordinary dims
    student = teacher[12:] + noise
    span = slice(12, 20)
    big = torch.ones(8)
    big[0] = 1000.0  # one massive dim, as in SmolLM2's final hidden states
    plain, scaled = distill_loss(student, teacher, span, True), distill_loss(student * big, teacher * big, span, True)
    assert torch.allclose(plain, scaled, rtol=1e-5)
    # Without normalisation the massive dim swamps the error of the others.
    assert distill_loss(student * big, teacher * big, span, False) < 0.01 * distill_loss(student, teacher, span, False)


def test_logit_loss_calibration_and_settings_validation(llama):
    from kvpress.policies._duo_calibrate import logit_kl

    g = torch.Generator().manual_seed(4)
    logp = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    other = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    assert float(logit_kl(logp, logp)) == pytest.approx(0.0, abs=1e-7) and float(logit_kl(logp, other)) > 0
    ids = random_ids(48, seed=9)
    assert CalibrationSettings().loss == "logits"  # the shipped artifact's loss
    for loss in ("logits", "hidden"):
        settings = CalibrationSettings(steps=2, sink_tokens=2, window_size=6, loss=loss)
        gates, info = calibrate(llama, settings=settings, samples=[(ids, 40)] * 2, log=lambda *_: None)
        assert gates.shape == (2, 2) and all(h["distill"] > 0 for h in info["history"])
        assert info["settings"]["loss"] == loss
    with pytest.raises(ValueError, match="allowed: hidden, logits"):
        CalibrationSettings(loss="ce")
    with pytest.raises(ValueError, match="0 <= low <= high <= 1"):
        CalibrationSettings(depths=(0.5, 0.2))
    with pytest.raises(ValueError, match="allowed: streaming, dense"):
        CalibrationSettings(prefill="chunked")


def test_dense_prefill_calibration_learns_only_from_the_answer_queries(llama):
    """prefill="dense": the prompt is exact, so only answer positions carry a distillation error;
    gates still train (and differ from the paper's every-position mix)."""
    ids = random_ids(48, seed=9)
    runs = {}
    for prefill in ("streaming", "dense"):
        settings = CalibrationSettings(steps=2, sink_tokens=2, window_size=6, prefill=prefill)
        runs[prefill] = calibrate(llama, settings=settings, samples=[(ids, 40)] * 2, log=lambda *_: None)
    (g_stream, info_stream), (g_dense, info_dense) = runs["streaming"], runs["dense"]
    assert info_dense["settings"]["prefill"] == "dense" and all(h["distill"] > 0 for h in info_dense["history"])
    assert info_dense["history"][0]["distill"] < info_stream["history"][0]["distill"]  # less is perturbed
    assert not torch.equal(g_stream, g_dense)


def test_decode_runs_through_the_decode_kernel(model4, monkeypatch):
    """Decode steps: retrieval heads attend their whole buffer and streaming heads their visible
    slots through ``kvpress.kernels.sparse_decode``; the prompt does not."""
    import kvpress.kernels
    import kvpress.window_layers

    calls = []
    real = kvpress.kernels.sparse_decode  # retrieval heads: kvpress.attention.whole_cache_decode calls it

    def counting(q, k, v, index, **kw):
        calls.append((tuple(q.shape), index.dense_tail, index.max_blocks))
        return real(q, k, v, index, **kw)

    monkeypatch.setattr(kvpress.kernels, "sparse_decode", counting)
    monkeypatch.setattr(kvpress.window_layers, "sparse_decode", counting)
    policy = DuoPolicy(gates=GATES, sparsity=0.5, sink_tokens=2, window_size=6)
    ids = random_ids(30, seed=25)
    out = run(model4, policy, ids)  # 4 new tokens: the first from the prompt, 3 decode steps
    layers = out.past_key_values.layers
    with_ret = sum(l.dense is not None for l in layers)
    with_str = sum(l.stream is not None for l in layers)
    assert len(calls) == 3 * (with_ret + with_str)
    assert all(q[0] == 1 and q[1] > 0 for q, _, _ in calls)
    calls.clear()
    monkeypatch.setattr(kvpress.kernels, "sparse_decode", real)
    monkeypatch.setattr(kvpress.window_layers, "sparse_decode", real)
    assert torch.equal(run(model4, policy, ids).sequences, out.sequences)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_through_the_triton_kernel_matches_cpu():
    model = tiny_model("llama", layers=2, heads=8, kv_heads=2, head_dim=64)  # the Triton kernel's head_dim
    gates = ((0.9, 0.1), (0.2, 0.8))
    policy = DuoPolicy(gates=gates, sparsity=0.5, sink_tokens=4, window_size=60, prefill_chunk_size=128)
    ids = random_ids(300)
    cpu = run(model, policy, ids)
    gpu = run(model.cuda(), policy, ids.cuda())
    for a, b in zip(cpu.scores, gpu.scores):
        torch.testing.assert_close(a, b.cpu(), atol=2e-3, rtol=0)


def test_artifacts_record_a_portable_model_id():
    """Artifacts name the model, not this machine's conversion folder: the shipped ones, and any
    made from kvpress' converted SmolLM2 folder."""
    from safetensors import safe_open

    from kvpress.calibration import portable_model_id, shipped_artifact

    for name in ("duo-smollm2.safetensors", "double_sparsity-smollm2.safetensors",
                 "tidal-smollm2-135m-instruct.safetensors"):
        with safe_open(str(shipped_artifact(name)), framework="pt") as f:
            assert f.metadata()["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert portable_model_id("/root/.cache/kvpress/smollm2-135m-instruct/tf-5.23.0-e11db21ad9008b2b") == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert portable_model_id("C:\\cache\\kvpress\\smollm2-135m-instruct\\tf-5.24.0-abc\\") == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    for other in ("meta-llama/Llama-3.1-8B", "/models/smollm2-135m-instruct", ""):
        assert portable_model_id(other) == other
