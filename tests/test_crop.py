"""Taking tokens back (transformers' ``Cache.crop``) and assisted decoding, for every registered policy."""

import pytest
import torch


import kvpress
from kvpress.compat import cache_kwargs
from kvpress.policies._quant_forward import dequantized

from conftest import contract_model, random_ids, tiny_model

POLICIES = kvpress.list_policies()
CROPPABLE = [name for name in POLICIES if kvpress.policy_class(name).croppable]
PROMPT = 48
# policies whose forward of several tokens after the prompt, with past recording on (assisted
# decoding), attends as one-token forwards would: the verification then changes no token (zipcache
# attends its tokens unquantized, where steps could read some after a flush)
ONE_AT_A_TIME = [name for name in CROPPABLE if kvpress.policy_class(name).verifies_as_decoding]


def example(name, adapter):
    return kvpress.policy_class(name).example(adapter)


@pytest.fixture(scope="module", params=["llama", "qwen2-sliding"])
def cache_model(request):
    return contract_model(request.param)


def test_every_policy_is_croppable():
    assert CROPPABLE == POLICIES


def test_a_layer_that_cannot_crop_is_refused_before_generate_works(llama, monkeypatch):
    """A policy whose layers cannot take tokens back (none registered now) is refused when
    assisted decoding starts, with the policies that can; the model is left as it was."""
    from kvpress.policies.kivi import KiviLayer

    monkeypatch.setattr(KiviLayer, "croppable", False)
    policy = example("kivi", kvpress.get_adapter(llama))
    with pytest.raises(ValueError, match="policy 'kivi' cannot take back.*policies that can: .*full"):
        _generate(llama, _repeating_prompt(), policy, prompt_lookup_num_tokens=3)
    cache = kvpress.make_cache(llama, policy)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot take tokens back"):
        cache.layers[0].crop(-1)
    assert llama.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", POLICIES)
def test_croppable_flag_matches_the_layers(cache_model, name):
    adapter = kvpress.get_adapter(cache_model)
    policy = example(name, adapter)
    cache = kvpress.make_cache(cache_model, policy)
    for i, layer in enumerate(cache.layers):
        # the model's own sliding layers can always take tokens back
        assert layer.is_croppable == (policy.croppable or adapter.sliding_window(i) is not None)
    assert cache.is_croppable == policy.croppable
    if not policy.croppable:
        with pytest.raises(ValueError, match="policies that can: .*full"):
            cache.activate_past_recording()
    else:
        cache.activate_past_recording()
        assert all(layer.record_past for layer in cache.layers)


def _forwards(model, policy, pieces, crops, decode_steps=3, record=True):
    """Feed ``pieces`` (token tensors) one forward each, ``crop(-crops[i])`` after piece i, then
    greedy one-token steps; returns the steps' logits and the cache."""
    cache = kvpress.make_cache(model, policy)
    with torch.no_grad(), kvpress.apply(model, policy):
        if record:
            cache.activate_past_recording()
        out = None
        for ids, n in zip(pieces, crops):
            out = model(ids, use_cache=True, **cache_kwargs(model, cache))
            if record:
                cache.crop(-n)
        logits = []
        nxt = torch.tensor([[7]], device=model.device)
        for _ in range(decode_steps):
            out = model(nxt, use_cache=True, **cache_kwargs(model, cache))
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1), cache


@pytest.mark.parametrize("extra", [4, 20])
@pytest.mark.parametrize("name", CROPPABLE)
def test_crop_takes_back_the_end_of_a_forward(cache_model, name, extra):
    """A forward whose last tokens are taken back leaves the cache as a forward without them:
    the prompt's own forward (assisted decoding's first verification) and a later one. 20 extra
    tokens are more than the examples' windows hold (quantized windows of 16 flush their excess)."""
    policy = example(name, kvpress.get_adapter(cache_model))
    ids = random_ids(PROMPT + extra, seed=11)
    more = random_ids(extra + 2, seed=12)
    got, cache = _forwards(cache_model, policy, [ids, more], [extra, extra])
    # the reference records too (crops of 0): with past recording on a forward after the prompt
    # attends as decode steps under the selection policies and duo, so its hidden states differ
    ref, ref_cache = _forwards(cache_model, policy, [ids[:, :PROMPT], more[:, :2]], [0, 0])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert kvpress.cache_stats(cache).tokens == kvpress.cache_stats(ref_cache).tokens == PROMPT + 2 + 3


