"""The compiled CPU kernels (`kvpress.kernels.native`) against the torch references."""
import subprocess
import sys
from functools import partial

import pytest
import torch

from kvpress.kernels import (SparseIndex, exact_scores, label_scores, merge_states, native, reference_sparse_decode,
                             reference_tail_estimate, sparse_decode, sparse_decode_tail)
from kvpress.policies._sparse import range_index

from kvpress_kernel_cases import build, case
from test_tail import chunk_sums

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here (no C compiler?)")


def token_index(B, H, T, keep, sinks, window, seed=0, starts=None):
    """A clean token index: ``keep`` random tokens per (row, KV head) between the sinks and the window
    (with ``starts``, rows are left-padded and every row's candidates lie inside each row's range)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (0 if starts is None else max(starts)) + sinks, T - window
    ids = torch.stack([torch.randperm(hi - lo, generator=gen)[:keep] for _ in range(B * H)]).view(B, H, keep)
    if starts is None:
        return range_index(ids, lo, T, hi - lo, block_size=1, sinks=sinks, dense_tail=window)
    return SparseIndex(1, (ids + lo).sort(-1).values.to(torch.int32), torch.full((B, H), keep, dtype=torch.int32),
                       torch.full((B,), T, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), sinks, window)


CLEAN = [  # (B, H_kv, G, D, T_cap, index builder) -- every one a clean index
    (2, 3, 3, 64, 300, lambda: token_index(2, 3, 290, 40, 4, 8)),
    (1, 2, 1, 16, 64, lambda: token_index(1, 2, 64, 10, 0, 1, seed=1)),
    (2, 2, 4, 24, 120, lambda: token_index(2, 2, 120, 12, 3, 5, seed=2, starts=[0, 9])),  # left padding
    (1, 2, 8, 64, 96, lambda: SparseIndex(16, torch.tensor([[[1, 3], [2, 4]]], dtype=torch.int32),
                                           torch.full((1, 2), 2, dtype=torch.int32), torch.tensor([96], dtype=torch.int32),
                                           None, 2, 16)),  # pages of 16 tokens
    (1, 2, 16, 32, 80, lambda: token_index(1, 2, 80, 10, 2, 4, seed=3)),  # a GQA group of 16 (Qwen3-235B's)
]


def _in_buffer(x, dim, spare=3):
    """``x`` as a view of a larger buffer (spare entries along ``dim`` hold junk)."""
    shape = list(x.shape)
    shape[dim] += spare
    buf = torch.full(shape, 7.0)
    buf.narrow(dim, 0, x.shape[dim]).copy_(x)
    return buf.narrow(dim, 0, x.shape[dim])


def _qkv(B, H, G, D, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H * G, D, generator=gen), torch.randn(B, H, T, D, generator=gen),
            torch.randn(B, H, T, D, generator=gen))


@pytest.mark.parametrize("spec", CLEAN, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}")
def test_native_decode_equals_reference(spec):
    B, H, G, D, T, make = spec
    q, k, v = _qkv(B, H, G, D, T)
    index = make()
    out, lse = sparse_decode(q, k, v, index, scale=0.2, backend="native")
    ref_out, ref_lse = reference_sparse_decode(q, k, v, index, scale=0.2)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", CLEAN, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}")
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_native_decode_with_tail_equals_the_references_merged(spec, chunk):
    B, H, G, D, T, make = spec
    q, k, v = _qkv(B, H, G, D, T, seed=1)
    index = make()
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, chunk)
    n = ks.shape[2]  # the sums as a layer holds them: views into buffers with spare chunks
    out, lse = sparse_decode_tail(q, k, v, index, _in_buffer(ks, 2), _in_buffer(vs, 2), _in_buffer(cnt, 1),
                                  chunk_size=chunk, scale=0.2, backend="native")
    e_out, e_lse = reference_sparse_decode(q, k, v, index, scale=0.2)
    t_out, t_lse = reference_tail_estimate(q, k, v, index, chunk_size=chunk, scale=0.2)
    ref_out, ref_lse = merge_states(e_out, e_lse, t_out, t_lse)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    if chunk == 1:  # exact estimate: the merged step is dense attention
        dense = SparseIndex.dense(index.seq_lens, H, block_size=1, seq_starts=index.seq_starts)
        d_out, d_lse = reference_sparse_decode(q, k, v, dense, scale=0.2)
        torch.testing.assert_close(out, d_out, atol=1e-4, rtol=1e-4)


def test_native_decode_of_nothing_is_zero_with_minus_inf_lse():
    q, k, v = _qkv(1, 2, 2, 16, 8)
    index = SparseIndex(1, torch.zeros(1, 2, 0, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                        torch.tensor([8], dtype=torch.int32), None, 0, 0)
    out, lse = sparse_decode(q, k, v, index, backend="native")
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())


def test_auto_runs_native_on_clean_cpu_fp32_and_torch_otherwise(monkeypatch):
    q, k, v = _qkv(2, 3, 3, 64, 300)
    index = CLEAN[0][5]()
    calls = []
    real = native.sparse_decode
    monkeypatch.setattr(native, "sparse_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    sparse_decode(q, k, v, index)
    assert calls == [1]
    # padded selection (not clean), or half precision: torch, same results as the reference
    padded = build(case(B=2, H_kv=2, G=2, T_cap=67, block_size=8, mode="random", budget=3, sinks=1, tail=5,
                        lens=[67, 50], starts=[0, 6]))
    out, _ = sparse_decode(*padded, scale=0.2)
    torch.testing.assert_close(out, reference_sparse_decode(*padded, scale=0.2)[0], atol=1e-5, rtol=1e-5)
    sparse_decode(q.half(), k.half(), v.half(), index)
    assert calls == [1]


def test_native_refuses_what_it_cannot_run_with_the_reason():
    padded = build(case(B=2, H_kv=2, G=2, T_cap=67, block_size=8, mode="random", budget=3, sinks=1, tail=5,
                        lens=[67, 50], starts=[0, 6]))
    with pytest.raises(ValueError, match="backend='native' cannot run these inputs: it needs a clean index"):
        sparse_decode(*padded, backend="native")
    q, k, v = _qkv(2, 3, 3, 64, 300)
    with pytest.raises(ValueError, match="it needs fp32 CPU tensors"):
        sparse_decode(q.half(), k.half(), v.half(), CLEAN[0][5](), backend="native")


def _labels(k, channels):
    B, H, T, D = k.shape
    r = channels.shape[1]
    return k.gather(-1, channels[None, :, None, :].expand(B, H, T, r)).transpose(-1, -2).contiguous()  # (B, H, r, T)


def reference_label_select(q, channels, labels, k, lo, hi, keep, shortlist, scale, reduction):
    """The selection spelled out with the public torch score functions."""
    s = label_scores(q, labels.transpose(-1, -2)[:, :, lo:hi], channels, scale=scale, reduction=reduction)
    cand = s.topk(shortlist, dim=-1).indices  # (B, H, m), relative to lo
    if shortlist > keep:
        D = k.shape[-1]
        keys = torch.gather(k[:, :, lo:hi], 2, cand[..., None].expand(-1, -1, -1, D))
        ex = exact_scores(q, keys, scale=scale, reduction=reduction)  # (B, H, m): softmax over the shortlist
        cand = torch.gather(cand, 2, ex.topk(keep, dim=-1).indices)
    return (cand + lo).sort(-1).values


@pytest.mark.parametrize("reduction", ["max", "mean", "softmax_max", "softmax_mean"])
@pytest.mark.parametrize("shape", [(2, 3, 3, 64, 8), (1, 2, 4, 20, 5), (1, 1, 1, 16, 4)])
@pytest.mark.parametrize("rerank", [1, 3, None])
def test_label_select_equals_reference(reduction, shape, rerank):
    B, H, G, D, r = shape
    T, lo, hi, keep = 700, 4, 680, 30  # 676 candidates: more than one 256-token tile, a partial last one
    q, k, _ = _qkv(B, H, G, D, T + 5, seed=4)
    gen = torch.Generator().manual_seed(5)
    channels = torch.stack([torch.randperm(D, generator=gen)[:r] for _ in range(H)])
    labels = _labels(k, channels)
    m = hi - lo if rerank is None else keep * rerank  # None: every candidate shortlisted (exact top-k)
    got = native.label_select(q, channels, labels, k, lo=lo, hi=hi, keep=keep, shortlist=m, scale=0.3,
                              reduction=reduction)
    want = reference_label_select(q, channels, labels, k, lo, hi, keep, m, 0.3, reduction)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)


def test_label_select_ties_take_the_earlier_tokens():
    q = torch.ones(1, 1, 4)
    labels = torch.zeros(1, 1, 2, 50)  # every token scores 0
    got = native.label_select(q, torch.tensor([[0, 1]]), labels, None, lo=5, hi=50, keep=6, shortlist=6, scale=1.0,
                              reduction="max")
    assert got.tolist() == [[[5, 6, 7, 8, 9, 10]]]


@pytest.mark.parametrize("kw, match", [
    (dict(keep=0), "0 < keep <= shortlist"), (dict(shortlist=10_000), "0 < keep <= shortlist"),
    (dict(hi=10_000), r"\[lo, hi\) inside the labels"), (dict(reduction="median"), "reduction must be one of"),
])
def test_label_select_bad_input_is_a_clear_error(kw, match):
    q, k, _ = _qkv(1, 2, 2, 16, 100)
    channels = torch.tensor([[0, 1], [2, 3]])
    args = {**dict(lo=2, hi=90, keep=8, shortlist=16, scale=1.0, reduction="max"), **kw}
    with pytest.raises(ValueError, match=match):
        native.label_select(q, channels, _labels(k, channels), k, **args)


def test_disabled_by_environment_falls_back_to_torch(tmp_path):
    code = ("import torch; from kvpress.kernels import native, sparse_decode, SparseIndex\n"
            "assert not native.available()\n"
            "q = torch.randn(1, 2, 8); k = torch.randn(1, 2, 10, 8)\n"
            "i = SparseIndex(1, torch.zeros(1, 2, 0, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),"
            " torch.tensor([10], dtype=torch.int32), None, 2, 2)\n"
            "sparse_decode(q, k, k, i)\n"
            "try:\n    sparse_decode(q, k, k, i, backend='native')\nexcept ValueError as e:\n    print(e)\n")
    env = {**__import__("os").environ, "KVPRESS_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "disabled by KVPRESS_NATIVE=0" in done.stdout


def test_selection_and_decode_are_the_same_on_any_thread_count(torch_threads):
    """(row, KV head) pairs split over threads: label selection and decode with the tail estimate
    give bitwise the same results on one and on two threads."""
    B, H, G, D, T, r = 2, 3, 3, 64, 1200, 8
    q, k, v = _qkv(B, H, G, D, T, seed=9)
    channels = torch.stack([torch.randperm(D, generator=torch.Generator().manual_seed(h))[:r] for h in range(H)])
    labels = _labels(k, channels)
    index = token_index(B, H, T, 96, 4, 16, seed=3)
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, 32)
    runs = []
    for n in (1, 2):
        torch_threads(n)
        ids = native.label_select(q, channels, labels, k, lo=4, hi=T - 16, keep=64, shortlist=512, scale=0.2,
                                  reduction="softmax_max")
        runs.append((ids, *sparse_decode_tail(q, k, v, index, ks, vs, cnt, chunk_size=32, scale=0.2, backend="native")))
    for one, two in zip(*runs):
        assert torch.equal(one, two)
    want = reference_label_select(q, channels, labels, k, 4, T - 16, 64, 512, 0.2, "softmax_max")
    assert torch.equal(runs[0][0].long(), want)


@pytest.mark.parametrize("bits,D,group", [(2, 64, 32), (4, 128, 32), (8, 64, 8), (2, 80, 16), (4, 96, 32)])
def test_add_residual_equals_the_torch_reference(bits, D, group):
    """ShadowKV's key correction: compiled = torch (same products and sums), an empty slot's zero
    row adds nothing, and the corrected keys are within one quantization step of the exact ones."""
    from kvpress.policies._shadowkv_store import add_residual, residual_table

    g = torch.Generator().manual_seed(bits * D + group)
    rebuilt = torch.randn(2, 3, 37, D, generator=g)
    exact = rebuilt + 0.2 * torch.randn(2, 3, 37, D, generator=g)
    table = residual_table(exact, rebuilt, bits, group)
    table[1, 2, 5] = 0  # an empty slot's row
    ref = add_residual(rebuilt, table, bits, group, backend="torch")
    out = native.add_residual(rebuilt, table, bits, group)
    assert out.dtype == torch.float32 and out.shape == rebuilt.shape
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1, 2, 5], rebuilt[1, 2, 5])
    step = (exact - rebuilt).abs().amax() * 2 / (2**bits - 1)  # a group's range is at most twice the max
    mask = torch.ones(2, 3, 37, dtype=torch.bool)
    mask[1, 2, 5] = False
    assert ((out - exact).abs()[mask] <= step / 2 + 1e-3).all()
    # the dispatcher takes the compiled pass for fp32 CPU tensors
    assert torch.equal(add_residual(rebuilt, table, bits, group), out)


def test_add_residual_bad_input_is_a_clear_error():
    keys, table = torch.randn(1, 1, 4, 64), torch.zeros(1, 1, 4, 24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fp32 CPU keys"):
        native.add_residual(keys.half(), table, 2, 32)
    with pytest.raises(ValueError, match="row width 20"):
        native.add_residual(keys, table[..., :20], 2, 32)
    with pytest.raises(ValueError, match="bits=3"):
        native.add_residual(keys, table, 3, 32)


@pytest.mark.parametrize("B,H,G,C,D,cs,tail,K,empty", [(1, 3, 3, 96, 64, 8, 64, 40, False),
                                                      (2, 2, 4, 37, 32, 4, 16, 30, False),
                                                      (2, 2, 4, 37, 32, 4, 16, 0, True),
                                                      (1, 1, 8, 5, 128, 2, 8, 12, False)])
def test_shadowkv_tail_equals_tail_estimate_tokens(B, H, G, C, D, cs, tail, K, empty):
    """ShadowKV's tail estimate for single attended tokens: compiled = torch, with groups not
    aligned to the start (offset), chunks not selectable, a chunk all of whose tokens are
    attended, empty slots, and no attended tokens at all."""
    from kvpress.policies._shadowkv_select import tail_estimate

    tail_estimate_tokens = partial(tail_estimate, tokens=True)

    g = torch.Generator().manual_seed(C * D + K)
    m = tail // cs
    N = -(-C // m)
    q, lm = torch.randn(B, H * G, D, generator=g), torch.randn(B, H, C, D, generator=g)
    sel = torch.rand(B, H, C, generator=g) > 0.2
    v_sum = 3 * torch.randn(B, H, N, D, generator=g)
    ids = vals = None
    if not empty:
        ids = torch.randint(0, C * cs, (B, H, K), generator=g).int()
        ids[..., ::5] = -1
        ids[0, 0, :cs] = torch.arange(cs, dtype=torch.int32) + cs  # chunk 1 entirely attended
        vals = torch.randn(B, H, K, D, generator=g)
    kw = dict(chunk_size=cs, tail_chunk=tail, scale=D ** -0.5)
    ref_out, ref_lse = tail_estimate_tokens(q, lm, sel, v_sum, ids, vals, **kw)
    out, lse = native.shadowkv_tail(q, lm, sel, v_sum, ids, vals, **kw)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    nothing = torch.zeros(B, H, C, dtype=torch.bool)  # no chunk left: zeros and -inf, as the reference
    out0, lse0 = native.shadowkv_tail(q, lm, nothing, v_sum, ids, vals, **kw)
    assert torch.equal(out0, torch.zeros_like(out0)) and bool(torch.isneginf(lse0).all())
    assert bool(torch.isneginf(tail_estimate_tokens(q, lm, nothing, v_sum, ids, vals, **kw)[1]).all())
    with pytest.raises(ValueError, match="shadowkv_tail needs fp32 CPU"):
        native.shadowkv_tail(q.double(), lm, sel, v_sum, ids, vals, **kw)


def test_merge_states_equals_the_torch_reference():
    """Compiled `merge_states` = `torch_merge_states`: finite parts, one part empty (its output
    NaN garbage, ignored), both empty (zeros, -inf), parts far apart in scale; bad input refused."""
    from kvpress.kernels.merge import torch_merge_states

    g = torch.Generator().manual_seed(5)
    oa, ob = torch.randn(2, 9, 64, generator=g), torch.randn(2, 9, 64, generator=g)
    la, lb = 4 * torch.randn(2, 9, generator=g), 4 * torch.randn(2, 9, generator=g)
    la[0, 0], oa[0, 0] = float("-inf"), float("nan")  # a empty
    lb[0, 1], ob[0, 1] = float("-inf"), float("nan")  # b empty
    la[1, 2] = lb[1, 2] = float("-inf")  # both empty
    la[1, 3], lb[1, 3] = 80.0, -80.0  # b negligible
    out, lse = native.merge_states(oa, la, ob, lb)
    ref_out, ref_lse = torch_merge_states(oa, la, ob, lb)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[1, 2], torch.zeros(64)) and lse[1, 2] == float("-inf")
    with pytest.raises(ValueError, match="merge_states needs fp32 CPU"):
        native.merge_states(oa.double(), la, ob, lb)
    with pytest.raises(ValueError, match="matching shapes"):
        native.merge_states(oa, la[:, :4], ob, lb)
