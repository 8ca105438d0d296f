"""The compiled CPU kernels as torch ops (``kvpress::native_*``): each op passes `torch.library.opcheck`
(schema, fake implementation, dispatch), and `torch.compile(fullgraph=True)` of a function calling a
public entry point on fp32 CPU tensors gives one graph holding the op and eager's result."""
import pytest
import torch

from kvpress.kernels import (attend_rows, merge_states, native, quantize_per_token,
                             sparse_decode, sparse_decode_tail)
from kvpress.kernels.quant import channel_quant_scores, token_quant_values

from kvpress_kernel_cases import build, case
from test_native import CLEAN, _qkv
from test_native_quant import _gear_terms, _store
from test_native_shadowkv import inputs as shadowkv_inputs
from test_tail import chunk_sums

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here (no C compiler?)")

OPS = torch.ops.kvpress


def compiled_once(fn, *args, op: str):
    """``fn(*args)`` compiled with fullgraph=True and a backend that counts graphs: one graph that
    calls ``kvpress::<op>``, and its result (checked equal to eager's by the caller)."""
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(fn, fullgraph=True, backend=count)(*args)
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert f"kvpress.{op}" in targets, targets
    return got


def assert_same(got, want):
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


# ----------------------------------------------------------------------------- public entry points
@pytest.mark.parametrize("which", [0, 2, 3])  # token index, left padding, pages of 16 tokens
def test_sparse_decode_compiles_to_the_native_op(which):
    B, H, G, D, T, make = CLEAN[which]
    q, k, v = _qkv(B, H, G, D, T)
    index = make()

    def step(q, k, v):
        return sparse_decode(q, k, v, index, scale=0.2)

    assert_same(compiled_once(step, q, k, v, op="native_sparse_decode"), step(q, k, v))


def test_sparse_decode_of_an_index_that_is_not_clean_runs_torch_inside_the_op():
    q, k, v, index = build(case(B=2, H_kv=2, G=2, T_cap=67, block_size=8, mode="random", budget=3, sinks=1, tail=5,
                                lens=[67, 50], starts=[0, 6]))

    def step(q, k, v):
        return sparse_decode(q, k, v, index, scale=0.2)

    got = compiled_once(step, q, k, v, op="native_sparse_decode")
    want = step(q, k, v)  # eager: the torch path directly
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)


def test_sparse_decode_tail_compiles_to_the_native_op():
    B, H, G, D, T, make = CLEAN[2]
    q, k, v = _qkv(B, H, G, D, T, seed=1)
    index = make()
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, 7)

    def step(q, k, v, ks, vs, cnt):
        return sparse_decode_tail(q, k, v, index, ks, vs, cnt, chunk_size=7, scale=0.2)

    args = (q, k, v, ks, vs, cnt)
    assert_same(compiled_once(step, *args, op="native_sparse_decode"), step(*args))


def test_attend_rows_and_merge_states_compile_to_native_ops():
    gen = torch.Generator().manual_seed(0)
    B, H, G, D = 2, 2, 3, 16
    q = torch.randn(B, H * G, D, generator=gen)
    k1, v1 = torch.randn(B, H, 9, D, generator=gen), torch.randn(B, H, 9, D, generator=gen)
    k2, v2 = torch.randn(B, H, 5, D, generator=gen), torch.randn(B, H, 5, D, generator=gen)
    cnt = torch.tensor([[9, 4], [0, 7]], dtype=torch.int32)

    def rows(q, k1, v1, k2, v2, cnt):
        return attend_rows(q, [(k1, v1, cnt, 9), (k2, v2, None, 5)], scale=0.3)

    args = (q, k1, v1, k2, v2, cnt)
    out, lse = compiled_once(rows, *args, op="native_attend_rows")
    assert_same((out, lse), rows(*args))

    def merge(oa, la, ob, lb):
        return merge_states(oa, la, ob, lb, backend="native")

    la = lse.clone()
    la[0, 0] = float("-inf")  # an empty part
    args = (out, la, torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen))
    assert_same(compiled_once(merge, *args, op="native_merge_states"), merge(*args))


