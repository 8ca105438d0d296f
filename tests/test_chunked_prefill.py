"""A prompt given in several forwards: ``generate(prefill_chunk_size=N)`` and ``PolicyCache.prompt``.

Policies that declare ``chunked_prompt_exact`` must end where one forward of the whole prompt
ends (same tokens, logits up to rounding, same bytes); the quantizers' pieces read the cache as
stored, which the tests pin down as exactly that: the same as feeding the pieces by hand.
"""

import dataclasses

import pytest
import torch

import kvpress

from conftest import contract_model, random_ids

POLICIES = kvpress.list_policies()
EXACT = [n for n in POLICIES if kvpress.policy_class(n).chunked_prompt_exact]
QUANT = [n for n in POLICIES if not kvpress.policy_class(n).chunked_prompt_exact]
PROMPT, NEW = 48, 5


@pytest.fixture(scope="module", params=["llama", "qwen2-sliding"])
def model(request):
    return contract_model(request.param)


def example(name, model, **fields):
    policy = kvpress.policy_class(name).example(kvpress.get_adapter(model))
    return dataclasses.replace(policy, **fields) if fields else policy


def generate(model, ids, policy, chunk=None, **kwargs):
    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_scores=True)
    kw.update(kwargs)
    if chunk is not None:
        kw["prefill_chunk_size"] = chunk
    with torch.no_grad(), kvpress.apply(model, policy):
        return model.generate(ids, **kw)