@pytest.mark.parametrize("name", CROPPABLE)
def test_crop_zero_and_whole_forward(llama, name):
    """``crop(0)`` after each forward changes nothing; taking back a whole later forward as well."""
    policy = example(name, kvpress.get_adapter(llama))
    ids, more = random_ids(PROMPT, seed=13), random_ids(4, seed=14)
    got, _ = _forwards(llama, policy, [ids, more, more[:, :1]], [0, 4, 0])
    ref, _ = _forwards(llama, policy, [ids, more[:, :1]], [0, 0], record=False)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_refused_crops_name_the_limit_and_change_nothing(llama):
    ids = random_ids(PROMPT, seed=15)
    for name, pattern in (("window", "activate_past_recording"), ("full", "at most 48")):
        policy = example(name, kvpress.get_adapter(llama))
        cache = kvpress.make_cache(llama, policy)
        with torch.no_grad(), kvpress.apply(llama, policy):
            llama(ids, use_cache=True, **cache_kwargs(llama, cache))
            with pytest.raises(ValueError, match=pattern):
                cache.crop(-(PROMPT + 1) if name == "full" else -1)
            assert cache.get_seq_length() == PROMPT
            llama(ids[:, :1], use_cache=True, **cache_kwargs(llama, cache))  # still usable
        assert kvpress.cache_stats(cache).tokens == PROMPT + 1
    with pytest.raises(TypeError, match="int"):
        cache.crop(1.5)


def test_positive_crop_is_the_length_to_keep_and_tensors_count(llama):
    policy = kvpress.get_policy("full")
    cache = kvpress.make_cache(llama, policy)
    with torch.no_grad(), kvpress.apply(llama, policy):
        llama(random_ids(PROMPT, seed=16), use_cache=True, **cache_kwargs(llama, cache))
        cache.crop(40)
        assert cache.get_seq_length() == 40 and kvpress.cache_stats(cache).tokens == 40
        cache.crop(60)  # longer than the cache: nothing to remove
        assert cache.get_seq_length() == 40
        cache.crop(torch.tensor(-2))  # transformers 5.17's assisted decoding passes a tensor
        assert cache.get_seq_length() == 38


