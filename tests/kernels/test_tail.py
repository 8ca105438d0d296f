"""tail_estimate (chunk-mean estimate of the unattended tokens) against its brute-force reference."""
import pytest
import torch

from kvpress.kernels import (SparseIndex, chunk_landmarks, landmark_tail_estimate, merge_states,
                             reference_landmark_tail_estimate, reference_sparse_decode, reference_tail_estimate,
                             sparse_decode, sparse_decode_tail, tail_estimate)
from kvpress_kernel_cases import build, case


def chunk_sums(k, v, lens, starts, chunk):
    """Sums of real tokens' keys / values per chunk, as a policy's running sums hold them."""
    B, H, T, D = k.shape
    n = -(-int(lens.max()) // chunk)
    pos = torch.arange(T)
    first = torch.zeros(B, dtype=torch.long) if starts is None else starts.long()
    real = ((pos[None] >= first[:, None]) & (pos[None] < lens.long()[:, None])).float()  # (B, T)
    ks, vs, cnt = torch.zeros(B, H, n, D), torch.zeros(B, H, n, D), torch.zeros(B, n)
    for b in range(B):  # chunks counted from each row's first real token
        c = ((pos - first[b]).clamp(min=0) // chunk).clamp(max=n - 1)
        ks[b].index_add_(1, c, k[b].float() * real[b, None, :, None])
        vs[b].index_add_(1, c, v[b].float() * real[b, None, :, None])
        cnt[b].index_add_(0, c, real[b])
    return ks, vs, cnt


CASES = [
    case(B=2, H_kv=2, G=3, T_cap=70, block_size=1, mode="topk", budget=9, sinks=2, tail=3),
    case(B=2, H_kv=2, G=2, T_cap=67, block_size=8, mode="random", budget=3, sinks=1, tail=5,
         lens=[67, 50], starts=[0, 6]),
    case(B=1, H_kv=3, G=3, T_cap=64, block_size=16, mode="topk", budget=2, sinks=0, tail=16),
    case(B=2, H_kv=1, G=4, T_cap=40, block_size=1, mode="none", sinks=4, tail=4, lens=[40, 33], starts=[0, 3]),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"bs{c['block_size']}-{c['mode']}-B{c['B']}")
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_estimate_equals_brute_force_chunk_means(c, chunk):
    q, k, v, index = build(c)
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, chunk)
    out, lse = tail_estimate(q, k, v, index, ks, vs, cnt, chunk_size=chunk, scale=0.125)
    ref_out, ref_lse = reference_tail_estimate(q, k, v, index, chunk_size=chunk, scale=0.125)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("c", CASES[:3], ids=lambda c: f"bs{c['block_size']}-{c['mode']}-B{c['B']}")
def test_chunk_of_one_token_makes_the_merged_step_dense_attention(c):
    q, k, v, index = build(c)
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, 1)
    out, lse = sparse_decode(q, k, v, index, scale=0.125)
    t_out, t_lse = tail_estimate(q, k, v, index, ks, vs, cnt, chunk_size=1, scale=0.125)
    merged, merged_lse = merge_states(out, lse, t_out, t_lse)
    dense = type(index).dense(index.seq_lens, k.shape[1], block_size=1, seq_starts=index.seq_starts)
    ref_out, ref_lse = reference_sparse_decode(q, k, v, dense, scale=0.125)
    torch.testing.assert_close(merged, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"bs{c['block_size']}-{c['mode']}-B{c['B']}")
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_fused_decode_and_tail_equals_the_references_merged(c, chunk):
    """One pass (`sparse_decode_tail`) == exact attention (reference) merged with the brute-force estimate."""
    q, k, v, index = build(c)
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, chunk)
    out, lse = sparse_decode_tail(q, k, v, index, ks, vs, cnt, chunk_size=chunk, scale=0.125, backend="torch")
    e_out, e_lse = reference_sparse_decode(q, k, v, index, scale=0.125)
    t_out, t_lse = reference_tail_estimate(q, k, v, index, chunk_size=chunk, scale=0.125)
    ref_out, ref_lse = merge_states(e_out, e_lse, t_out, t_lse)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("full_counts", [True, False])
