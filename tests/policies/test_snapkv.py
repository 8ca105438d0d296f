"""SnapKV: the observation window picks what each head keeps, memory really shrinks, the budget holds."""

import pytest
import torch

import kvpress
from kvpress.cache import PolicyCache
from kvpress.policies._snapkv_plan import plan_slots
from kvpress.policies.snapkv import snap_scores
from kvpress.stats import tensor_bytes

from conftest import random_ids, tiny_model
from smollm2_needle import beside_full, needle_run


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")  # 4 query heads, 2 KV heads, head_dim 16


def snap_layer(model, row_start=None, **fields):
    policy = kvpress.get_policy("snapkv", **{"budget": 20, "window_size": 4, "kernel_size": 3, **fields})
    cache = PolicyCache(policy, kvpress.get_adapter(model))
    if row_start is not None:
        cache.set_left_padding(torch.tensor(row_start))
    layer = cache.layers[0]
    return layer


def prompt(layer, length, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, length, 16, generator=g)
    k, v = torch.randn(batch, 2, length, 16, generator=g), torch.randn(batch, 2, length, 16, generator=g)
    layer.lazy_initialization(k, v)
    layer.attend(q, k, v, 0.25)
    return q, k, v


def step(layer, seed):
    g = torch.Generator().manual_seed(seed)
    b = layer.k.shape[0]
    return layer.attend(torch.randn(b, 4, 1, 16, generator=g), torch.randn(b, 2, 1, 16, generator=g),
                        torch.randn(b, 2, 1, 16, generator=g), 0.25)


def test_each_head_keeps_the_window_and_its_top_scored_tokens(model):
    layer = snap_layer(model)
    q, k, _ = prompt(layer, 60)
    assert layer.filled == 20 and layer.k.shape[2] == 20  # only budget tokens exist
    # reference scores, written out: window attention summed, max-pooled over 3, group mean
    probs = torch.softmax((q[0, :, -4:] @ k[0].repeat_interleave(2, 0).transpose(-1, -2)) * 0.25
                          + torch.triu(torch.full((4, 60), float("-inf")), diagonal=57), -1)  # (H_q, 4, 60)
    votes = probs.sum(1)
    pooled = torch.stack([votes[:, max(0, t - 1) : t + 2].amax(-1) for t in range(60)], -1)
    scores = pooled.reshape(2, 2, 60).mean(1)  # (H_kv, 60)
    torch.testing.assert_close(snap_scores(q[:, :, -4:], k, 0.25, None, 4, 3)[0], scores)
    for h in range(2):
        kept = set(layer.pos[0, h].tolist())
        assert set(range(56, 60)) <= kept  # the observation window is never evicted
        assert kept - set(range(56, 60)) == set(torch.topk(scores[h, :56], 16).indices.tolist())
        torch.testing.assert_close(layer.k[0, h], k[0, h, layer.pos[0, h]])  # stored rows are those tokens


def test_resident_bytes_shrink_and_are_the_tensors_that_exist(model):
    policy = kvpress.get_policy("snapkv", budget=24, window_size=8, kernel_size=3)
    with torch.no_grad(), kvpress.apply(model, policy):
        cache = model(random_ids(80), use_cache=True).past_key_values
    with torch.no_grad(), kvpress.apply(model, kvpress.get_policy("full")):
        full = model(random_ids(80), use_cache=True).past_key_values
    stats, full_stats = kvpress.cache_stats(cache), kvpress.cache_stats(full)
    assert stats.resident_bytes == sum(tensor_bytes(l.state_tensors().values()) for l in cache.layers)
    per_layer = 2 * 2 * 24 * 16 * 4 + 2 * 24 * 8 + 8 + 2 * 24 * 4  # k and v, pos (int64), kept (int64), score (fp32)
    assert stats.resident_bytes == 2 * per_layer < full_stats.resident_bytes
    assert [l.stored_tokens() for l in cache.layers] == [24, 24]