def assert_same_run(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        torch.testing.assert_close(sa, sb, atol=2e-5, rtol=1e-5)
    stats_a, stats_b = kvpress.cache_stats(a), kvpress.cache_stats(b)
    assert stats_a.resident_bytes == stats_b.resident_bytes
    assert stats_a.offloaded_bytes == stats_b.offloaded_bytes
    assert stats_a.tokens == stats_b.tokens
    assert [s.stored_tokens for s in stats_a.layers] == [s.stored_tokens for s in stats_b.layers]


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("chunk", [16, 7, 47])  # 47: a last piece of one token
def test_chunked_prefill_ends_as_one_forward(model, name, chunk):
    ids = random_ids(PROMPT)
    policy = example(name, model)
    assert_same_run(generate(model, ids, policy, chunk), generate(model, ids, policy))


def padded_batch(padding):
    """Two prompts, the second left-padded by ``padding`` tokens: (ids, attention_mask)."""
    ids = torch.cat([random_ids(PROMPT, seed=3), random_ids(PROMPT, seed=4)])
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    ids[1, :padding] = 0
    return ids, mask


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("padding", [5, 20])
def test_chunked_prefill_of_a_left_padded_batch(model, name, padding):
    """Padding of 20 outlasts the first 16-token piece: that row's first real token is only known
    from the second piece's mask on (`PolicyCache._extend_padding`)."""
    ids, mask = padded_batch(padding)
    policy = example(name, model)
    assert_same_run(generate(model, ids, policy, 16, attention_mask=mask),
                    generate(model, ids, policy, attention_mask=mask))


def test_padding_may_continue_only_on_rows_that_were_all_padding(model):
    ids, mask = padded_batch(20)
    early = mask.clone()
    early[1, 5:] = 1  # the first piece says row 1 starts at 5, the second that it starts at 20
    policy = kvpress.get_policy("full")
    cache = kvpress.make_cache(model, policy)
    with torch.no_grad(), kvpress.apply(model, policy):
        with cache.prompt():
            model(ids[:, :16], attention_mask=early[:, :16], past_key_values=cache, use_cache=True)
            with pytest.raises(ValueError, match="disagrees with the earlier pieces' left padding"):
                model(ids[:, 16:32], attention_mask=mask[:, :32], past_key_values=cache, use_cache=True)
        cache = kvpress.make_cache(model, policy)
        model(ids[:, :16], attention_mask=mask[:, :16], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="new tokens after the prompt must not be padding"):
            model(ids[:, 16:32], attention_mask=mask[:, :32], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("fields", [
    dict(prefill="chunked", prefill_chunk_size=8),  # pieces of 7 cut its 8-token chunks: held and continued
    dict(prefill="chunked", prefill_chunk_size=8, tail_chunk=4),
    dict(prefill="streaming"),
    dict(prefill="dense"),  # one chunk: the whole prompt held until its end
], ids=["chunked8", "chunked8-tail", "streaming", "dense"])
@pytest.mark.parametrize("chunk", [16, 7, 1])
def test_duo_prefill_modes_are_the_prompts_not_the_forwards(model, fields, chunk):
    ids = random_ids(PROMPT)
    policy = example("duo", model, **fields)
    assert_same_run(generate(model, ids, policy, chunk), generate(model, ids, policy))


def _staged(layer):
    """The pieces of an open prompt the core holds for ``layer`` (``stages_prompt``)."""
    return getattr(layer, "prompt_stage", None)


@pytest.mark.parametrize("name", ["snapkv", "shadowkv"])
def test_policies_that_compress_the_whole_prompt_wait_for_its_end(model, name):
    """Before the fix, later pieces were decode steps: snapkv selected from the first piece and
    shadowkv factorised only it, keeping the rest exactly (more bytes)."""
    policy = example(name, model)
    ids = random_ids(PROMPT)
    cache = kvpress.make_cache(model, policy)
    with torch.no_grad(), kvpress.apply(model, policy):
        with cache.prompt():
            for piece in ids.split(16, dim=1):
                model(piece, past_key_values=cache, use_cache=True)
            # the pieces are held densely until the prompt ends, and counted
            staged = kvpress.cache_stats(cache)
            layer = next(l for l in cache.layers if _staged(l) is not None)
            assert _staged(layer).length == PROMPT
            assert staged.resident_bytes >= sum(
                _staged(l).buffer.k.nbytes * 2 for l in cache.layers if _staged(l) is not None)
        assert all(_staged(l) is None for l in cache.layers)
        one = model(ids, use_cache=True)
    after, whole = kvpress.cache_stats(cache), kvpress.cache_stats(one.past_key_values)
    assert after.resident_bytes == whole.resident_bytes < staged.resident_bytes
    assert after.offloaded_bytes == whole.offloaded_bytes


@pytest.mark.parametrize("name", QUANT)
def test_quantizers_prompt_pieces_read_the_cache_as_stored(model, name):
    """Their pieces are ordinary forwards on the quantized cache: generate's chunked prefill is the
    same as feeding the pieces by hand without ``cache.prompt()``; the stored groups are those
    of one forward (same bytes for the single-store quantizers)."""
    ids = random_ids(PROMPT)
    policy = example(name, model)
    chunked = generate(model, ids, policy, 16)
    cache = kvpress.make_cache(model, policy)
    cache.plan_capacity(PROMPT + 1)  # as generate plans the cache compared below (preallocated stores)
    with torch.no_grad(), kvpress.apply(model, policy):
        for piece in ids.split(16, dim=1):
            out = model(piece, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(out.logits[:, -1], chunked.scores[0], atol=1e-5, rtol=1e-5)
    assert kvpress.cache_stats(cache).tokens == PROMPT
    if name != "zipcache":  # zipcache's salient set depends on the probes each piece draws
        assert kvpress.cache_stats(cache).resident_bytes == kvpress.cache_stats(
            generate(model, ids[:, :PROMPT], policy, max_new_tokens=1)).resident_bytes


def test_prompt_block_by_hand_equals_one_forward(model):
    policy = example("snapkv", model)
    ids = random_ids(PROMPT)
    cache = kvpress.make_cache(model, policy)
    with torch.no_grad(), kvpress.apply(model, policy):
        with cache.prompt():
            for piece in ids.split(20, dim=1):
                last = model(piece, past_key_values=cache, use_cache=True).logits[:, -1]
        nxt = last.argmax(-1, keepdim=True)
        step = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        one = model(ids, use_cache=True)
        ref = model(nxt, past_key_values=one.past_key_values, use_cache=True).logits[:, -1]
    torch.testing.assert_close(last, one.logits[:, -1], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(step, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("padding", [0, 5])
def test_a_new_turn_in_pieces_ends_as_one_forward_of_it(model, name, padding):
    """A second ``generate`` on the cache of the first (a new turn of 40 tokens) with
    ``prefill_chunk_size``: the pieces run in a prompt block on the non-empty cache and end as
    one forward of the turn (``duo``'s streaming heads continue their chunk across the pieces)."""
    ids, mask = padded_batch(padding)
    policy = example(name, model)
    runs = []
    for chunk in (None, 16, 20):  # the turn's 41 new tokens: 16 + 16 + 9, or 20 + 20 + a piece of one
        first = generate(model, ids, policy, attention_mask=mask)
        turn = torch.cat([first.sequences, random_ids(40, batch=2, seed=5)], dim=1)
        turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        runs.append(generate(model, turn, policy, chunk, attention_mask=turn_mask, past_key_values=first.past_key_values))
    assert_same_run(runs[0], runs[1])
    assert_same_run(runs[0], runs[2])


@pytest.mark.parametrize("fields", [dict(prefill="chunked", prefill_chunk_size=8), dict(prefill="streaming")],
                         ids=["chunked8", "streaming"])
def test_duo_new_turn_in_pieces_of_seven(model, fields):
    ids = random_ids(PROMPT)
    policy = example("duo", model, **fields)
    runs = []
    for chunk in (None, 7):
        first = generate(model, ids, policy)
        turn = torch.cat([first.sequences, random_ids(30, seed=6)], dim=1)
        runs.append(generate(model, turn, policy, chunk, past_key_values=first.past_key_values))
    assert_same_run(*runs)


def test_prompt_block_refuses_misuse(model):
    policy = example("shadowkv", model)
    cache = kvpress.make_cache(model, policy)
    with pytest.raises(ValueError, match="no prompt is open"):
        cache.end_prompt()
    with torch.no_grad(), kvpress.apply(model, policy):
        with cache.prompt():
            with pytest.raises(ValueError, match="already open"):
                cache.begin_prompt()
            model(random_ids(8), past_key_values=cache, use_cache=True)
    recording = kvpress.make_cache(model, policy)
    recording.activate_past_recording()
    with pytest.raises(ValueError, match="records its past"):
        recording.begin_prompt()
    assert not recording.prompt_open


def test_generate_without_chunking_opens_no_prompt_block(model, monkeypatch):
    """One forward needs no staging: the policies compress each layer's prompt right away (the
    whole dense prompt of every layer is never held at once)."""
    opened = []
    monkeypatch.setattr(kvpress.PolicyCache, "begin_prompt",
                        lambda self, _orig=kvpress.PolicyCache.begin_prompt: (opened.append(1), _orig(self))[1])
    ids = random_ids(PROMPT)
    generate(model, ids, example("snapkv", model))
    generate(model, ids, example("snapkv", model), PROMPT)  # one piece
    assert opened == []
    generate(model, ids, example("snapkv", model), 16)
    assert opened == [1]


def test_apply_restores_prefill(model):
    before = dict(vars(model))
    with kvpress.apply(model, kvpress.get_policy("full")):
        assert "_prefill" in vars(model)
    assert "_prefill" not in vars(model) and vars(model).keys() == before.keys()


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("padding", [0, 20])
def test_quantizers_long_forwards_dequantize_the_store_once(model, name, padding, monkeypatch):
    """A forward of ``DEQUANT_MIN_QUERIES`` tokens or more on a quantized cache (a prompt piece, a
    new turn) attends over a transient dequantized copy of the store through SDPA; reading the
    codes (shorter forwards' path), also in query blocks of at most ``SCORE_BYTES`` of scores,
    gives the same tokens, logits and bytes, left padding beyond the first piece included."""
    from kvpress.policies import _quant, _quant_forward

    ids, mask = padded_batch(padding)
    policy = example(name, model)
    cls = type(kvpress.make_cache(model, policy).layers[0])
    calls = []
    real = cls._dequantize_into
    monkeypatch.setattr(cls, "_dequantize_into", lambda self, k, v: calls.append(k.shape[2]) or real(self, k, v))
    dequantized = generate(model, ids, policy, 16, attention_mask=mask)
    assert calls and max(calls) > 0  # the later pieces read a non-empty store through the copy
    fast_calls = len(calls)
    monkeypatch.setattr(_quant, "DEQUANT_MIN_QUERIES", 10**9)
    codes = generate(model, ids, policy, 16, attention_mask=mask)
    monkeypatch.setattr(_quant_forward, "SCORE_BYTES", 1)  # one query row per block
    blocks = generate(model, ids, policy, 16, attention_mask=mask)
    assert len(calls) == fast_calls  # the codes paths never dequantize
    for other in (codes, blocks):
        assert torch.equal(dequantized.sequences, other.sequences)
        for a, b in zip(dequantized.scores, other.scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert kvpress.cache_stats(dequantized).resident_bytes == kvpress.cache_stats(other).resident_bytes


@pytest.mark.parametrize("name", [None, "full", "snapkv", "duo"])
def test_timed_generate_prefills_in_chunks(model, name):
    from kvpress.generation import timed_generate

    ids = random_ids(PROMPT)
    policy = None if name is None else example(name, model)
    one = timed_generate(model, ids, policy, max_new_tokens=4, eos_token_id=[])
    pieces = timed_generate(model, ids, policy, max_new_tokens=4, eos_token_id=[], prefill_chunk_size=10)
    assert torch.equal(one.tokens, pieces.tokens)
    if policy is not None:
        assert one.stats.resident_bytes == pieces.stats.resident_bytes and one.stats.tokens == pieces.stats.tokens
    with pytest.raises(ValueError, match="prefill_chunk_size=0 must be >= 1"):
        timed_generate(model, ids, policy, max_new_tokens=2, prefill_chunk_size=0)