def test_fused_decode_and_tail_on_the_hot_path_index(full_counts):
    """The unpadded token index of the decode hot path (and one with unused slots), with ``seq_len``."""
    from kvpress.policies._sparse import range_topk_index

    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 3, 96, 32, generator=gen), torch.randn(2, 3, 96, 32, generator=gen)
    index = range_topk_index(torch.randn(2, 3, 90 - 4 - 6, generator=gen), 11, 4, 90, block_size=1, sinks=4, dense_tail=6)
    if not full_counts:
        cnt = torch.tensor([[11, 5, 0], [3, 11, 7]], dtype=torch.int32)
        ids = torch.where(torch.arange(11) < cnt[..., None], index.block_idx, -1).to(torch.int32)
        index = type(index)(1, ids, cnt, index.seq_lens, None, 4, 6, id_range=(-1, 89))
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, None, 8)
    out, lse = sparse_decode_tail(q, k, v, index, ks, vs, cnt, chunk_size=8, scale=0.2, seq_len=90)
    e_out, e_lse = sparse_decode(q, k, v, index, scale=0.2)
    t_out, t_lse = tail_estimate(q, k, v, index, ks, vs, cnt, chunk_size=8, scale=0.2, seq_len=90)
    ref_out, ref_lse = merge_states(e_out, e_lse, t_out, t_lse)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_decode_and_tail_in_half_precision(dtype):
    """Half-precision caches: fp32 math inside, out in q's dtype, within rounding of the fp32 run."""
    q, k, v, index = build(CASES[1])
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, 5)
    out32, lse32 = sparse_decode_tail(q, k, v, index, ks, vs, cnt, chunk_size=5, scale=0.125)
    out, lse = sparse_decode_tail(q.to(dtype), k.to(dtype), v.to(dtype), index, ks, vs, cnt, chunk_size=5,
                                  scale=0.125)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), out32, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, lse32, atol=3e-2, rtol=3e-2)


def test_fused_decode_and_tail_rejects_bad_input():
    q, k, v, index = build(CASES[0])
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, index.seq_starts, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_decode_tail(q, k, v, index, ks, vs, cnt, chunk_size=8, backend="cuda")
    with pytest.raises(ValueError, match="count must have shape"):
        sparse_decode_tail(q, k, v, index, ks, vs, cnt[:, :2], chunk_size=8)
    with pytest.raises(ValueError):
        sparse_decode_tail(q, k[:, :, :10], v[:, :, :10], index, ks, vs, cnt, chunk_size=8)  # ids past the cache


def test_everything_attended_leaves_an_empty_tail():
    c = case(B=1, H_kv=2, G=2, T_cap=32, block_size=8, mode="all")
    q, k, v, index = build(c)
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, None, 8)
    out, lse = tail_estimate(q, k, v, index, ks, vs, cnt, chunk_size=8, scale=0.125)
    assert torch.isneginf(lse).all() and not out.isnan().any()


def test_coarse_chunks_estimate_a_diffuse_tail_closer_than_dropping_it():
    # a flat attention over 512 tokens: the top 32 alone miss most of the mass
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 512, 64, generator=gen) * 0.2
    v = torch.randn(1, 1, 512, 64, generator=gen) + 1.0
    q = torch.randn(1, 1, 64, generator=gen)
    c = case(B=1, H_kv=1, G=1, T_cap=512, block_size=1, mode="topk", budget=32)
    _, _, _, index = build(c)
    lens = index.seq_lens
    ks, vs, cnt = chunk_sums(k, v, lens, None, 64)
    dense = type(index).dense(lens, 1, block_size=64)
    ref, _ = reference_sparse_decode(q, k, v, dense, scale=0.125)
    out, lse = sparse_decode(q, k, v, index, scale=0.125)
    t_out, t_lse = tail_estimate(q, k, v, index, ks, vs, cnt, chunk_size=64, scale=0.125)
    merged, _ = merge_states(out, lse, t_out, t_lse)
    assert (merged - ref).norm() < 0.2 * (out - ref).norm()


def test_shape_errors_name_the_shapes():
    q, k, v, index = build(case(B=1, H_kv=2, G=2, T_cap=32, block_size=8, mode="all"))
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, None, 8)
    with pytest.raises(ValueError, match="count must have shape"):
        tail_estimate(q, k, v, index, ks, vs, cnt[:, :2], chunk_size=8, scale=1.0)
    with pytest.raises(ValueError, match="k_sum / v_sum"):
        tail_estimate(q, k, v, index, ks, vs[:, :1], cnt, chunk_size=8, scale=1.0)


@pytest.mark.parametrize("full_counts", [True, False])
def test_hot_path_positions_equal_the_general_slot_table(full_counts):
    from kvpress.policies._sparse import range_topk_index

    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 3, 90, 32, generator=gen), torch.randn(2, 3, 90, 32, generator=gen)
    index = range_topk_index(torch.randn(2, 3, 90 - 4 - 6, generator=gen), 11, 4, 90, block_size=1, sinks=4, dense_tail=6)
    if not full_counts:  # fewer valid ids in some rows: the rest are -1
        cnt = torch.tensor([[11, 5, 0], [3, 11, 7]], dtype=torch.int32)
        ids = torch.where(torch.arange(11) < cnt[..., None], index.block_idx, -1).to(torch.int32)
        index = type(index)(1, ids, cnt, index.seq_lens, None, 4, 6, id_range=(-1, 89))
    ks, vs, cnt = chunk_sums(k, v, index.seq_lens, None, 8)
    fast = tail_estimate(q, k, v, index, ks, vs, cnt, chunk_size=8, scale=0.2, seq_len=90)
    general = tail_estimate(q, k, v, index, ks, vs, cnt, chunk_size=8, scale=0.2)
    ref = reference_tail_estimate(q, k, v, index, chunk_size=8, scale=0.2)
    for a, b, c in zip(fast, general, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)