def test_decode_holds_the_budget_and_never_evicts_the_observation_window(model):
    layer = snap_layer(model)
    prompt(layer, 60)
    window = set(range(56, 60))
    score = {h: {int(p): float(sc) for p, sc in zip(layer.pos[0, h], layer.score[0, h]) if p >= 0} for h in range(2)}
    selected = {h: set(score[h]) - window for h in range(2)}
    for t in range(7):
        step(layer, seed=10 + t)
        assert layer.filled == 20 and layer.k.shape[2] == 20
        index = layer._index()
        assert index.num_attended().tolist() == [[20, 20]]
        for h in range(2):
            kept = set(layer.pos[0, h].tolist())
            assert window <= kept  # the observation window (the question) is never evicted
            assert set(range(60 + t - 3, 61 + t)) <= kept  # the 4 most recent tokens
            # the first 4 generated tokens each push out the lowest-scored selected prompt token;
            # later ones replace the generated token leaving the recent window
            dropped = sorted(selected[h], key=lambda p: score[h][p])[: min(t + 1, 4)]
            assert kept & selected[h] == selected[h] - set(dropped)


def test_short_prompt_grows_until_the_budget_then_evicts(model):
    layer = snap_layer(model, budget=12)
    prompt(layer, 9)
    assert layer.filled == 9 and sorted(layer.pos[0, 0].tolist()) == [-1] * 3 + list(range(9))
    score = {int(p): float(sc) for p, sc in zip(layer.pos[0, 0], layer.score[0, 0]) if p >= 0}
    for t in range(5):
        step(layer, seed=t)
    assert layer.filled == 12 and layer.stored_tokens() == 12
    # position 12 pushed out the lowest-scored prompt token outside the observation window (5..8);
    # position 13 replaced generated token 9, which left the recent window of 4
    lowest = min(range(5), key=lambda p: score[p])
    assert set(layer.pos[0, 0].tolist()) == set(range(14)) - {lowest, 9}
    assert set(range(5, 9)) <= set(layer.pos[0, 0].tolist())


def test_left_padded_short_row_fills_its_free_slots_first(model):
    layer = snap_layer(model, row_start=[0, 50])
    prompt(layer, 60, batch=2)  # row 1 has 10 real tokens: all kept, right-aligned
    assert layer.kept.tolist() == [20, 10]
    assert (layer.pos[1, :, :10] == -1).all() and layer.pos[1, 0, 10:].tolist() == list(range(50, 60))
    step(layer, seed=3)
    assert layer.kept.tolist() == [20, 11] and layer.pos[1, 0, 9] == 60
    assert layer._index().num_attended().tolist() == [[20, 20], [11, 11]]


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="budget >= 32"):
        kvpress.get_policy("snapkv", budget=16)
    with pytest.raises(ValueError, match="odd"):
        kvpress.get_policy("snapkv", kernel_size=4)
    with pytest.raises(ValueError, match="window_size"):
        kvpress.get_policy("snapkv", window_size=0)


@pytest.mark.smollm2
def test_smollm2_decode_follows_full_when_few_tokens_are_evicted():
    ref, res = beside_full(kvpress.get_policy("snapkv", budget=480))
    assert torch.equal(res.tokens, ref.tokens)
    assert res.stats.resident_bytes < 0.95 * ref.stats.resident_bytes


