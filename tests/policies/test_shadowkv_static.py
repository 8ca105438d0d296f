"""ShadowKV's static decode step (`StaticStore`) against the eager step, without compiling: the
plan's ``static`` flag is forced on (it is otherwise set only while dynamo traces), so the static
path runs as plain torch and every option is checked in seconds; tests/test_static_decode.py
compiles the example configuration. Also the host-tier ops and their Triton kernels' indexing."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpress
from kvpress.stats import tensor_bytes
from kvpress.kernels.triton_shadowkv_host import host_gather, host_scatter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import random_ids  # noqa: E402
from shadowkv_helpers import model  # noqa: E402,F401  (model: the fixture)

BASE = dict(budget=32, chunk_size=8, rank=8, outlier_chunks=1, local_window=8)


def _run(model, policy, prompt, steps, static, turn=None, turn_after=0, batch_pad=0, planned=None):
    """Greedy tokens of ``steps`` decode steps (``static``: the static path, run eagerly), with an
    optional ``turn`` of several tokens after ``turn_after`` steps; and each layer's state after."""
    ids = prompt
    mask = None
    if batch_pad:  # a second row, left-padded
        short = torch.cat([torch.zeros(1, batch_pad, dtype=torch.long), prompt[:, batch_pad:]], 1)
        ids = torch.cat([prompt, short])
        mask = (torch.arange(ids.shape[1])[None, :] >= torch.tensor([[0], [batch_pad]])).long()
    tokens = []
    with torch.no_grad(), kvpress.apply(model, policy):
        cache = kvpress.make_cache(model, policy)
        cache.plan_capacity(planned or ids.shape[1] + steps + (0 if turn is None else turn.shape[1]) + 1)
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        pos = ids.shape[1]
        for i in range(steps):
            if turn is not None and i == turn_after:
                t = turn.expand(ids.shape[0], -1)
                out = model(t, past_key_values=cache, use_cache=True,
                            position_ids=torch.arange(pos, pos + t.shape[1])[None].expand(ids.shape[0], -1))
                pos += t.shape[1]
                tok = out.logits[:, -1:].argmax(-1)
            positions = torch.full((ids.shape[0], 1), pos)
            if mask is not None:
                positions = positions - torch.tensor([[0], [batch_pad]])
            with _static_plans(static):
                out = model(tok, past_key_values=cache, use_cache=True, position_ids=positions)
            pos += 1
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(tok.view(-1).tolist())
        state = []
        for layer in cache.layers:
            if hasattr(layer, "_leave_static"):
                layer._leave_static()
                state.append((layer.gen_len, layer.n_chunks, layer.exact_cnt.tolist(),
                              layer.max_selectable, layer.row_exact.tolist()))
    return tokens, state