def _repeating_prompt(length=PROMPT, period=12, seed=17):
    """A prompt that repeats itself, so prompt lookup finds drafts to verify (and reject)."""
    return random_ids(period, seed=seed).repeat(1, length // period)


def _generate(model, ids, policy, **kwargs):
    with torch.no_grad(), kvpress.apply(model, policy):
        return model.generate(ids, max_new_tokens=10, do_sample=False, **kwargs)


@pytest.mark.parametrize("name", CROPPABLE)
def test_prompt_lookup_decoding(cache_model, name):
    """``generate(prompt_lookup_num_tokens=...)`` runs under every croppable policy; where a
    forward of several tokens attends as the same tokens fed one at a time would, it gives plain
    greedy's tokens."""
    policy = example(name, kvpress.get_adapter(cache_model))
    ids = _repeating_prompt()
    got = _generate(cache_model, ids, policy, prompt_lookup_num_tokens=3)
    assert got.shape == (1, PROMPT + 10) and torch.equal(got[:, :PROMPT], ids)
    if name in ONE_AT_A_TIME:
        assert torch.equal(got, _generate(cache_model, ids, policy))


@pytest.mark.parametrize("name", ["full", "window", "snapkv"])
def test_assistant_model_decoding(llama, name):
    """``generate(assistant_model=...)``: the assistant runs unpatched with its own cache."""
    assistant = tiny_model("llama", seed=1, layers=1)
    policy = example(name, kvpress.get_adapter(llama))
    ids = _repeating_prompt(seed=18)
    got = _generate(llama, ids, policy, assistant_model=assistant)
    assert torch.equal(got, _generate(llama, ids, policy))
    assert assistant.config._attn_implementation != "kvpress"


@pytest.mark.parametrize("name,overrides", [("quest", {"tail_chunk": 8}), ("double_sparsity", {"tail_chunk": 8}),
                                            ("double_sparsity", {"label_bits": 4})])
def test_crop_rebuilds_pages_labels_and_tail_sums(llama, name, overrides):
    """The metadata a crop must bring back in line, compared directly with a cache that never saw
    the removed tokens: Quest's page min / max, Double Sparsity's labels, the tail's chunk sums
    (a left-padded batch, so pages and chunks start at each row's first real token)."""
    policy = example(name, kvpress.get_adapter(llama)).replace(**overrides)
    ids = random_ids(PROMPT + 13, batch=2, seed=19)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def layer_after(length, extra):
        cache = kvpress.make_cache(llama, policy)
        with torch.no_grad(), kvpress.apply(llama, policy):
            cache.activate_past_recording()
            llama(ids[:, :length], attention_mask=mask[:, :length], use_cache=True, **cache_kwargs(llama, cache))
            cache.crop(-extra)
        return cache.layers[-1]

    got, ref = layer_after(PROMPT + 13, 13), layer_after(PROMPT, 0)
    if name == "quest":
        pages = -(-PROMPT // policy.page_size)
        for a, b in zip(got.pages.bounds(pages), ref.pages.bounds(pages)):
            torch.testing.assert_close(a, b)
        assert torch.isinf(got.pages.page_min[:, :, pages:]).all()
    else:
        torch.testing.assert_close(got.label_cache.view(), ref.label_cache.view())
    if policy.tail_chunk:
        for a, b in zip(got.tail.means(), ref.tail.means()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CROPPABLE)
def test_crop_on_cuda_matches_cpu(name):
    """A cropped forward on CUDA (records, restores, deferred flushes on the device) gives the
    CPU run's next-step logits (Triton's fp32 dots use tf32, hence the tolerance)."""
    model = tiny_model("llama", layers=2, heads=8, kv_heads=2, head_dim=64)  # a head_dim the kernels take
    policy = example(name, kvpress.get_adapter(model))
    ids, more = random_ids(PROMPT + 20, seed=21), random_ids(22, seed=22)
    cpu, _ = _forwards(model, policy, [ids, more], [20, 20])
    gpu, cache = _forwards(model.cuda(), policy, [ids.cuda(), more.cuda()], [20, 20])
    torch.testing.assert_close(gpu.cpu(), cpu, atol=5e-3, rtol=0)
    assert kvpress.cache_stats(cache).tokens == PROMPT + 2 + 3


# policies whose layers keep every token, or every token after the prompt (shadowkv): a crop
# may go back across several forwards
TRUNCATING = ("full", "quest", "double_sparsity", "tidal", "exact_topk", "shadowkv")


@pytest.mark.parametrize("name", CROPPABLE)
def test_cut_back_to_a_prefilled_document(llama, name):
    """Reuse a prefilled document for a second question: ``crop(length)`` back past two forwards.
    Layers that keep every token (after the prompt, for shadowkv) can; the others refuse (only
    the latest forward is recorded) and leave the cache as it was."""
    policy = example(name, kvpress.get_adapter(llama))
    doc, q1, q2 = random_ids(PROMPT, seed=23), random_ids(5, seed=24), random_ids(3, seed=25)
    cache = kvpress.make_cache(llama, policy)
    with torch.no_grad(), kvpress.apply(llama, policy):
        cache.activate_past_recording()
        for piece in (doc, q1, q1[:, :2]):
            llama(piece, use_cache=True, **cache_kwargs(llama, cache))
            cache.crop(0)
        if name not in TRUNCATING:
            with pytest.raises(ValueError, match="at most"):
                cache.crop(PROMPT)
            assert cache.get_seq_length() == PROMPT + 7
            return
        cache.crop(PROMPT)
        got = llama(q2, use_cache=True, **cache_kwargs(llama, cache)).logits
    ref_cache = kvpress.make_cache(llama, policy)
    with torch.no_grad(), kvpress.apply(llama, policy):
        ref_cache.activate_past_recording()  # (q2 then attends as steps in both)
        llama(doc, use_cache=True, **cache_kwargs(llama, ref_cache))
        ref = llama(q2, use_cache=True, **cache_kwargs(llama, ref_cache)).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def _after_prompt(model, policy, doc, record):
    """A cache holding the prompt ``doc``; with ``record`` it records each forward and the prompt's
    is ended by ``crop(0)``, as assisted decoding does after each forward (a quantized window flushes)."""
    cache = kvpress.make_cache(model, policy)
    with torch.no_grad(), kvpress.apply(model, policy):
        if record:
            cache.activate_past_recording()
        model(doc, use_cache=True, **cache_kwargs(model, cache))
        if record:
            cache.crop(0)
    return cache


@pytest.mark.parametrize("name", ["quest", "double_sparsity", "tidal", "exact_topk", "duo", "kivi", "gear",
                                  "zipcache"])
def test_verification_attends_as_decode_steps_and_a_new_turn_densely(llama, name):
    """With past recording on (assisted decoding) a forward of several tokens after the prompt
    gives the logits of the same tokens fed one at a time; without it (a new turn) it attends
    as a prompt continuation, which differs once the selection or the window leaves tokens out.
    12 tokens cross the examples' quantized windows' flush point (16 + 8 tokens, 16 after the
    prompt): steps read the flushed tokens quantized from there on, and so does the verification."""
    policy = example(name, kvpress.get_adapter(llama))
    doc, turn = random_ids(PROMPT, seed=31), random_ids(12, seed=32)

    def logits(record, one_at_a_time):
        cache = _after_prompt(llama, policy, doc, record)
        with torch.no_grad(), kvpress.apply(llama, policy):
            pieces = [turn[:, t:t + 1] for t in range(12)] if one_at_a_time else [turn]
            return torch.cat([llama(p, use_cache=True, **cache_kwargs(llama, cache)).logits for p in pieces], 1)

    steps = logits(record=False, one_at_a_time=True)
    torch.testing.assert_close(logits(record=True, one_at_a_time=False), steps, atol=1e-5, rtol=0)
    assert (logits(record=False, one_at_a_time=False) - steps).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["kivi", "gear", "zipcache"])
@pytest.mark.parametrize("keep", [3, 10])
def test_crop_takes_back_a_flush_inside_a_verification(llama, name, keep):
    """A verification of 12 tokens flushes after its 8th (where decode steps would); cropped to 3
    tokens that flush is taken back, cropped to 10 it stays: either way the first layer (whose keys
    do not depend on attention) holds exactly what decode steps of the kept tokens leave."""
    policy = example(name, kvpress.get_adapter(llama))
    doc, turn = random_ids(PROMPT, seed=33), random_ids(12, seed=34)
    caches = []
    for record in (True, False):
        cache = _after_prompt(llama, policy, doc, record)
        with torch.no_grad(), kvpress.apply(llama, policy):
            if record:
                llama(turn, use_cache=True, **cache_kwargs(llama, cache))
                cache.crop(-(12 - keep))
            else:
                for t in range(keep):
                    llama(turn[:, t:t + 1], use_cache=True, **cache_kwargs(llama, cache))
        caches.append(cache.layers[0])
    got, ref = caches
    assert (got.n_quant, got.win_len, got.seen) == (ref.n_quant, ref.win_len, ref.seen)
    assert got.n_quant == PROMPT - 16 + (8 if keep == 10 else 0)  # (the examples' windows: 16 + 8)
    # the packed store as attention reads it (codes, sinks, GEAR's corrections) and the window; a
    # 12-row projection rounds a little differently from a 1-row one (1e-7), nothing more
    for a, b in zip(*(dequantized(layer, layer.k_win[:, :, :layer.win_len].float(),
                                  layer.v_win[:, :, :layer.win_len].float()) for layer in (got, ref))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    if name == "zipcache":  # the probes the next flush's saliency reads: the kept steps' queries
        assert got.probe_pos == ref.probe_pos and got.probe_rand == ref.probe_rand
        assert torch.equal(got.probe_pos_dev, ref.probe_pos_dev)
        torch.testing.assert_close(got.probe_q, ref.probe_q, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.probe_lse, ref.probe_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["full", "snapkv", "kivi"])
def test_a_forward_that_does_not_continue_the_cache_is_refused_and_leaves_it_intact(llama, name):
    """transformers' assisted generation on a cache that holds tokens feeds the whole sequence
    again from position 0 (5.24); the unpatched model stores it a second time, kvpress refuses,
    and the cache goes on as before: a plain second turn gives the tokens it gives without the
    refused attempt. Positions that continue the cache pass (padded rows: from their first
    real token)."""
    policy = example(name, kvpress.get_adapter(llama))
    doc = random_ids(PROMPT, seed=41)
    turn_ids = random_ids(12, seed=42)

    def second_turn(try_assisted):
        with torch.no_grad(), kvpress.apply(llama, policy):
            first = llama.generate(doc, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
            seen = first.past_key_values.get_seq_length()
            turn = torch.cat([first.sequences, turn_ids], 1)
            if try_assisted:
                with pytest.raises(ValueError, match=r"positions start at \[0\].*cache already holds"):
                    llama.generate(turn, past_key_values=first.past_key_values, max_new_tokens=4, do_sample=False,
                                   prompt_lookup_num_tokens=3)
                assert first.past_key_values.get_seq_length() == seen
                with pytest.raises(ValueError, match="cache already holds"):  # by hand, the same mistake
                    llama(turn, position_ids=torch.arange(turn.shape[1])[None], use_cache=True,
                          **cache_kwargs(llama, first.past_key_values))
            return llama.generate(turn, past_key_values=first.past_key_values, max_new_tokens=4, do_sample=False,
                                  return_dict_in_generate=True, output_scores=True)

    got, ref = second_turn(True), second_turn(False)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["snapkv", "quest", "kivi"])
def test_the_cache_assisted_decoding_returns_no_longer_records(llama, name):
    """Assisted decoding turns past recording on and transformers leaves it on; ``apply``'s
    ``generate`` ends it, so a second turn on that cache is a new turn (for these policies one
    that differs from a verification's steps), as after plain decoding of the same tokens."""
    policy = example(name, kvpress.get_adapter(llama))
    doc, more = _repeating_prompt(), random_ids(20, seed=44)

    def second_turn(**assist):
        with torch.no_grad(), kvpress.apply(llama, policy):
            first = llama.generate(doc, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, **assist)
            cache = first.past_key_values
            assert not any(layer.record_past for layer in cache.layers)
            assert all(getattr(layer, "_record", None) is None for layer in cache.layers)
            turn = torch.cat([first.sequences, more], 1)
            return first.sequences, llama.generate(turn, past_key_values=cache, max_new_tokens=4, do_sample=False,
                                                   return_dict_in_generate=True, output_scores=True)

    (seq_a, got), (seq_p, ref) = second_turn(prompt_lookup_num_tokens=3), second_turn()
    if not torch.equal(seq_a, seq_p):
        pytest.skip("assisted and plain first turns differ for this policy")
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
