"""merge_states and the score functions."""
import math

import pytest
import torch

from kvpress.kernels import (SparseIndex, build_labels, chunk_landmarks, exact_scores, label_scores,
                             landmark_scores, merge_states, page_min_max, pool_blocks, quest_scores,
                             reduce_over_group, reference_sparse_decode, select_topk, sparse_decode)
from kvpress_kernel_cases import build, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_of_disjoint_parts_equals_union(dtype):
    q, k, v, _ = build(case(B=2, H_kv=2, G=3, T_cap=30, dtype="fp32"))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    lens = torch.tensor([30, 25], dtype=torch.int32)
    ids = torch.randperm(25)[:10].sort().values
    a_ids, b_ids = ids[:4], ids[4:]

    def idx(sel):
        block_idx = sel.to(torch.int32).expand(2, 2, -1).contiguous()
        return SparseIndex(1, block_idx, torch.full((2, 2), len(sel), dtype=torch.int32), lens)

    out_a, lse_a = sparse_decode(q, k, v, idx(a_ids))
    out_b, lse_b = sparse_decode(q, k, v, idx(b_ids))
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference_sparse_decode(q, k, v, idx(ids))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_handles_empty_parts_without_nan():
    out_a = torch.randn(2, 3, 4)
    out_b = torch.full((2, 3, 4), float("nan"))  # garbage in an empty part must not leak
    lse_a = torch.randn(2, 3)
    lse_b = torch.full((2, 3), float("-inf"))
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    both, lse2 = merge_states(out_b, lse_b, out_b, lse_b)
    assert (both == 0).all() and torch.isneginf(lse2).all()
    with pytest.raises(ValueError, match="matching shapes"):
        merge_states(out_a, lse_a, out_a[:1], lse_a[:1])


def test_reduce_over_group_semantics():
    s = torch.tensor([[[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]]])  # (B=1, H_q=2, N=3), one group
    assert reduce_over_group(s, 1, reduction="max").tolist() == [[[3.0, 5.0, 1.0]]]
    assert reduce_over_group(s, 1, reduction="mean").tolist() == [[[1.5, 2.5, 0.5]]]
    # softmax_mean: the group's mean attention probability (the mass a selection keeps)
    want = torch.softmax(s[0], -1).mean(0)
    torch.testing.assert_close(reduce_over_group(s, 1, reduction="softmax_mean")[0, 0], want)
    masked_mean = reduce_over_group(s, 1, reduction="softmax_mean", mask=torch.tensor([[True, False, True]]))
    torch.testing.assert_close(masked_mean[0, 0, [0, 2]], torch.softmax(s[0][:, [0, 2]], -1).mean(0))
    assert torch.isneginf(masked_mean[0, 0, 1])
    sm = reduce_over_group(s, 1)
    assert sm.argmax().item() == 1 and math.isclose(sm[0, 0, 0].item(), torch.softmax(s[0, 1], 0)[0].item())
    masked = reduce_over_group(s, 1, mask=torch.tensor([[True, False, True]]))
    assert torch.isneginf(masked[0, 0, 1]) and torch.isfinite(masked[0, 0, [0, 2]]).all()
    # G = 1: same ranking as the raw scores
    raw = torch.randn(2, 4, 9)
    assert torch.equal(reduce_over_group(raw, 4).argsort(-1), raw.argsort(-1))
    with pytest.raises(ValueError, match="reduction must be one of"):
        reduce_over_group(s, 1, reduction="sum")


def test_quest_bound_is_an_upper_bound_and_exact_for_single_token_pages():
    q, k, _, _ = build(case(B=2, H_kv=2, G=2, T_cap=45, seed=3))
    lens = torch.tensor([45, 30])
    mn, mx = page_min_max(k, 16, seq_lens=lens)
    bound = quest_scores(q, mn, mx, reduction="max")  # (B, H_kv, 3)
    exact = pool_blocks(exact_scores(q, k, reduction="max", mask=torch.arange(45)[None] < lens[:, None]), 16)
    assert bound.shape == (2, 2, 3)
    assert (bound >= exact - 1e-5).all()
    mn1, mx1 = page_min_max(k, 1)
    torch.testing.assert_close(quest_scores(q, mn1, mx1, reduction="max"), exact_scores(q, k, reduction="max"))
    assert (mn[1, :, 2] == 0).all()  # page [32, 48) of row 1 has no valid token


def test_label_scores_with_all_channels_equal_exact():
    q, k, _, _ = build(case(B=1, H_kv=2, G=4, T_cap=33))
    channels = torch.arange(64).expand(2, 64)
    labels = build_labels(k, channels)
    torch.testing.assert_close(label_scores(q, labels, channels), exact_scores(q, k))
    few = torch.stack([torch.randperm(64)[:8] for _ in range(2)])
    s = label_scores(q, build_labels(k, few), few, block_size=8)
    assert s.shape == (1, 2, 5) and torch.isfinite(s).all()
    with pytest.raises(ValueError, match=r"channels must have shape \(H_kv, r\)"):
        label_scores(q, labels, channels[:, :3])


def test_landmarks_rank_the_planted_chunk_first():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 64)
    k = torch.randn(1, 2, 64, 64) * 0.1
    k[:, :, 40:48] = q.reshape(1, 2, 2, 64).mean(2, keepdim=True)  # chunk 5 aligned with the group
    lm = chunk_landmarks(k, 8, seq_lens=torch.tensor([60]))
    scores = landmark_scores(q, lm)
    assert scores.shape == (1, 2, 8) and (scores.argmax(-1) == 5).all()
    index = select_topk(scores, 1, block_size=8, seq_lens=torch.tensor([60], dtype=torch.int32))
    assert index.block_idx.flatten().tolist() == [5, 5]
    torch.testing.assert_close(lm[0, 0, 7], k[0, 0, 56:60].mean(0))  # only valid tokens averaged


def test_exact_scores_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"k_cache must have shape \(B, H_kv, N, D\)"):
        exact_scores(torch.randn(1, 4, 64), torch.randn(1, 2, 10, 32))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        exact_scores(torch.randn(1, 3, 64), torch.randn(1, 2, 10, 64))