def landmark_inputs(B=2, H=2, G=3, C=13, cs=8, D=16, group=4, p_keep=0.6, seed=0, offset=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, C * cs, D, generator=gen), torch.randn(B, H, C * cs, D, generator=gen)
    q = torch.randn(B, H * G, D, generator=gen)
    keep = torch.rand(B, H, C, generator=gen) < p_keep
    N = -(-(C + offset) // group)
    one_hot = torch.nn.functional.one_hot((torch.arange(C) + offset) // group, N).float()  # (C, N): group of each chunk
    v_sum = one_hot.T @ (v.view(B, H, C, cs, D).sum(3) * keep[..., None])  # kept chunks' values per group
    return q, k, v, keep, chunk_landmarks(k, cs), v_sum


@pytest.mark.parametrize("group, offset", [(1, 0), (3, 0), (4, 0), (4, 3), (13, 0), (13, 12)])
def test_landmark_estimate_equals_token_level_reference(group, offset):
    q, k, v, keep, landmarks, v_sum = landmark_inputs(group=group, offset=offset)
    out, lse = landmark_tail_estimate(q, landmarks, keep, v_sum, chunk_size=8, group=group, scale=0.25, offset=offset)
    ref_out, ref_lse = reference_landmark_tail_estimate(q, k, v, keep, chunk_size=8, group=group, scale=0.25,
                                                        offset=offset)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_landmark_estimate_of_constant_groups_is_exact_attention():
    """Keys and values equal within each group of chunks: the estimate is exact attention."""
    gen = torch.Generator().manual_seed(1)
    B, H, G, C, cs, D, group = 1, 2, 2, 8, 8, 16, 2
    k = torch.randn(B, H, C // group, 1, D, generator=gen).expand(B, H, C // group, group * cs, D)
    v = torch.randn(B, H, C // group, 1, D, generator=gen).expand(B, H, C // group, group * cs, D)
    k, v = k.reshape(B, H, C * cs, D), v.reshape(B, H, C * cs, D)
    q, keep = torch.randn(B, H * G, D, generator=gen), torch.ones(B, H, C, dtype=torch.bool)
    v_sum = v.reshape(B, H, C // group, group * cs, D).sum(3)
    out, lse = landmark_tail_estimate(q, chunk_landmarks(k, cs), keep, v_sum, chunk_size=cs, group=group, scale=0.25)
    dense = SparseIndex.dense(torch.tensor([C * cs]), H, block_size=8)
    ref_out, ref_lse = reference_sparse_decode(q, k, v, dense, scale=0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_landmark_estimate_with_nothing_kept_is_empty():
    q, _, _, keep, landmarks, v_sum = landmark_inputs(p_keep=0.0)
    out, lse = landmark_tail_estimate(q, landmarks, keep, v_sum, chunk_size=8, group=4, scale=0.25)
    assert torch.isneginf(lse).all() and torch.equal(out, torch.zeros_like(out))


def test_landmark_estimate_shape_errors_name_the_shapes():
    q, _, _, keep, landmarks, v_sum = landmark_inputs()
    with pytest.raises(ValueError, match="ceil"):
        landmark_tail_estimate(q, landmarks, keep, v_sum, chunk_size=8, group=3, scale=1.0)
    with pytest.raises(ValueError, match=r"offset=4 must be in \[0, group=4\)"):
        landmark_tail_estimate(q, landmarks, keep, v_sum, chunk_size=8, group=4, scale=1.0, offset=4)
    with pytest.raises(ValueError, match="keep"):
        landmark_tail_estimate(q, landmarks, keep[:, :1], v_sum, chunk_size=8, group=4, scale=1.0)


def test_chunk_attention_is_attention_over_each_mean_repeated_count_times():
    """A chunk of count n and mean key / value stands for n identical tokens: the same output and
    lse as plain attention over the means repeated n times; empty chunks stand for nothing."""
    from kvpress.kernels import chunk_attention

    torch.manual_seed(0)
    B, H, G, N, D = 2, 2, 3, 5, 16
    q, k, v = torch.randn(B, H * G, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    count = torch.tensor([[3.0, 0.0, 1.0, 4.0, 2.0], [1.0, 1.0, 0.0, 0.0, 5.0]])
    out, lse = chunk_attention(q, k, v, count, scale=0.3)
    for b in range(B):
        reps = count[b].long()
        kr, vr = k[b].repeat_interleave(reps, dim=1), v[b].repeat_interleave(reps, dim=1)  # (H, n_tokens, D)
        s = (q[b].view(H, G, D) @ kr.transpose(-1, -2)) * 0.3
        torch.testing.assert_close(out[b], (torch.softmax(s, -1) @ vr).reshape(H * G, D), atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1).reshape(H * G), atol=1e-5, rtol=0)
    _, empty = chunk_attention(q, k, v, torch.zeros(B, N), scale=0.3)
    assert torch.isinf(empty).all() and (empty < 0).all()
    with pytest.raises(ValueError, match="count must have shape"):
        chunk_attention(q, k, v, torch.zeros(B, N + 1), scale=0.3)
