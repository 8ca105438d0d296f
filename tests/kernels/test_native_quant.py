"""The compiled readers of packed low-bit K/V (`kvpress.kernels.native.channel_scores` /
`token_values`) against the dequantizing references and the torch fast path."""
import dataclasses

import pytest
import torch

from kvpress.kernels import dequantize_per_channel, dequantize_per_token, native, quant
from kvpress.kernels.quant import (channel_quant_scores, dequantize_refinement, quantize_per_channel,
                                   quantize_per_token, quantize_refined_keys, token_quant_values)

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here (no C compiler?)")


def _spare(x: torch.Tensor, spare: int = 40) -> torch.Tensor:
    """``x`` (B, H, T, ...) as the first T entries of a larger buffer along dim 2 (as the caches
    store it: capacity beyond the tokens written), the spare entries holding junk."""
    buf = torch.full((x.shape[0], x.shape[1], x.shape[2] + spare, *x.shape[3:]), 3, dtype=x.dtype)
    buf[:, :, : x.shape[2]] = x
    return buf[:, :, : x.shape[2]]


# (bits, D, key group, value group): every vector path (8 bytes of a plane per load; value groups
# as wide as a vector of plane positions, or narrower) and the scalar path (rows shorter than 8 bytes)
SHAPES = [(4, 64, 32, 32), (2, 64, 32, 32), (8, 64, 64, 16), (4, 64, 64, 16), (2, 64, 32, 16), (4, 64, 16, 8),
          (2, 128, 8, 8), (4, 16, 8, 8), (2, 16, 8, 16), (2, 24, 8, 8)]


def _store(bits, D, G, Gv, B=2, H=3, T=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=gen) * 2 + 0.5
    k[..., 1] *= 8  # an outlier channel
    v = torch.randn(B, H, T, D, generator=gen)
    kc, ks, kz = quantize_per_channel(k, bits, G)
    vc, vs, vz = quantize_per_token(v, bits, Gv)
    return (_spare(kc), _spare(ks, 5), _spare(kz, 5)), (_spare(vc), _spare(vs), _spare(vz))


@pytest.mark.parametrize("bits,D,G,Gv", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 8, 13, 33])  # more than 8 rows: blocks of 8, one call each
def test_channel_scores_equal_dequantized_reference(bits, D, G, Gv, M):
    (kc, ks, kz), _ = _store(bits, D, G, Gv)
    q = torch.randn(kc.shape[0], kc.shape[1], M, D, generator=torch.Generator().manual_seed(1))
    ref = q @ dequantize_per_channel(kc, ks, kz, bits, G).transpose(-1, -2)
    out = channel_quant_scores(q, kc, ks, kz, bits, G, backend="native")
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out, channel_quant_scores(q, kc, ks, kz, bits, G, backend="torch"), atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("bits,D,G,Gv", SHAPES)
@pytest.mark.parametrize("M,T", [(1, 192), (3, 200), (8, 72), (33, 72)])
def test_token_values_equal_dequantized_reference(bits, D, G, Gv, M, T):
    _, (vc, vs, vz) = _store(bits, D, G if T % G == 0 else 8, Gv, T=T)
    gen = torch.Generator().manual_seed(2)
    wide = torch.softmax(torch.randn(vc.shape[0], vc.shape[1], M, T + 9, generator=gen), -1)
    p = wide[..., :T]  # a slice of wider scores, as the policies pass it
    p[0, 0, 0, 5:50] = 0.0  # masked tokens
    ref = p @ dequantize_per_token(vc, vs, vz, bits, Gv)
    out = token_quant_values(p, vc, vs, vz, bits, Gv, backend="native")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, token_quant_values(p, vc, vs, vz, bits, Gv, backend="torch"), atol=1e-5, rtol=1e-5)


