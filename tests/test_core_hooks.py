"""The core's layer hooks on a toy layer: a verification as decode steps (``verify_as_steps``),
rollback by truncation and by recording (``rollback``), a prompt held in pieces (``stages_prompt``)."""

from types import SimpleNamespace

import pytest
import torch

from kvpress.buffers import KVBuffer
from kvpress.cache import CacheLayer, PolicyCache
from kvpress.plan import ForwardKind, ForwardPlan

B, H, D = 2, 2, 4


def _cache(kind=None, new_tokens=1, start=0):
    """What the layers and ``PolicyCache.attend`` read of a cache, with a plan of ``kind``."""
    plan = None if kind is None else ForwardPlan(kind, new_tokens, torch.tensor([start]),
                                                 torch.tensor([start + new_tokens]))
    return SimpleNamespace(plan=plan, prompt_open=kind is ForwardKind.PIECE, row_start_on=lambda device: None,
                           capacity=None, query_tails=None, _attend_piece=PolicyCache._attend_piece)


class ToyLayer(CacheLayer):
    """Keeps every token in a buffer plus a running sum of the keys (derived state); attends by
    returning, per query, the plan it saw (kind and step) so the test can read the dispatch."""

    def __init__(self, cache, rollback=None, verify_as_steps=False):
        super().__init__(cache, 0)
        # truncation names the token stores (derived state is rebuilt); a record names all it copies
        self.rollback = rollback
        self.rollback_state = ("buffer",) if rollback == "truncate" else ("buffer", "total")
        self.verify_as_steps = verify_as_steps
        self.buffer, self.total, self.seen_plans = KVBuffer(), torch.zeros(B, H, D), []

    def attend(self, q, k_new, v_new, scaling):
        plan = self.cache.plan
        self.seen_plans.append((plan.kind, plan.step, k_new.shape[2]))
        self.store_again(k_new, v_new)
        return q

    def store_again(self, k, v):
        self.buffer.append(k, v)
        self.total = self.total + k.sum(2)
        self.seen += k.shape[2]

    def after_truncate(self):
        self.total = self.buffer.keys.sum(2)


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


@pytest.mark.parametrize("declared", [False, True])
def test_a_verification_runs_as_decode_steps_only_when_declared(declared):
    cache = _cache(ForwardKind.VERIFY, new_tokens=3, start=5)
    layer = ToyLayer(cache, verify_as_steps=declared)
    k, v = _kv(3)
    q = torch.randn(B, 2 * H, 3, D)
    out = PolicyCache.attend(cache, layer, q, k, v, 1.0)
    torch.testing.assert_close(out, q)
    if declared:
        assert layer.seen_plans == [(ForwardKind.DECODE, t, 1) for t in range(3)]
    else:
        assert layer.seen_plans == [(ForwardKind.VERIFY, 0, 3)]
    assert cache.plan.kind is ForwardKind.VERIFY  # the forward's plan is back for the next layer
    steps = cache.plan.decode_steps()
    assert [int(s.start) for s in steps] == [5, 6, 7] and steps is cache.plan.decode_steps()


@pytest.mark.parametrize("rollback", ["truncate", "record"])
def test_crop_by_either_strategy_equals_never_storing_the_tokens(rollback):
    cache = _cache(ForwardKind.DECODE)
    layer, ref = ToyLayer(cache, rollback), ToyLayer(cache, rollback)
    k0, v0 = _kv(6, seed=1)
    k1, v1 = _kv(5, seed=2)
    for lay in (layer, ref):
        lay.store_again(k0, v0)
        lay.activate_past_recording()
    layer.record_forward(k1, v1)
    layer.store_again(k1, v1)
    assert layer.removable() == (11 if rollback == "truncate" else 5)
    layer.crop(-3)
    ref.store_again(k1[:, :, :2], v1[:, :, :2])
    assert layer.seen == ref.seen == 8
    torch.testing.assert_close(layer.buffer.keys, ref.buffer.keys)
    torch.testing.assert_close(layer.total, ref.total)
    if rollback == "record":  # only the latest forward, once
        assert layer.removable() == 0
        with pytest.raises(ValueError, match="at most 0 can be taken back"):
            layer.crop(-1)


class WindowToyLayer(ToyLayer):
    """Truncates only its latest ``whole`` tokens (older ones count as compressed), and counts the
    records a crop ended."""

    def __init__(self, cache, whole):
        super().__init__(cache, "truncate")
        self.whole, self.ended = whole, []

    def truncatable(self):
        return self.whole

    def end_record(self):
        self.ended.append(self.seen)


