"""Contract tests every registered policy joins automatically (a tiny random model of every supported family)."""

import copy

import pytest
import torch

import kvpress
from kvpress.stats import tensor_bytes

from conftest import contract_model, random_ids, tiny_model

POLICIES = tuple(kvpress.list_policies())
# Options that change how a policy stores its state run the contract too: "policy+field" is the
# policy's example with that boolean field on.
# a policy's example with fields set: "+flag" sets a bool field, "+field=N" an int one
VARIANTS = ("kivi+rotate_values", "zipcache+rotate_values", "zipcache+refine_key_channels=8", "shadowkv+residual_bits=4")
PROMPT = 48
NEW = 6


def example(name, adapter):
    base, *flags = name.split("+")
    fields = dict(f.split("=") if "=" in f else (f, True) for f in flags)
    return kvpress.policy_class(base).example(adapter).replace(
        **{k: int(v) if isinstance(v, str) else v for k, v in fields.items()})


def base_class(name):
    return kvpress.policy_class(name.split("+")[0])


@pytest.fixture(scope="module", params=["llama", "qwen2-sliding"])
def cache_model(request):
    """The cache-handling tests run on a plain model and on one whose last layer slides (the cache
    mixes the policy's layers with the model's own window there)."""
    return contract_model(request.param)


def greedy(model, ids, policy=None, **kwargs):
    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_scores=True, **kwargs)
    if kw.get("num_beams", 1) == 1:  # no EOS: a random model that picks its EOS would end a run early
        kw.setdefault("eos_token_id", [])
    with torch.no_grad():
        if policy is None:
            return model.generate(ids, **kw)
        with kvpress.apply(model, policy):
            return model.generate(ids, **kw)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_generate_returns_policy_cache_with_honest_stats(family_model, name):
    adapter = kvpress.get_adapter(family_model)
    policy = example(name, adapter)
    out = greedy(family_model, random_ids(PROMPT), policy)
    cache = out.past_key_values
    assert isinstance(cache, kvpress.PolicyCache) and cache.policy is policy
    assert len(cache.layers) == adapter.num_layers
    stats = kvpress.cache_stats(cache)
    assert stats.tokens == PROMPT + NEW - 1  # the last sampled token is never fed back
    # Resident bytes are the storages of the layers' state tensors, each counted once.
    expected = 0
    for layer in cache.layers:
        storages = {}
        for t in layer.state_tensors().values():
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        expected += sum(storages.values())
    assert stats.resident_bytes == expected > 0
    assert stats.resident_bytes == sum(s.resident_bytes for s in stats.layers)
    assert stats.offloaded_bytes == sum(tensor_bytes(l.host_tensors().values()) for l in cache.layers)
    # the model's own cache: every token in a full-attention layer, the window in a sliding one
    kept = sum(stats.tokens if adapter.sliding_window(i) is None else min(stats.tokens, adapter.sliding_window(i))
               for i in range(adapter.num_layers))
    assert stats.dense_bytes == 2 * kept * adapter.num_kv_heads * adapter.head_dim * 4
    assert stats.bits_per_element > 0
    for layer in cache.layers:
        for t in layer.state_tensors().values():
            if t is not None:
                assert t.device == family_model.device


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_budget_covering_sequence_is_identity(family_model, name):
    adapter = kvpress.get_adapter(family_model)
    try:
        policy = example(name, adapter).with_budget(4 * (PROMPT + NEW))
    except ValueError as exc:
        pytest.skip(f"{name} has no token budget: {exc}")
    ids = random_ids(PROMPT, seed=1)
    ref = greedy(family_model, ids, kvpress.get_policy("full"))
    out = greedy(family_model, ids, policy)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_deterministic(llama, name):
    policy = example(name, kvpress.get_adapter(llama))
    ids = random_ids(PROMPT, seed=2)
    a, b = greedy(llama, ids, policy), greedy(llama, ids, policy)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_restores_model_on_exit_even_after_exception(llama, name):
    policy = example(name, kvpress.get_adapter(llama))
    ids = random_ids(20, seed=3)
    with torch.no_grad():
        before = llama(ids).logits
    config_before = copy.deepcopy(llama.config.to_dict())
    hooks_before = {n: len(m._forward_pre_hooks) + len(m._forward_hooks) for n, m in llama.named_modules()}
    attrs_before = {n: set(vars(m)) for n, m in llama.named_modules()}
    with pytest.raises(KeyError, match="boom"):
        with kvpress.apply(llama, policy), torch.no_grad():
            llama(ids, use_cache=True)
            raise KeyError("boom")
    with kvpress.apply(llama, policy), torch.no_grad():
        llama.generate(ids, max_new_tokens=2, do_sample=False)
    assert llama.config._attn_implementation == "sdpa"
    assert llama.config.to_dict() == config_before
    assert {n: len(m._forward_pre_hooks) + len(m._forward_hooks) for n, m in llama.named_modules()} == hooks_before
    assert {n: set(vars(m)) for n, m in llama.named_modules()} == attrs_before
    with torch.no_grad():
        after = llama(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_left_padded_batch_matches_single_rows(cache_model, name):
    policy = example(name, kvpress.get_adapter(cache_model))
    long, short = random_ids(40, seed=4), random_ids(27, seed=5)
    batch = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 13:], mask[1, 13:] = short[0], 1
    both = greedy(cache_model, batch, policy, attention_mask=mask).sequences
    one = greedy(cache_model, long, policy).sequences
    two = greedy(cache_model, short, policy).sequences
    assert torch.equal(both[0, 40:], one[0, 40:])
    assert torch.equal(both[1, 40:], two[0, 27:])