def test_fp16_subnormal_and_negative_scales_convert_exactly():
    """The kernels read fp16 scales / zero points as bits: subnormals, negative zero points and
    constant groups (scale 0) must dequantize as torch's fp16 -> fp32 does."""
    B, H, T, D, bits, G = 1, 1, 16, 16, 4, 8
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (B, H, T, D * bits // 8), generator=gen, dtype=torch.uint8)
    ks = torch.tensor([3e-7, 6e-8, 0.0, 1e-5, 2.5, 300.0, 1e-3, 7e-6] * 4, dtype=torch.float16).view(1, 1, 2, D)
    kz = -ks.flip(-1) * 3
    assert (ks.float().abs() < 6.1e-5).any() and (ks > 0).any()  # subnormals present
    q = torch.randn(B, H, 3, D, generator=gen)
    ref = q @ dequantize_per_channel(codes, ks, kz, bits, G).transpose(-1, -2)
    torch.testing.assert_close(channel_quant_scores(q, codes, ks, kz, bits, G, backend="native"), ref,
                               atol=1e-2, rtol=1e-5)
    vs, vz = ks.view(1, 1, 16, 2), kz.view(1, 1, 16, 2)
    p = torch.rand(B, H, 3, T, generator=gen)
    ref = p @ dequantize_per_token(codes, vs, vz, bits, 8)
    torch.testing.assert_close(token_quant_values(p, codes, vs, vz, bits, 8, backend="native"), ref, atol=1e-2, rtol=1e-5)


def test_auto_reads_natively_for_a_decode_step_or_a_short_verification_only(monkeypatch):
    (kc, ks, kz), (vc, vs, vz) = _store(4, 64, 32, 32, B=1, H=2, T=64)
    calls = []
    for name in ("channel_scores", "token_values"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    many = native.QUANT_NATIVE_READ_ROWS
    q3, q_many, q_more = (torch.randn(1, 2, m, 64) for m in (3, many, many + 1))
    channel_quant_scores(q3, kc, ks, kz, 4, 32)
    token_quant_values(torch.rand(1, 2, 3, 64), vc, vs, vz, 4, 32)
    channel_quant_scores(q_many, kc, ks, kz, 4, 32)  # a few tokens' GQA groups: still native, in blocks
    assert calls == ["channel_scores", "token_values", "channel_scores"]
    calls.clear()
    channel_quant_scores(q_more, kc, ks, kz, 4, 32)  # more rows (a prefill chunk): the torch path
    channel_quant_scores(q3, kc, ks, kz, 4, 32, backend="torch")
    assert calls == []


@pytest.mark.parametrize("make,match", [
    (lambda q, kc, ks, kz: (q.double(), kc, ks, kz), "fp32 CPU"),
    (lambda q, kc, ks, kz: (q, kc, ks.float(), kz.float()), "fp16 scales"),
    (lambda q, kc, ks, kz: (q, kc.transpose(2, 3).contiguous().transpose(2, 3), ks, kz), "uint8 CPU codes"),
])
def test_native_refuses_what_it_cannot_read_with_the_reason(make, match):
    (kc, ks, kz), _ = _store(4, 64, 32, 32, B=1, H=2, T=64)
    args = make(torch.randn(1, 2, 3, 64), kc, ks, kz)
    with pytest.raises(ValueError, match=match):
        channel_quant_scores(*args, 4, 32, backend="native")


def test_native_leaves_prefill_chunks_to_torch(monkeypatch):
    """More than `QUANT_NATIVE_READ_ROWS` query rows per KV head (a prefill chunk, not a decode
    step or a short verification) take the torch path even under ``backend="native"``."""
    (kc, ks, kz), _ = _store(4, 64, 32, 32, B=1, H=2, T=64)
    rows = native.QUANT_NATIVE_READ_ROWS + 1
    monkeypatch.setattr(native, "channel_scores", lambda *a: pytest.fail(f"native kernel called for {rows} rows"))
    q = torch.randn(1, 2, rows, 64)
    ref = q @ dequantize_per_channel(kc, ks, kz, 4, 32).transpose(-1, -2)
    torch.testing.assert_close(channel_quant_scores(q, kc, ks, kz, 4, 32, backend="native"), ref, atol=2e-4, rtol=1e-5)


def test_unknown_backend_is_a_clear_error():
    (kc, ks, kz), _ = _store(4, 64, 32, 32, B=1, H=1, T=32)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'native'\)"):
        channel_quant_scores(torch.randn(1, 1, 3, 64), kc, ks, kz, 4, 32, backend="cuda")
    assert quant.READ_BACKENDS == ("auto", "torch", "native")


@pytest.mark.parametrize("bits,D,G,Gv", [(4, 64, 32, 32), (2, 64, 32, 16), (4, 16, 8, 8), (2, 24, 8, 8)])
@pytest.mark.parametrize("padded", [False, True])
def test_quant_attend_equals_softmax_over_dequantized_and_window(bits, D, G, Gv, padded):
    B, H, M, W = 2, 3, 3, 11
    (kc, ks, kz), (vc, vs, vz) = _store(bits, D, G, Gv, B=B, H=H, T=192)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, M, D, generator=gen) * 0.3
    kw, vw = _spare(torch.randn(B, H, W, D, generator=gen)), _spare(torch.randn(B, H, W, D, generator=gen))
    k = torch.cat([dequantize_per_channel(kc, ks, kz, bits, G), kw], 2)
    v = torch.cat([dequantize_per_token(vc, vs, vz, bits, Gv), vw], 2)
    starts = torch.tensor([0, 200]) if padded else None  # row 1: every packed token and 8 window rows hidden
    s = q @ k.transpose(-1, -2)
    if padded:
        s[1, :, :, :200] = float("-inf")
    ref_lse = s.logsumexp(-1)
    ref = torch.softmax(s, -1) @ v
    out, lse = native.quant_attend(q, kc, ks, kz, vc, vs, vz, bits=bits, group_size=G, value_group_size=Gv, k_win=kw,
                                   v_win=vw, starts=starts, win_starts=None if starts is None else (starts - 192).clamp(min=0))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