class _static_plans:
    """Plans made inside are static, as while dynamo traces a decode step."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.saved = torch.compiler.is_compiling
        if self.on:
            torch.compiler.is_compiling = lambda: True

    def __exit__(self, *exc):
        torch.compiler.is_compiling = self.saved


@pytest.mark.parametrize("options", [
    dict(tail_chunk=16, fold_size=16),
    dict(rerank=1, fold_size=8),
    dict(select="tokens", tail_chunk=16, fold_size=16),
    dict(fetch_keys=True, fold_size=16),
    dict(residual_bits=2, fold_size=16),
    dict(fold_size=0),
    dict(svd="query", fold_size=16),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_static_step_equals_eager(model, options):
    policy = kvpress.get_policy("shadowkv", **BASE, **options)
    prompt = random_ids(44, seed=3)
    eager, eager_state = _run(model, policy, prompt, 70, static=False)
    static, static_state = _run(model, policy, prompt, 70, static=True)
    assert static == eager
    assert static_state == eager_state


def test_static_step_equals_eager_on_a_left_padded_batch_whose_short_row_starts_exact(model):
    """The short row's prompt fits the budget: its first folds stay exact, then it factors its own
    basis (an SVD inside the step) while the long row adds chunks."""
    policy = kvpress.get_policy("shadowkv", **BASE, tail_chunk=16, fold_size=16)
    prompt = random_ids(44, seed=4)
    eager, eager_state = _run(model, policy, prompt, 60, static=False, batch_pad=20)
    static, static_state = _run(model, policy, prompt, 60, static=True, batch_pad=20)
    assert static == eager
    assert static_state == eager_state
    assert eager_state[0][4] == [False, False]  # both rows ended with chunks


def test_static_steps_after_a_turn_fold_its_backlog_as_eager_steps_do(model):
    """A turn leaves more than local_window + fold_size generated tokens: the first static step
    folds several units at once, as the eager step does."""
    policy = kvpress.get_policy("shadowkv", **BASE, tail_chunk=16, fold_size=16)
    prompt, turn = random_ids(44, seed=5), random_ids(40, seed=6)
    eager, eager_state = _run(model, policy, prompt, 40, static=False, turn=turn, turn_after=10)
    static, static_state = _run(model, policy, prompt, 40, static=True, turn=turn, turn_after=10)
    assert static == eager
    assert static_state == eager_state


@pytest.mark.parametrize("fold_size", [16, 0])
def test_static_steps_past_the_planned_capacity_grow_the_store(model, fold_size):
    policy = kvpress.get_policy("shadowkv", **BASE, tail_chunk=16, fold_size=fold_size)
    prompt = random_ids(100, seed=7)
    eager, eager_state = _run(model, policy, prompt, 60, static=False, planned=120)
    static, static_state = _run(model, policy, prompt, 60, static=True, planned=120)
    assert static == eager
    assert static_state == eager_state


def _held_bytes(layer):
    """Bytes of every tensor the layer holds: its attributes, its generated tokens' buffer and its
    static store (not the host-side integer budget tables nor the RoPE table)."""
    holders = [layer, layer.gen] + ([layer._static] if layer._static is not None else [])
    return tensor_bytes([t for h in holders for name, t in vars(h).items() if isinstance(t, torch.Tensor)
                         and name not in ("_exact_cnt_cpu", "_sel_cnt_cpu", "_inv_freq", "inv_freq")])


def _counted_bytes(layer):
    return tensor_bytes([*layer.state_tensors().values(), *layer.host_tensors().values()])


def test_state_moves_to_the_static_store_only_when_the_static_path_may_run(model):
    """After the prompt the state moves into a `StaticStore` only on a cache planned for static
    steps; an eager step takes it back, and without a plan the first static step builds it. In
    every case the layer reports the bytes of exactly the tensors it holds."""
    policy = kvpress.get_policy("shadowkv", **BASE)
    tok = torch.tensor([[5]])
    with torch.no_grad(), kvpress.apply(model, policy):
        plain = kvpress.make_cache(model, policy)
        model(random_ids(44), past_key_values=plain, use_cache=True)
        assert all(layer._static is None for layer in plain.layers)
        planned = kvpress.make_cache(model, policy)
        planned.plan_capacity(100)
        model(random_ids(44), past_key_values=planned, use_cache=True)
        layer = planned.layers[0]
        assert layer._static is not None and layer.landmarks is None and layer.gen_k is None
        assert layer.state_tensors()["landmarks"].shape[2] * 8 >= 100  # room for the capacity's tokens
        assert layer.cached_elements() == 2 * 2 * 44 * 16 and layer.stored_tokens() == 44
        assert all(_counted_bytes(layer) == _held_bytes(layer) for cache in (plain, planned) for layer in cache.layers)
        model(tok, past_key_values=planned, use_cache=True)  # an eager step: the state is given back
        assert layer._static is None and layer.landmarks is not None and layer.gen_len == 1
        assert all(_counted_bytes(layer) == _held_bytes(layer) for layer in planned.layers)
        with _static_plans(True):
            model(tok, past_key_values=plain, use_cache=True)  # unplanned: built at the first static step
        assert all(layer._static is not None for layer in plain.layers)
        assert all(_counted_bytes(layer) == _held_bytes(layer) for layer in plain.layers)
        assert layer.removable() == 1 and layer._static is None  # given back for the core's rollback


def test_host_ops_gather_and_scatter_rows():
    table = torch.arange(40.0).view(10, 4)
    rows = torch.tensor([3, 0, 9])
    assert torch.equal(host_gather(table, rows), table[[3, 0, 9]])
    host_scatter(table, torch.tensor([1, 2]), torch.ones(2, 4), torch.tensor([False]))
    assert table[1, 0] == 4  # disabled: unchanged
    host_scatter(table, torch.tensor([1, 2]), torch.ones(2, 4), torch.tensor([True]))
    assert torch.equal(table[1:3], torch.ones(2, 4))
    with pytest.raises(ValueError, match="rows must be a 1-D int32/int64 tensor"):
        host_gather(table, rows.float())


_INTERPRETED = r"""
import torch
from kvpress.kernels.triton_shadowkv_host import triton_host_gather, triton_host_scatter
torch.manual_seed(0)
for n, w in ((1, 1), (13, 67), (67, 300), (1000, 13)):
    table = torch.randn(n, w)
    rows = torch.randint(0, n, (2 * n + 1,))
    assert torch.equal(triton_host_gather(table, rows), table[rows]), (n, w)
    ids = torch.randperm(n)[: max(1, n // 2)]
    vals = torch.randn(ids.numel(), w)
    before = table.clone()
    triton_host_scatter(table, ids, vals, torch.tensor([False]))
    assert torch.equal(table, before)
    triton_host_scatter(table, ids, vals, torch.tensor([True]))
    before[ids] = vals
    assert torch.equal(table, before), (n, w)
print("ok")
"""


def test_triton_host_kernels_index_like_torch_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