def test_a_truncating_layer_takes_back_only_what_it_declares_and_hears_every_crop():
    layer = WindowToyLayer(_cache(ForwardKind.DECODE), whole=3)
    layer.store_again(*_kv(8, seed=4))
    with pytest.raises(ValueError, match=r"at most 3 can be taken back now \(call activate_past_recording"):
        layer.crop(-4)
    assert layer.seen == 8 and layer.ended == []  # a refused crop changes nothing
    layer.crop(-2)
    layer.crop(0)
    assert layer.seen == layer.buffer.length == 6 and layer.ended == [6, 6]
    torch.testing.assert_close(layer.total, layer.buffer.keys.sum(2))  # after_truncate ran


class WholeTailLayer(ToyLayer):
    """Records its forwards, and keeps the tokens after its first ``prefix`` whole in ``tail`` (a
    buffer a crop may truncate past the record), as ShadowKV keeps its generated tokens."""

    rollback_truncate = ("tail",)

    def __init__(self, cache, prefix):
        super().__init__(cache, "record")
        self.rollback_state, self.prefix, self.tail = ("buffer", "total", "tail"), prefix, KVBuffer()

    def store_again(self, k, v):
        super().store_again(k, v)
        for t in range(k.shape[2]):
            if self.seen - k.shape[2] + t >= self.prefix:
                self.tail.append(k[:, :, t:t + 1], v[:, :, t:t + 1])

    def after_truncate(self):
        self.buffer.truncate(self.seen)
        self.total = self.buffer.keys.sum(2)


def test_a_recording_layer_truncates_past_the_record_what_it_keeps_whole():
    cache = _cache(ForwardKind.DECODE)
    layer, ref = WholeTailLayer(cache, prefix=4), WholeTailLayer(cache, prefix=4)
    k0, v0 = _kv(7, seed=4)
    k1, v1 = _kv(3, seed=5)
    for lay in (layer, ref):
        lay.store_again(k0, v0)
        lay.activate_past_recording()
    assert layer.removable() == 3  # no record: the tokens kept whole
    layer.record_forward(k1, v1)
    layer.store_again(k1, v1)
    assert layer.removable() == 3 + 3  # the recorded forward, then the whole tokens before it
    layer.crop(-5)
    ref.store_again(k0[:, :, :0], v0[:, :, :0])
    ref.crop(-2)
    assert layer.seen == ref.seen == 5 and layer.tail.length == ref.tail.length == 1
    torch.testing.assert_close(layer.buffer.keys, k0[:, :, :5])
    torch.testing.assert_close(layer.total, k0[:, :, :5].sum(2))
    torch.testing.assert_close(layer.tail.keys, ref.tail.keys)
    with pytest.raises(ValueError, match="at most 1 can be taken back"):
        layer.crop(-2)


def test_an_undeclared_or_unknown_rollback_is_refused():
    cache = _cache()
    with pytest.raises(ValueError, match="cannot take tokens back"):
        ToyLayer(cache).crop(-1)
    with pytest.raises(ValueError, match="allowed: None, 'truncate', 'record'"):
        ToyLayer(cache, rollback="undo").removable()


class StagingLayer(ToyLayer):
    stages_prompt = True
    prompt_queries = 2

    def take_prompt(self, stage):
        self.taken = (stage.buffer.keys.clone(), stage.window_queries(2).clone())


def test_prompt_pieces_are_staged_by_the_core_and_attended_causally():
    cache = _cache(ForwardKind.PIECE, new_tokens=3)
    layer = StagingLayer(cache)
    k, v = _kv(5, seed=3)
    q = torch.randn(B, H, 5, D)
    out_a = PolicyCache.attend(cache, layer, q[:, :, :3], k[:, :, :3], v[:, :, :3], 1.0)
    out_b = PolicyCache.attend(cache, layer, q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], 1.0)
    assert layer.seen_plans == [] and layer.seen == 5 and layer.prompt_stage.length == 5
    whole = torch.softmax((q @ k.transpose(-1, -2)).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf")), -1) @ v
    torch.testing.assert_close(torch.cat([out_a, out_b], dim=2), whole)
    stage, layer.prompt_stage = layer.prompt_stage, None  # what PolicyCache.end_prompt does
    layer.take_prompt(stage)
    torch.testing.assert_close(layer.taken[0], k)
    torch.testing.assert_close(layer.taken[1], q[:, :, 3:])