@pytest.mark.parametrize("M", [1, 3])
def test_packed_reads_compile_to_native_ops(M):
    (kc, ks, kz), (vc, vs, vz) = _store(4, 64, 32, 16)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(kc.shape[0], kc.shape[1], M, 64, generator=gen)
    p = torch.softmax(torch.randn(kc.shape[0], kc.shape[1], M, kc.shape[2], generator=gen), -1)

    def scores(q, kc, ks, kz):
        return channel_quant_scores(q, kc, ks, kz, 4, 32)

    def values(p, vc, vs, vz):
        return token_quant_values(p, vc, vs, vz, 4, 16)

    assert_same(compiled_once(scores, q, kc, ks, kz, op="native_channel_scores"), scores(q, kc, ks, kz))
    assert_same(compiled_once(values, p, vc, vs, vz, op="native_token_values"), values(p, vc, vs, vz))


def test_quant_attend_with_gear_parts_compiles_to_the_native_op():
    B, H, M, N, D, G, W = 2, 3, 3, 96, 16, 8, 5
    (kc, ks, kz), (vc, vs, vz) = _store(2, D, G, G, B=B, H=H, T=N, seed=3)
    low, _, k_out, _, v_out, _ = _gear_terms(B, H, N, D, G, 1, 1, chunks=[32, 40])
    gen = torch.Generator().manual_seed(6)
    sk, sv = torch.randn(B, H, 2, D, generator=gen).half(), torch.randn(B, H, 2, D, generator=gen).half()
    starts = torch.tensor([0, 19])
    parts = native.GearParts(low[2], k_low=low[:2], v_low=low[:2], k_out=k_out, v_out=v_out, sinks=(sk, sv),
                             sink_start=starts)
    q = torch.randn(B, H, M, D, generator=gen) * 0.3
    kw, vw = torch.randn(B, H, W, D, generator=gen), torch.randn(B, H, W, D, generator=gen)

    def step(q, kw, vw):
        seg = native.PackedSegment((kc, ks, kz), (vc, vs, vz), 2, G, G, starts=starts, gear=parts)
        return native.quant_attend(q, k_win=kw, v_win=vw, segments=[seg])

    assert_same(compiled_once(step, q, kw, vw, op="native_quant_attend"), step(q, kw, vw))

    def key_extra(s, q):
        return native.gear_key_extra(s.clone(), q, G, parts)

    s = torch.randn(B, H, M, N, generator=gen)
    assert_same(compiled_once(key_extra, s, q, op="native_gear_key_extra"), key_extra(s, q))

    def value_extra(o, p):
        return native.gear_value_extra(o.clone(), p, G, parts)

    o, p = torch.randn(B, H, M, D, generator=gen), torch.softmax(torch.randn(B, H, M, N, generator=gen), -1)
    assert_same(compiled_once(value_extra, o, p, op="native_gear_value_extra"), value_extra(o, p))