def _forward_decode(model, policy, ids, steps=4):
    """Prefill then greedy steps by plain forward calls with no attention mask (no per-row start
    is recorded, as in a perplexity loop); the logits of every step."""
    logits = []
    with torch.no_grad(), kvpress.apply(model, policy):
        cache = kvpress.make_cache(model, policy)
        out = model(ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_unmasked_batch_matches_single_rows(llama, name):
    """Without a mask there is no per-row start: per-row state (sinks, selections) must still be per row."""
    policy = example(name, kvpress.get_adapter(llama))
    rows = [random_ids(36, seed=s) for s in (6, 7)]
    both = _forward_decode(llama, policy, torch.cat(rows))
    for i, ids in enumerate(rows):
        torch.testing.assert_close(both[i], _forward_decode(llama, policy, ids)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", POLICIES)
def test_registry_metadata(name):
    cls = kvpress.policy_class(name)
    assert cls.name == name and cls.description
    if name != "full":
        assert "arXiv" in cls.paper, f"{name} must cite its paper"
    assert cls.__doc__ and len(cls.__doc__) > 40
    policy = kvpress.get_policy(name)
    with pytest.raises(Exception):
        policy.__setattr__(next(iter(policy.to_dict().keys() - {"policy"}), "name"), 1)  # frozen
    assert policy.to_dict()["policy"] == name


@pytest.mark.parametrize("name", [n for n in POLICIES + VARIANTS if base_class(n).full_prefill])
def test_shared_dense_prefill_equals_own_prefill(cache_model, name):
    """full_prefill policies accept a copy of one dense prefill and then decode identically."""
    from kvpress.prefill import cache_from_dense, dense_prefill

    policy = example(name, kvpress.get_adapter(cache_model))
    ids = random_ids(PROMPT, seed=6)
    logits, dense = dense_prefill(cache_model, ids)
    cache = cache_from_dense(cache_model, policy, dense)
    nxt = logits.argmax(-1, keepdim=True)
    with torch.no_grad(), kvpress.apply(cache_model, policy):
        own = cache_model(ids, use_cache=True)
        own_next = cache_model(nxt, past_key_values=own.past_key_values, use_cache=True).logits
        shared_next = cache_model(nxt, past_key_values=cache, use_cache=True).logits
    assert torch.equal(own.logits[:, -1].argmax(-1, keepdim=True), nxt)
    torch.testing.assert_close(shared_next, own_next, atol=1e-5, rtol=0)


def _budget_covering(name, adapter):
    try:
        return example(name, adapter).with_budget(4 * (PROMPT + NEW + 16))
    except ValueError:
        return None  # no token budget: the policy itself is checked, not an identity


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_second_generate_on_the_same_cache_continues_the_conversation(llama, name):
    """Multi-turn: generate, append a new user turn, generate again on the returned cache."""
    adapter = kvpress.get_adapter(llama)
    more = random_ids(7, seed=7)

    def two_turns(policy):
        first = greedy(llama, random_ids(PROMPT, seed=6), policy)
        turn2 = torch.cat([first.sequences, more], dim=1)
        second = greedy(llama, turn2, policy, past_key_values=first.past_key_values)
        return turn2, second

    turn2, second = two_turns(example(name, adapter))
    assert torch.equal(second.sequences[:, : turn2.shape[1]], turn2)
    assert second.sequences.shape[1] == turn2.shape[1] + NEW
    assert kvpress.cache_stats(second.past_key_values).tokens == turn2.shape[1] + NEW - 1  # every token seen
    covering = _budget_covering(name, adapter)
    if covering is not None:  # with the whole conversation in budget the policy is `full`
        (_, got), (_, ref) = two_turns(covering), two_turns(kvpress.get_policy("full"))
        assert torch.equal(got.sequences, ref.sequences)
        for a, b in zip(got.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_prompt_fed_in_chunks_then_decoded(cache_model, name):
    """A prompt fed as two forwards, then decode steps: every token is counted, and a policy whose
    budget covers the sequence gives full's logits."""
    adapter = kvpress.get_adapter(cache_model)
    ids = random_ids(PROMPT, seed=8)

    def chunked(policy):
        with torch.no_grad(), kvpress.apply(cache_model, policy):
            out = cache_model(ids[:, :30], use_cache=True)
            out = cache_model(ids[:, 30:], past_key_values=out.past_key_values, use_cache=True)
            logits = [out.logits[:, -1]]
            for _ in range(3):
                nxt = logits[-1].argmax(-1, keepdim=True)
                out = cache_model(nxt, past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1), out.past_key_values

    logits, cache = chunked(example(name, adapter))
    assert torch.isfinite(logits).all() and kvpress.cache_stats(cache).tokens == PROMPT + 3
    covering = _budget_covering(name, adapter)
    if covering is not None:
        torch.testing.assert_close(chunked(covering)[0], chunked(kvpress.get_policy("full"))[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_beam_search_reorders_the_policy_cache(cache_model, name):
    """num_beams=2 expands and reorders the cache's rows (``batch_select`` / ``reorder_cache``)."""
    adapter = kvpress.get_adapter(cache_model)
    ids = random_ids(PROMPT, seed=9)
    out = greedy(cache_model, ids, example(name, adapter), num_beams=2)
    assert out.sequences.shape == (1, PROMPT + NEW) and torch.equal(out.sequences[:, :PROMPT], ids)
    covering = _budget_covering(name, adapter)
    if covering is not None:
        got = greedy(cache_model, ids, covering, num_beams=2).sequences
        assert torch.equal(got, greedy(cache_model, ids, kvpress.get_policy("full"), num_beams=2).sequences)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def half_model(request):
    return tiny_model("llama").to(request.param)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_runs_in_half_precision_on_cpu(half_model, name):
    """A model loaded in bf16 / fp16 on a CPU (the compiled kernels take fp32 only, so the torch
    paths run): every policy generates finite logits for a left-padded batch, in one forward and
    in 16-token pieces, then for a 40-token second turn on that cache, and is measured against
    the model's own 2-byte cache."""
    adapter = kvpress.get_adapter(half_model)
    policy = example(name, adapter)
    ids = random_ids(PROMPT, batch=2, seed=12)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    for chunk in (None, 16):
        out = greedy(half_model, ids, policy, attention_mask=mask, **({} if chunk is None else {"prefill_chunk_size": chunk}))
        assert all(torch.isfinite(s).all() for s in out.scores), chunk
        stats = kvpress.cache_stats(out.past_key_values)
        # K and V, 2 rows, 2 bytes an element
        assert stats.dense_bytes == 2 * 2 * 2 * adapter.num_layers * stats.tokens * adapter.num_kv_heads * adapter.head_dim
    turn = torch.cat([out.sequences, random_ids(40, batch=2, seed=13)], dim=1)
    turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    second = greedy(half_model, turn, policy, attention_mask=turn_mask, past_key_values=out.past_key_values)
    assert all(torch.isfinite(s).all() for s in second.scores)
    assert kvpress.cache_stats(second.past_key_values).tokens == turn.shape[1] + NEW - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_cuda_matches_cpu_and_runs_in_bf16(name):
    """Each policy on CUDA (Triton kernels where it has them) gives the CPU run's tokens and logits
    (fp32; Triton's fp32 dots use tf32, hence the tolerance), keeps its state on the GPU, and runs
    in bf16 with finite logits."""
    from conftest import tiny_model

    model = tiny_model("llama", layers=2, heads=8, kv_heads=2, head_dim=64)  # a head_dim the kernels take
    policy = example(name, kvpress.get_adapter(model))
    ids = random_ids(160, seed=10)  # past the examples' windows and budgets
    cpu = greedy(model, ids, policy)
    model = model.cuda()
    gpu = greedy(model, ids.cuda(), policy)
    assert torch.equal(gpu.sequences.cpu(), cpu.sequences)
    for a, b in zip(cpu.scores, gpu.scores):
        torch.testing.assert_close(b.cpu(), a, atol=5e-3, rtol=0)
    for layer in gpu.past_key_values.layers:
        assert all(t.is_cuda for t in layer.state_tensors().values() if t is not None)
    half = greedy(model.to(torch.bfloat16), ids.cuda(), policy)
    assert all(torch.isfinite(s).all() for s in half.scores)
    assert kvpress.cache_stats(half.past_key_values).tokens == 160 + NEW - 1


@pytest.fixture(scope="module")
def odd_head_dim_model():
    """head_dim 36: not a multiple of 8 (the compiled kernels' scalar tails) nor of any channel group."""
    return tiny_model("llama", heads=6, kv_heads=2, head_dim=36)


@pytest.mark.parametrize("name", POLICIES + VARIANTS)
def test_head_dim_off_the_vector_width_runs_or_is_refused_up_front(odd_head_dim_model, name):
    """Every policy either runs on a head_dim of 36 (budget covering the sequence: ``full``'s
    tokens) or, for the quantizers (channel groups of 8..128 cannot divide 36), refuses with a clear
    error before anything is patched."""
    model, adapter = odd_head_dim_model, kvpress.get_adapter(odd_head_dim_model)
    ids = random_ids(PROMPT, seed=4)
    ref = greedy(model, ids, kvpress.get_policy("full"))
    try:
        policy = example(name, adapter)
    except ValueError as exc:
        assert "head_dim=36" in str(exc)
        return
    try:
        policy = policy.with_budget(4 * (PROMPT + NEW))
    except ValueError:
        pass  # no token budget
    before = model.config.to_dict()
    try:
        out = greedy(model, ids, policy)
    except ValueError as exc:
        assert "head_dim=36 is not divisible" in str(exc) and model.config.to_dict() == before, exc
        return
    if policy.name in ("kivi", "zipcache", "gear"):
        pytest.fail(f"{name} quantized a head_dim no channel group divides")
    if getattr(policy, "budget", None) is not None:
        assert torch.equal(out.sequences, ref.sequences)