def test_quant_attend_of_nothing_is_zero_with_minus_inf_lse():
    (kc, ks, kz), (vc, vs, vz) = _store(4, 64, 32, 32, B=1, H=1, T=64)
    kw = vw = torch.zeros(1, 1, 4, 64)
    out, lse = native.quant_attend(torch.randn(1, 1, 2, 64), kc, ks, kz, vc, vs, vz, bits=4, group_size=32,
                                   value_group_size=32, k_win=kw, v_win=vw, starts=torch.tensor([64]),
                                   win_starts=torch.tensor([4]))
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_native_threads_follow_torch_and_their_cap(torch_threads):
    torch_threads(1)
    assert native.threads() == 1
    torch_threads(2)
    assert native.threads() in (1, 2)  # 1: built without OpenMP, or beside a second runtime
    if native.threads() == 2:
        native._lib().kvp_set_max_threads(1)
        try:
            assert native.threads() == 1
        finally:
            native._lib().kvp_set_max_threads(0)


@pytest.mark.parametrize("bits,D,G,Gv", [(4, 64, 32, 32), (2, 64, 64, 16), (4, 24, 8, 8)])
def test_long_stores_split_into_spans_read_alike_on_any_thread_count(bits, D, G, Gv, torch_threads):
    """Stores longer than one piece of work (512 tokens): several spans per (row, KV head), a left
    padding that ends inside the second span, a span with nothing attended; the outputs are the
    reference's, and bitwise equal on one and on two threads."""
    B, H, M, T, W = 2, 3, 3, 1600, 7
    (kc, ks, kz), (vc, vs, vz) = _store(bits, D, G, Gv, B=B, H=H, T=T, seed=7)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(B, H, M, D, generator=gen) * 0.3
    kw, vw = _spare(torch.randn(B, H, W, D, generator=gen)), _spare(torch.randn(B, H, W, D, generator=gen))
    k_deq, v_deq = dequantize_per_channel(kc, ks, kz, bits, G), dequantize_per_token(vc, vs, vz, bits, Gv)
    p = torch.softmax(torch.randn(B, H, M, T, generator=gen), -1)
    starts = torch.tensor([0, 700])
    s = q @ torch.cat([k_deq, kw], 2).transpose(-1, -2)
    s[1, :, :, :700] = float("-inf")
    ref, ref_lse = torch.softmax(s, -1) @ torch.cat([v_deq, vw], 2), s.logsumexp(-1)

    runs = []
    for n in (1, 2):
        torch_threads(n)
        runs.append((native.channel_scores(q, kc, ks, kz, bits, G), native.token_values(p, vc, vs, vz, bits, Gv),
                     *native.quant_attend(q, kc, ks, kz, vc, vs, vz, bits=bits, group_size=G, value_group_size=Gv,
                                          k_win=kw, v_win=vw, starts=starts, win_starts=torch.tensor([0, 0]))))
    for one, two in zip(*runs):
        assert torch.equal(one, two)
    scores, values, out, lse = runs[0]
    torch.testing.assert_close(scores, q @ k_deq.transpose(-1, -2), atol=5e-4, rtol=1e-5)
    torch.testing.assert_close(values, p @ v_deq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


def _gear_terms(B, H, N, D, G, R, J, chunks, seed=0):
    """Random GEAR corrections (low-rank factors of chunks, key and value outliers) as the
    compiled kernels take them, with the dense (B, H, N, D) errors each part stands for."""
    gen = torch.Generator().manual_seed(seed)
    bounds = torch.tensor([0, *chunks, N], dtype=torch.int64)
    C = bounds.numel() - 1
    left = _spare(torch.randn(B, H, N, R, generator=gen).half())
    right = _spare(torch.randn(B, H, C, D, R, generator=gen).half(), 3)
    chunk_of = torch.repeat_interleave(torch.arange(C), bounds.diff())
    low_err = torch.einsum("bhnr,bhndr->bhnd", left.float(), right.float()[:, :, chunk_of])
    k_off = torch.randint(0, G, (B, H, N // G, J, D), generator=gen, dtype=torch.uint8)
    k_corr = torch.randn(B, H, N // G, J, D, generator=gen).half()
    v_off = torch.randint(0, G, (B, H, N, D // G * J), generator=gen, dtype=torch.uint8)
    v_corr = torch.randn(B, H, N, D // G * J, generator=gen).half()
    k_tok = torch.arange(N // G).view(1, 1, -1, 1, 1) * G + k_off.long()  # each key outlier's token
    k_err = torch.zeros(B, H, N, D).scatter_add_(2, k_tok.flatten(2, 3), k_corr.float().flatten(2, 3))
    v_chan = (torch.arange(D // G * J) // J * G).view(1, 1, 1, -1) + v_off.long()  # each value outlier's channel
    v_err = torch.zeros(B, H, N, D).scatter_add_(3, v_chan, v_corr.float())
    return ((left, right, bounds), low_err, (_spare(k_off, 2), _spare(k_corr, 2)), k_err,
            (_spare(v_off), _spare(v_corr)), v_err)


def _sink_err(sk, start, N):
    """The dense (B, H, N, D) error of sink corrections ``sk`` (B, H, S, D) placed at columns
    start[b] + i, clamped to N - 1 (unflushed sinks carry zero corrections)."""
    B, H, S, D = sk.shape
    col = (start[:, None] + torch.arange(S)).clamp(max=N - 1)  # (B, S)
    return torch.zeros(B, H, N, D).scatter_add_(2, col[:, None, :, None].expand(B, H, S, D), sk.float())


@pytest.mark.parametrize("R,J,S,M", [(1, 1, 2, 3), (2, 2, 0, 3), (0, 1, 0, 3), (2, 0, 3, 3), (0, 0, 2, 3),
                                     (1, 1, 2, 19)])
def test_gear_corrections_equal_their_dense_errors(R, J, S, M, torch_threads):
    """GEAR's low-rank chunks, outliers and sink corrections added by the compiled kernels equal
    attention against the dense errors they stand for (0: that part absent); bitwise the same on
    one and on two threads; 19 rows run in blocks of 8."""
    B, H, N, D, G = 2, 3, 96, 16, 8
    low, low_err, k_out, k_err, v_out, v_err = _gear_terms(B, H, N, D, G, max(R, 1), max(J, 1), chunks=[32, 40])
    gen = torch.Generator().manual_seed(3)
    sk, sv = torch.randn(B, H, S, D, generator=gen).half(), torch.randn(B, H, S, D, generator=gen).half()
    start = torch.tensor([0, 94])  # row 1: its later sinks clamp to the last column
    k_dense = (low_err if R else 0) + (k_err if J else 0) + (_sink_err(sk, start, N) if S else 0)
    v_dense = (low_err if R else 0) + (v_err if J else 0) + (_sink_err(sv, start, N) if S else 0)
    parts = native.GearParts(bounds=low[2] if R else None, k_low=low[:2] if R else None, v_low=low[:2] if R else None,
                             k_out=k_out if J else None, v_out=v_out if J else None,
                             sinks=(sk, sv) if S else None, sink_start=start)
    q = torch.randn(B, H, M, D, generator=gen)
    p = torch.softmax(torch.randn(B, H, M, N + 5, generator=gen), -1)[..., :N]  # a slice of wider scores
    base_s, base_o = torch.randn(B, H, M, N, generator=gen), torch.randn(B, H, M, D, generator=gen)
    runs = []
    for n in (1, 2):
        torch_threads(n)
        runs.append((native.gear_key_extra(base_s.clone(), q, G, parts),
                     native.gear_value_extra(base_o.clone(), p, G, parts)))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    torch.testing.assert_close(runs[0][0], base_s + q @ k_dense.transpose(-1, -2), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(runs[0][1], base_o + p @ v_dense, atol=1e-5, rtol=1e-5)


def test_gear_corrections_refuse_what_they_cannot_read():
    B, H, M, N, D, G = 1, 2, 2, 32, 16, 8
    low, _, k_out, _, v_out, _ = _gear_terms(B, H, N, D, G, 1, 1, chunks=[16])
    q, s = torch.randn(B, H, M, D), torch.zeros(B, H, M, N)
    with pytest.raises(ValueError, match="chunk bounds"):  # bounds end before N
        native.gear_key_extra(s, q, G, native.GearParts(torch.tensor([0, 16, 24]), k_low=low[:2]))
    with pytest.raises(ValueError, match="uint8 offsets and fp16 corrections"):
        native.gear_key_extra(s, q, G, native.GearParts(k_out=(k_out[0], k_out[1].float())))
    with pytest.raises(ValueError, match="fp32 CPU contiguous scores"):
        native.gear_key_extra(s.double(), q, G, native.GearParts(low[2], k_low=low[:2]))
    with pytest.raises(ValueError, match=r"right \(B, H, >=C, D=16"):
        native.gear_key_extra(s, q, G, native.GearParts(low[2], k_low=(low[0], low[1][:, :, :, :8])))
    with pytest.raises(ValueError, match="sink corrections must be fp16"):
        native.gear_key_extra(s, q, G, native.GearParts(sinks=(torch.zeros(B, H, 2, D), torch.zeros(B, H, 2, D))))
    bad = k_out[0].clone()
    bad[0, 0, 0, 0, 0] = G  # an offset outside its group: skipped, reported, nothing written out of bounds
    with pytest.raises(RuntimeError, match="code -4"):
        native.gear_key_extra(s, q, G, native.GearParts(k_out=(bad, k_out[1].clone())))
    with pytest.raises(ValueError, match="probabilities"):
        native.gear_value_extra(torch.zeros(B, H, M, D), torch.rand(B, H, M, N).double(), G,
                                native.GearParts(low[2], v_low=low[:2]))


def test_quant_attend_over_several_segments_with_per_head_starts_and_value_scales(torch_threads):
    """ZipCache's step: two stores of different widths (8 and 2 bits), each with its own left
    padding per (row, KV head) and the values' per-channel factor, and the window, under one
    softmax; bitwise the same on one and on two threads."""
    B, H, M, D, W = 2, 3, 3, 64, 9
    (k8, v8), (k2, v2) = _store(8, D, 32, 32, B=B, H=H, T=96, seed=1), _store(2, D, 32, 16, B=B, H=H, T=704, seed=2)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, M, D, generator=gen) * 0.3
    kw, vw = _spare(torch.randn(B, H, W, D, generator=gen)), _spare(torch.randn(B, H, W, D, generator=gen))
    vn = (torch.rand(B, H, D, generator=gen) + 0.5).half()
    st8, st2 = torch.tensor([[0, 3, 40], [0, 0, 96]]), torch.tensor([[0, 600, 5], [700, 0, 0]])
    segs = [native.PackedSegment(k8, v8, 8, 32, 32, starts=st8, value_scale=vn),
            native.PackedSegment(k2, v2, 2, 32, 16, starts=st2, value_scale=vn)]
    k = torch.cat([dequantize_per_channel(*k8, 8, 32), dequantize_per_channel(*k2, 2, 32), kw], 2)
    v = torch.cat([dequantize_per_token(*v8, 8, 32) * vn[:, :, None].float(),
                   dequantize_per_token(*v2, 2, 16) * vn[:, :, None].float(), vw], 2)
    s = q @ k.transpose(-1, -2)
    idx = torch.arange(96 + 704)
    hidden = (idx < st8[..., None]) | ((idx >= 96) & (idx - 96 < st2[..., None]))  # (B, H, 800)
    s[..., :800] = s[..., :800].masked_fill(hidden[:, :, None], float("-inf"))
    runs = []
    for n in (1, 2):
        torch_threads(n)
        runs.append(native.quant_attend(q, k_win=kw, v_win=vw, segments=segs))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    torch.testing.assert_close(runs[0][0], torch.softmax(s, -1) @ v, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(runs[0][1], s.logsumexp(-1), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        native.quant_attend(q, *k8, *v8, bits=8, group_size=32, value_group_size=32, k_win=kw, v_win=vw, segments=segs)
    with pytest.raises(ValueError, match="value_scale must be fp16"):
        native.quant_attend(q, k_win=kw, v_win=vw,
                            segments=[native.PackedSegment(k8, v8, 8, 32, 32, value_scale=vn.float())])


@pytest.mark.parametrize("bits,R,G", [(4, 8, 32), (4, 16, 32), (4, 24, 16), (2, 8, 32), (2, 12, 8), (2, 64, 32)])
def test_quant_attend_reads_refined_key_channels(bits, R, G, torch_threads):
    """``zipcache``'s refined key channels in the native step: each head's R channels read with
    their second codes (2, 3, 4, 8, 12 and 16 bytes a token: the byte-lane reading, the one-load
    4-byte words and the gathered words), over a store longer than one span with left padding
    inside it; the output is attention over the refined dequantized keys, bitwise the same on one
    and on two threads. Channel ids outside [0, D) are a clear error."""
    B, H, M, D, T, W = 2, 3, 3, 64, 1088, 5
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(B, H, T, D, generator=gen) * 2
    k[..., 7] *= 8
    v = torch.randn(B, H, T, D, generator=gen)
    ch = torch.rand(B, H, D, generator=gen).argsort(-1)[..., :R].contiguous()
    kc, ks, kz, rc, rs = quantize_refined_keys(k, bits, G, ch)
    vq = quantize_per_token(v, bits, 32)
    q = torch.randn(B, H, M, D, generator=gen) * 0.3
    kw, vw = _spare(torch.randn(B, H, W, D, generator=gen)), _spare(torch.randn(B, H, W, D, generator=gen))
    k_deq = dequantize_per_channel(kc, ks, kz, bits, G)
    k_deq.scatter_add_(3, ch[:, :, None, :].expand(-1, -1, T, -1), dequantize_refinement(rc, rs, bits, G))
    on_refined = lambda x: (x - k).gather(3, ch[:, :, None, :].expand(-1, -1, T, -1)).abs().amax()  # noqa: E731
    assert on_refined(k_deq) < on_refined(dequantize_per_channel(*quantize_per_channel(k, bits, G), bits, G)) / 2
    starts = torch.tensor([0, 530])
    s = q @ torch.cat([k_deq, kw], 2).transpose(-1, -2)
    s[1, :, :, :530] = float("-inf")
    ref = torch.softmax(s, -1) @ torch.cat([dequantize_per_token(*vq, bits, 32), vw], 2)
    seg = native.PackedSegment((_spare(kc), _spare(ks, 3), _spare(kz, 3)), vq, bits, G, 32, starts=starts,
                               refine=(_spare(rc), _spare(rs, 3), ch))
    runs = []
    for n in (1, 2):
        torch_threads(n)
        runs.append(native.quant_attend(q, k_win=kw, v_win=vw, segments=[seg]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    torch.testing.assert_close(runs[0][0], ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(runs[0][1], s.logsumexp(-1), atol=5e-5, rtol=1e-5)
    for bad_ids in (ch.clone().index_fill_(2, torch.tensor([0]), D), ch.clone().index_fill_(2, torch.tensor([1]), -1)):
        with pytest.raises(ValueError, match=r"refined key channel ids must lie in \[0, 64\)"):
            native.quant_attend(q, k_win=kw, v_win=vw, segments=[dataclasses.replace(seg, refine=(rc, rs, bad_ids))])
    with pytest.raises(ValueError, match="refined key channels must be uint8 codes"):
        native.quant_attend(q, k_win=kw, v_win=vw, segments=[dataclasses.replace(seg, refine=(rc, rs.float(), ch))])


def test_quant_attend_refuses_a_segment_whose_parts_disagree():
    (kc, ks, kz), (vc, vs, vz) = _store(4, 64, 32, 32, B=1, H=2, T=64)
    kw = vw = torch.zeros(1, 2, 4, 64)
    q = torch.randn(1, 2, 3, 64)
    with pytest.raises(ValueError, match="do not describe 64 tokens"):  # values of fewer tokens than the keys
        native.quant_attend(q, kc, ks, kz, vc[:, :, :32], vs[:, :, :32], vz[:, :, :32], bits=4, group_size=32,
                            value_group_size=32, k_win=kw, v_win=vw)
    with pytest.raises(ValueError, match="do not describe"):  # read at another width than packed
        native.quant_attend(q, kc, ks, kz, vc, vs, vz, bits=2, group_size=32, value_group_size=32, k_win=kw, v_win=vw)


def test_quant_attend_with_gear_corrections_equals_attention_over_the_corrected_store(torch_threads):
    """A ``gear`` step in one call: the packed codes plus the low-rank, outlier and sink
    corrections, left padding inside the store, and the window, under one softmax; a store
    longer than one span (the corrections cut at span edges); bitwise the same on 1 and 2 threads."""
    B, H, M, N, D, G, W = 2, 3, 3, 1040, 16, 8, 5
    (kc, ks, kz), (vc, vs, vz) = _store(2, D, G, G, B=B, H=H, T=N, seed=3)
    low, low_err, k_out, k_err, v_out, v_err = _gear_terms(B, H, N, D, G, 1, 1, chunks=[500, 530])
    gen = torch.Generator().manual_seed(6)
    sk, sv = torch.randn(B, H, 2, D, generator=gen).half(), torch.randn(B, H, 2, D, generator=gen).half()
    starts = torch.tensor([0, 515])
    parts = native.GearParts(low[2], k_low=low[:2], v_low=low[:2], k_out=k_out, v_out=v_out, sinks=(sk, sv),
                             sink_start=starts)
    q = torch.randn(B, H, M, D, generator=gen) * 0.3
    kw, vw = _spare(torch.randn(B, H, W, D, generator=gen)), _spare(torch.randn(B, H, W, D, generator=gen))
    k = dequantize_per_channel(kc, ks, kz, 2, G) + low_err + k_err + _sink_err(sk, starts, N)
    v = dequantize_per_token(vc, vs, vz, 2, G) + low_err + v_err + _sink_err(sv, starts, N)
    s = q @ torch.cat([k, kw], 2).transpose(-1, -2)
    s[1, :, :, :515] = float("-inf")
    runs = []
    for n in (1, 2):
        torch_threads(n)
        seg = native.PackedSegment((kc, ks, kz), (vc, vs, vz), 2, G, G, starts=starts, gear=parts)
        runs.append(native.quant_attend(q, k_win=kw, v_win=vw, segments=[seg]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    torch.testing.assert_close(runs[0][0], torch.softmax(s, -1) @ torch.cat([v, vw], 2), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(runs[0][1], s.logsumexp(-1), atol=2e-5, rtol=1e-5)