def test_selection_kernels_compile_to_native_ops():
    gen = torch.Generator().manual_seed(2)
    B, H, G, D, T, r = 2, 2, 3, 32, 80, 4
    q, k = torch.randn(B, H * G, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    channels = torch.stack([torch.randperm(D, generator=gen)[:r] for _ in range(H)])
    labels = k.gather(3, channels[None, :, None, :].expand(B, H, T, r)).transpose(-1, -2).contiguous()

    def select(q, labels, k):
        return native.label_select(q, channels, labels, k, lo=4, hi=T - 8, keep=10, shortlist=20, scale=0.3,
                                   reduction="max")

    assert_same(compiled_once(select, q, labels, k, op="native_label_select"), select(q, labels, k))
    q, lm, sel, factor, basis, inv_freq, rs = shadowkv_inputs()
    allow = torch.tensor([[5, 3], [0, 5]], dtype=torch.int32)

    def shadow(q, lm, sel, factor, basis):
        return native.shadowkv_select(q, lm, sel, factor, basis, inv_freq, rs, allow, k=5, shortlist=12,
                                      chunk_size=8, scale=0.3, reduction="max")

    args = (q, lm, sel, factor, basis)
    assert_same(compiled_once(shadow, *args, op="native_shadowkv_select"), shadow(*args))

    def tail(q, lm, v_sum):
        return native.shadowkv_tail(q, lm, sel, v_sum, None, None, chunk_size=8, tail_chunk=16, scale=0.3)

    v_sum = torch.randn(lm.shape[0], lm.shape[1], 12, lm.shape[3], generator=gen)
    assert_same(compiled_once(tail, q, lm, v_sum, op="native_shadowkv_tail"), tail(q, lm, v_sum))
    keys, rebuilt = torch.randn(1, 2, 6, 32, generator=gen), torch.randn(1, 2, 6, 32, generator=gen)
    c, s, z = quantize_per_token(keys - rebuilt, 4, 16)
    table = torch.cat([c, s.view(torch.uint8), z.view(torch.uint8)], dim=-1)

    def residual(rebuilt, table):
        return native.add_residual(rebuilt, table, 4, 16)

    got = compiled_once(residual, rebuilt, table, op="native_add_residual")
    assert_same(got, residual(rebuilt, table))
    from kvpress.policies._shadowkv_store import add_residual as torch_add_residual

    torch.testing.assert_close(got, torch_add_residual(rebuilt, table, 4, 16, backend="torch"), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- opcheck of every op
def _op_samples():
    gen = torch.Generator().manual_seed(4)
    B, H, G, D, T, make = CLEAN[2]
    q, k, v = _qkv(B, H, G, D, T)
    i = make()
    ks, vs, cnt = chunk_sums(k, v, i.seq_lens, i.seq_starts, 7)
    idx = (i.block_idx, i.block_cnt, i.seq_lens, i.seq_starts, i.block_size, i.sinks, i.dense_tail, None)
    (kc, kss, kz), (vc, vss, vz) = _store(4, 64, 32, 16, B=1, H=2, T=64)
    q4 = torch.randn(1, 2, 3, 64, generator=gen)
    p4 = torch.softmax(torch.randn(1, 2, 3, 64, generator=gen), -1)
    kw, vw = torch.randn(1, 2, 4, 64, generator=gen), torch.randn(1, 2, 4, 64, generator=gen)
    seg = native.PackedSegment((kc, kss, kz), (vc, vss, vz), 4, 32, 16)
    seg_t, seg_i = native.flatten_segments([seg])
    low, _, k_out, _, _, _ = _gear_terms(1, 2, 64, 64, 32, 1, 1, chunks=[32])
    gear = native.flatten_gear(native.GearParts(low[2], k_low=low[:2], k_out=k_out))
    sq, lm, sel, factor, basis, inv_freq, rs = shadowkv_inputs()
    allow = torch.tensor([[5, 3], [0, 5]], dtype=torch.int32)
    keys, rebuilt = torch.randn(1, 2, 6, 32, generator=gen), torch.randn(1, 2, 6, 32, generator=gen)
    c, s, z = quantize_per_token(keys - rebuilt, 4, 16)
    table = torch.cat([c, s.view(torch.uint8), z.view(torch.uint8)], dim=-1)
    out_a, lse_a = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, generator=gen)
    labels = torch.randn(B, H, 2, T, generator=gen)
    channels = torch.tensor([[0, 1], [2, 3]])
    v_sum = torch.randn(2, 2, 12, 32, generator=gen)
    return {
        "native_sparse_decode": (q, k, v, *idx, None, None, None, 0, 0.2),
        "native_sparse_decode_tail": (q, k, v, *idx, ks, vs, cnt, 7, 0.2),
        "native_label_select": (q, channels, labels, k, 4, 100, 6, 12, 0.3, "mean"),
        "native_shadowkv_select": (sq, lm, sel, factor, basis, inv_freq, rs, allow, 5, 12, 8, 0.3, "max", False),
        "native_attend_rows": (q, [k, k[:, :, :9]], [v, v[:, :, :9]], [None, i.block_cnt], [T, 9], 0.3),
        "native_add_residual": (rebuilt, table, 4, 16),
        "native_merge_states": (out_a, lse_a, out_a.flip(0), lse_a.flip(0)),
        "native_shadowkv_tail": (sq, lm, sel, v_sum, None, None, 8, 16, 0.3),
        "native_channel_scores": (q4, kc, kss, kz, 4, 32),
        "native_token_values": (p4, vc, vss, vz, 4, 16),
        "native_quant_attend": (q4, kw, vw, None, seg_t, seg_i),
        "native_gear_key_extra": (torch.randn(1, 2, 3, 64, generator=gen), q4, 32, gear),
        "native_gear_value_extra": (torch.randn(1, 2, 3, 64, generator=gen), p4, 32,
                                    native.flatten_gear(native.GearParts(low[2], v_low=low[:2]))),
    }


SAMPLES = _op_samples() if native.available() else {}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name):
    op = getattr(OPS, name.removesuffix("_tail") if name.endswith("decode_tail") else name)
    torch.library.opcheck(op, SAMPLES[name])