def test_default_pool_keeps_a_digit_per_token_value_after_the_attended_key():
    """Regression: with a +-3 pool SmolLM2 kept only the first digits of a 7-digit needle (one
    token per digit) sitting after the key phrase the window attends to; the default pool spans it."""
    width = kvpress.get_policy("snapkv").kernel_size
    T, key = 64, 20
    k = torch.randn(1, 2, T, 16) * 0.01
    k[:, :, key] = 1.0  # the window's queries match only the key token
    q = torch.ones(1, 4, 4, 16) * 4.0
    scores = snap_scores(q, k, 0.25, None, 4, width)[0]  # (H_kv, T)
    assert width // 2 >= 10  # ':', a space, 7 digits and '.' after the key (+-7 dropped the last digit)
    span = list(range(key + 1, key + width // 2 + 1))
    peak = scores[:, key : key + 1]
    assert (scores[:, span] == peak).all()  # every digit ranks with the key: kept together
    assert (scores[:, key + width // 2 + 2 : T - 4] < peak).all()


@pytest.mark.slow
def test_smollm2_4k_needle_survives_budget_1024():
    """The case that exposed the narrow pool: SmolLM2, 4k niah_single, needle at depth 0."""
    score, stats = needle_run(kvpress.get_policy("snapkv", budget=1024))
    assert score == 1.0


def _twins(model, length, extra, batch=1, row_start=None, **fields):
    """Two layers after the same ``length``-token prompt, and ``extra`` more tokens' q / k / v."""
    g = torch.Generator().manual_seed(1000 * length + extra)
    q = torch.randn(batch, 4, length + extra, 16, generator=g)
    k, v = torch.randn(batch, 2, length + extra, 16, generator=g), torch.randn(batch, 2, length + extra, 16, generator=g)
    layers = []
    for _ in range(2):
        layer = snap_layer(model, row_start=row_start, **fields)
        layer.lazy_initialization(k, v)
        layer.attend(q[:, :, :length], k[:, :, :length], v[:, :, :length], 0.25)
        layers.append(layer)
    return layers, (q[:, :, length:], k[:, :, length:], v[:, :, length:])


def _same_state(a, b):
    assert (a.filled, a.seen, a.prompt_len) == (b.filled, b.seen, b.prompt_len)
    for name in ("k", "v", "pos", "score", "kept"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("record", [True, False], ids=["verification", "turn-as-steps"])
@pytest.mark.parametrize("length,extra,batch,row_start,fields,planned", [
    (60, 2, 1, None, {}, True),     # a short verification: prompt tokens evicted by score
    (60, 7, 1, None, {}, True),     # past the window: generated tokens of this forward leave
    (60, 200, 1, None, {}, True),   # a long forward
    (9, 5, 1, None, {}, True),      # a short prompt grows, within the budget
    (9, 40, 1, None, {}, True),     # ... then reaches it and evicts
    (3, 60, 1, None, {}, True),     # prompt shorter than the window
    (60, 30, 2, [0, 5], {}, True),  # padding, both rows over the budget
    (9, 8, 2, [0, 3], {}, True),    # padding while the rows grow
    (60, 30, 2, [0, 50], {}, True),  # a short padded row fills its free slots first, then evicts
    (60, 3, 2, [0, 50], {}, True),  # ... only free slots
    (9, 40, 2, [0, 3], {}, True),  # growth, then the padded row fills its free slots
    (60, 30, 2, [0, 50], {"budget": 6}, False),  # fewer scored prompt tokens than evictions
    (60, 30, 1, None, {"budget": 6}, False),  # fewer scored prompt tokens than evictions
])
def test_several_tokens_after_the_prompt_equal_as_many_decode_steps(model, length, extra, batch, row_start,
                                                                     fields, planned, record):
    """A verification (past recording on), or any forward with ``reselect_turns=False``."""
    if not record:
        fields = {**fields, "reselect_turns": False}
    (one, steps), (q, k, v) = _twins(model, length, extra, batch, row_start, **fields)
    assert (plan_slots(one, extra) is not None) == planned  # (a plan only grows the buffers, as the steps would)
    if record:
        one.activate_past_recording()
        one.record_forward(k, v)
    out = one.attend(q, k, v, 0.25)
    ref = torch.cat([steps.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], 0.25) for t in range(extra)], 2)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    _same_state(one, steps)


def test_crop_of_a_planned_forward_stores_again_as_the_steps_would(model):
    (one, steps), (q, k, v) = _twins(model, 60, 12)
    one.activate_past_recording()
    one.record_forward(k, v)
    one.attend(q, k, v, 0.25)
    one.remove_latest(5)  # store_again plans the 7 kept tokens
    for t in range(7):
        steps.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], 0.25)
    _same_state(one, steps)


# ---------------------------------------------------------------- a new turn is selected again
def _reference_turn(layer_before, q, k, v, scaling, window, kernel, budget):
    """What a new turn should do, written out per row and KV head from the kept tokens' positions:
    each turn query attends to every kept token and the turn's up to itself; the window's
    attention, summed, max-pooled over neighbouring positions (evicted ones 0) and averaged over
    the group, picks ``budget`` tokens with the window always kept."""
    B, H_q, n, D = q.shape
    H = k.shape[1]
    G = H_q // H
    start = layer_before["seen"]
    end = start + n
    outs = torch.zeros(B, H_q, n, D)
    kept_sets = {}
    for b in range(B):
        for h in range(H):
            slots = [s for s in range(layer_before["filled"] - int(layer_before["kept"][b]), layer_before["filled"])]
            cand_pos = [int(layer_before["pos"][b, h, s]) for s in slots] + list(range(start, end))
            cand_k = torch.cat([layer_before["k"][b, h, slots], k[b, h]])
            cand_v = torch.cat([layer_before["v"][b, h, slots], v[b, h]])
            pos_t = torch.tensor(cand_pos)
            votes = torch.zeros(G, end)
            for g in range(G):
                qh = q[b, h * G + g]  # (n, D)
                q_pos = torch.arange(start, end)
                logits = (qh @ cand_k.T) * scaling
                logits = logits.masked_fill(pos_t[None, :] > q_pos[:, None], float("-inf"))
                probs = torch.softmax(logits, -1)
                outs[b, h * G + g] = probs @ cand_v
                votes[g].index_add_(0, pos_t, probs[n - min(window, n):].sum(0))
            pooled = torch.stack([votes[:, max(0, t - kernel // 2): t + kernel // 2 + 1].amax(-1)
                                  for t in range(end)], -1).mean(0)  # (end,)
            kept_sets[b, h] = {p: (float("inf") if p >= end - window else float(pooled[p])) for p in cand_pos}
    return outs, kept_sets


def _is_top(held: set, score: dict, budget: int) -> bool:
    """``held`` is a top-``budget`` set of ``score`` (ties at the cut either way)."""
    rest = set(score) - held
    return len(held) == min(budget, len(score)) and held <= set(score) and (
        not rest or min(score[p] for p in held) >= max(score[p] for p in rest))


def _state(layer):
    return {name: getattr(layer, name).clone() if torch.is_tensor(getattr(layer, name)) else getattr(layer, name)
            for name in ("k", "v", "pos", "kept", "filled", "seen")}


@pytest.mark.parametrize("length,decoded,extra,batch,row_start,turns", [
    (60, 0, 30, 1, None, 1),     # a turn right after the prompt
    (60, 9, 30, 1, None, 1),     # after some decode steps (generated tokens re-scored too)
    (60, 3, 2, 1, None, 1),      # a turn shorter than the window: its queries score, older window tokens stay
    (60, 5, 30, 2, [0, 50], 1),  # a padded row holding fewer tokens than the budget before the turn
    (8, 0, 6, 1, None, 1),       # everything still fits: nothing evicted
    (60, 5, 25, 2, [0, 50], 3),  # turns after turns, decode steps between them
])
def test_a_new_turn_attends_densely_and_is_selected_again(model, length, decoded, extra, batch, row_start, turns):
    layer = snap_layer(model, row_start=row_start)
    prompt(layer, length, batch=batch)
    for turn in range(turns):
        for t in range(decoded):
            step(layer, seed=100 * turn + t)
        before = _state(layer)
        g = torch.Generator().manual_seed(7 + turn)
        q = torch.randn(batch, 4, extra, 16, generator=g)
        k, v = torch.randn(batch, 2, extra, 16, generator=g), torch.randn(batch, 2, extra, 16, generator=g)
        out = layer.attend(q, k, v, 0.25)
        ref_out, ref_scores = _reference_turn(before, q, k, v, 0.25, window=4, kernel=3, budget=20)
        torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
        assert layer.seen == before["seen"] + extra and layer.prompt_len == layer.seen
        totals = before["kept"] + extra
        assert layer.kept.tolist() == totals.clamp(max=20).tolist()
        assert layer.filled == min(20, int(totals.max())) <= 20  # only budget tokens exist
        for b in range(batch):
            for h in range(2):
                slots = range(layer.filled - int(layer.kept[b]), layer.filled)
                held = [int(layer.pos[b, h, s]) for s in slots]
                assert held == sorted(held) and _is_top(set(held), ref_scores[b, h], 20), (turn, b, h)
                for s, p in zip(slots, held):  # each slot holds that token's key and value
                    src_k = k[b, h, p - before["seen"]] if p >= before["seen"] else \
                        before["k"][b, h][before["pos"][b, h] == p][0]
                    torch.testing.assert_close(layer.k[b, h, s], src_k)


def test_after_a_turn_decode_evicts_by_the_turns_scores_and_the_budget_holds(model):
    layer = snap_layer(model)
    prompt(layer, 60)
    g = torch.Generator().manual_seed(3)
    layer.attend(torch.randn(1, 4, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g),
                 torch.randn(1, 2, 30, 16, generator=g), 0.25)
    window = set(range(86, 90))
    lowest = {h: int(layer.pos[0, h, layer.score[0, h].argmin()]) for h in range(2)}
    step(layer, seed=1)
    for h in range(2):
        held = set(layer.pos[0, h].tolist())
        assert lowest[h] not in held and 90 in held and window <= held
    for t in range(20):
        step(layer, seed=2 + t)
        assert layer.filled == 20 == layer.k.shape[2]
    for h in range(2):  # after window_size steps the generated tokens leave; the turn's window stays
        assert window <= set(layer.pos[0, h].tolist())
        assert set(range(107, 111)) <= set(layer.pos[0, h].tolist())


def test_turn_pieces_held_densely_until_the_end_and_counted(model):
    """A turn given in pieces inside ``cache.prompt()`` stages them (counted by ``cache_stats``)
    and selects once at the end, as one forward of the turn."""
    policy = kvpress.get_policy("snapkv", budget=24, window_size=8, kernel_size=3)
    ids, turn = random_ids(48, seed=1), random_ids(40, seed=2)
    caches = []
    for pieces in (1, 3):
        cache = kvpress.make_cache(model, policy)
        with torch.no_grad(), kvpress.apply(model, policy):
            model(ids, past_key_values=cache, use_cache=True)
            with cache.prompt():
                for piece in turn.tensor_split(pieces, dim=1):
                    last = model(piece, past_key_values=cache, use_cache=True).logits[:, -1]
                staged = kvpress.cache_stats(cache)
            after = kvpress.cache_stats(cache)
        assert staged.layers[0].stored_tokens == 24 + 40 and after.layers[0].stored_tokens == 24
        assert staged.resident_bytes > after.resident_bytes
        caches.append((last, cache))
    (a, one), (b, three) = caches
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    for la, lb in zip(one.layers, three.layers):
        assert torch.equal(la.pos, lb.pos)


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("row_start,length,turn", [(None, 30, 0), ([0, 7], 12, 0), ([3, 0], 9, 6)])
def test_static_step_stores_and_attends_as_the_eager_step(model, row_start, length, turn, planned, monkeypatch):
    """The static decode step (``plan.static``; run here without compiling) chooses every slot on the
    device as the eager step does on the host: growing, a shorter row's free slots, evictions by
    score, then the generated tokens leaving the window; after a prompt, and after a new turn."""
    from kvpress.plan import ForwardKind, ForwardPlan

    eager = snap_layer(model, row_start)
    static = snap_layer(model, row_start)
    if planned:
        static.cache.capacity = 128  # buffers sized for the whole generation (min(budget, capacity))
    for layer in (eager, static):
        prompt(layer, length, batch=2)
        if turn:
            g = torch.Generator().manual_seed(9)
            layer.attend(torch.randn(2, 4, turn, 16, generator=g), torch.randn(2, 2, turn, 16, generator=g),
                         torch.randn(2, 2, turn, 16, generator=g), 0.25)
    assert static.k.shape[2] == (20 if planned else eager.k.shape[2])
    import kvpress.policies.snapkv as snapkv_module

    calls, static_step = [], snapkv_module.static_step
    monkeypatch.setattr(snapkv_module, "static_step", lambda *args: calls.append(1) or static_step(*args))
    for t in range(40):
        seen = static.seen
        static.cache.plan = ForwardPlan(ForwardKind.DECODE, 1, torch.tensor([seen]), torch.tensor([seen + 1]),
                                        static=True)
        out_static = step(static, seed=100 + t)
        out_eager = step(eager, seed=100 + t)
        torch.testing.assert_close(out_static, out_eager, atol=2e-6, rtol=1e-5)
        assert static.seen == eager.seen and static.filled == eager.filled
        assert torch.equal(static.kept, eager.kept)
        n = eager.filled
        assert torch.equal(static.pos[:, :, :n], eager.pos[:, :, :n])
        assert torch.equal(static.k[:, :, :n], eager.k[:, :, :n])
        assert torch.equal(static.score[:, :, :n], eager.score[:, :, :n])
        assert bool((static.pos[:, :, n:] == -1).all())
    assert len(calls) == 40 and eager.filled == 20 and int(eager.kept.min()) == 20  # every phase was reached


def test_a_shared_dense_prefill_selects_what_its_own_prefill_selects_with_left_padding(model):
    """`cache_from_dense` hands SnapKV the dense prompt and its last queries (kept by `dense_prefill`):
    the same tokens kept per row and head, the same next-step logits, on a left-padded batch."""
    from kvpress.prefill import cache_from_dense, dense_prefill

    policy = kvpress.get_policy("snapkv", budget=40, window_size=8, kernel_size=3)
    ids = random_ids(70, seed=4).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :25] = 0  # row 1: 45 real tokens after 25 of padding
    logits, dense = dense_prefill(model, ids, mask)
    shared = cache_from_dense(model, policy, dense, attention_mask=mask)
    nxt = logits.argmax(-1, keepdim=True)
    step_mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
    with torch.no_grad(), kvpress.apply(model, policy):
        own = model(ids, attention_mask=mask, use_cache=True)
        own_next = model(nxt, attention_mask=step_mask, past_key_values=own.past_key_values, use_cache=True).logits
        shared_next = model(nxt, attention_mask=step_mask, past_key_values=shared, use_cache=True).logits
    for mine, theirs in zip(shared.layers, own.past_key_values.layers):
        assert torch.equal(mine.pos, theirs.pos) and torch.equal(mine.kept, theirs.kept)
    torch.testing.assert_close(shared_next, own_next, atol=1e-5, rtol=0)


def test_a_window_wider_than_the_dense_prefill_keeps_runs_its_own_prefill(model):
    from kvpress.policy_cache import QUERY_TAIL
    from kvpress.prefill import cache_from_dense, dense_prefill

    wide = kvpress.get_policy("snapkv", budget=2 * QUERY_TAIL + 8, window_size=QUERY_TAIL + 1)
    assert kvpress.get_policy("snapkv").prefills_densely() and not wide.prefills_densely()
    _, dense = dense_prefill(model, random_ids(30, seed=1))
    with pytest.raises(ValueError, match="runs its own prefill"):
        cache_from_dense(model, wide, dense)
