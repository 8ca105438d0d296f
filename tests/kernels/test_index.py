"""SparseIndex: construction checks, exact attended counts, dense and top-k constructors."""
import pytest
import torch

from kvpress.kernels import ALLOWED_BLOCK_SIZES, SparseIndex, select_topk, topk_ids
from kvpress_kernel_cases import build, case


def _index(**kw):
    base = dict(block_size=8, block_idx=torch.tensor([[[0, 2, -1]]], dtype=torch.int32),
                block_cnt=torch.tensor([[2]], dtype=torch.int32), seq_lens=torch.tensor([20], dtype=torch.int32))
    base.update(kw)
    return SparseIndex(**base)


@pytest.mark.parametrize("bs", ALLOWED_BLOCK_SIZES)
@pytest.mark.parametrize("sinks,tail", [(0, 0), (3, 0), (0, 5), (4, 9), (40, 40)])
def test_num_attended_equals_mask_count(bs, sinks, tail):
    c = case(B=3, H_kv=2, T_cap=150, lens=[150, 97, 0], starts=[0, 11, 0], block_size=bs,
             budget=60 // bs + 1, sinks=sinks, tail=tail, seed=bs + sinks)
    index = build(c)[3]
    assert torch.equal(index.num_attended(), index.token_mask(150).sum(-1).int())


def test_overlap_counted_once():
    # blocks 0 and 2 of size 8 with 4 sinks and a 6-token tail on 20 tokens:
    # sinks {0..3}, tail {14..19}, block 0 adds {4..7}, block 2 adds {16..19} -> nothing new
    index = _index(sinks=4, dense_tail=6)
    assert index.num_attended().item() == 4 + 6 + 4
    mask = index.token_mask(24)[0, 0]
    assert mask.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 14, 15, 16, 17, 18, 19]


def test_padding_rows_never_attended():
    index = _index(seq_starts=torch.tensor([5], dtype=torch.int32), sinks=2)
    mask = index.token_mask(24)[0, 0]
    assert not mask[:5].any() and not mask[20:].any()
    assert mask[5:7].all()  # sinks count from seq_start


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_dense_selects_everything(bs):
    lens = torch.tensor([1, 13, 67, 0], dtype=torch.int32)
    starts = torch.tensor([0, 3, 10, 0], dtype=torch.int32)
    index = SparseIndex.dense(lens, 3, block_size=bs, seq_starts=starts).validate(capacity=67)
    assert torch.equal(index.num_attended(), (lens - starts)[:, None].expand(4, 3).int())
    fixed = SparseIndex.dense(lens, 3, block_size=bs, seq_starts=starts, capacity=67)
    assert fixed.max_blocks == -(-67 // bs)
    assert torch.equal(fixed.num_attended(), index.num_attended())


def test_select_topk_masks_useless_blocks_and_sorts():
    lens = torch.tensor([40, 40], dtype=torch.int32)
    starts = torch.tensor([0, 16], dtype=torch.int32)
    scores = torch.arange(6, dtype=torch.float32).flip(0).expand(2, 1, 6).clone()  # prefers low ids
    index = select_topk(scores, 3, block_size=8, seq_lens=lens, seq_starts=starts, sinks=8, dense_tail=8)
    index.validate(capacity=48)
    # row 0: block 0 is all sinks, block 4 all tail, 5 beyond seq_len -> best useful are 1, 2, 3
    assert index.block_idx[0, 0].tolist() == [1, 2, 3]
    # row 1: sinks cover [16, 24) = block 2, tail block 4 -> only block 3 is useful
    assert index.block_idx[1, 0].tolist() == [3, -1, -1] and index.block_cnt[1, 0].item() == 1


def test_select_topk_ranks_nan_and_neg_inf_last_but_keeps_them():
    scores = torch.tensor([[[float("nan"), 1.0, float("-inf"), 0.5]]])
    index = select_topk(scores, 4, block_size=1, seq_lens=torch.tensor([4], dtype=torch.int32), sort=False)
    assert index.block_cnt.item() == 4
    assert index.block_idx[0, 0, :2].tolist() == [1, 3]


def test_select_topk_budget_larger_than_blocks_and_zero():
    lens = torch.tensor([10], dtype=torch.int32)
    big = select_topk(torch.randn(1, 2, 2), 100, block_size=8, seq_lens=lens)
    assert big.max_blocks == 2 and big.num_attended().tolist() == [[10, 10]]
    none = select_topk(torch.randn(1, 2, 2), 0, block_size=8, seq_lens=lens, dense_tail=3)
    assert none.max_blocks == 0 and none.num_attended().tolist() == [[3, 3]]


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=4), r"block_size must be one of \(1, 8, 16, 32, 64\)"),
    (dict(sinks=-1), "sinks must be an int >= 0"),
    (dict(dense_tail=1.5), "dense_tail must be an int >= 0"),
    (dict(block_idx=torch.tensor([[[0, 2, -1]]])), "block_idx must be int32"),
    (dict(block_cnt=torch.tensor([2], dtype=torch.int32)), "block_cnt must have 2 dims"),
    (dict(seq_lens=torch.tensor([20, 20], dtype=torch.int32)), r"seq_lens must have shape \(B,\)"),
    (dict(seq_starts=[0]), "seq_starts must be a torch.Tensor"),
])
def test_constructor_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        _index(**kw)


@pytest.mark.parametrize("kw,vkw,match", [
    (dict(block_cnt=torch.tensor([[4]], dtype=torch.int32)), {}, r"block_cnt must lie in \[0, K_max=3\]"),
    (dict(block_idx=torch.tensor([[[0, 2, 5]]], dtype=torch.int32)), {}, "slots at or beyond block_cnt must be -1"),
    (dict(block_idx=torch.tensor([[[0, 3, -1]]], dtype=torch.int32)), dict(capacity=24),
     r"valid block ids must lie in \[0, 3\)"),
    (dict(block_idx=torch.tensor([[[-2, 1, -1]]], dtype=torch.int32)), {}, r"must lie in \[0, inf\)"),
    (dict(block_idx=torch.tensor([[[1, 1, -1]]], dtype=torch.int32)), {}, "distinct"),
    ({}, dict(capacity=16), "seq_lens must be <= capacity=16"),
    (dict(seq_starts=torch.tensor([21], dtype=torch.int32)), {}, r"seq_starts must lie in \[0, seq_len\]"),
    ({}, dict(num_kv_heads=2), "expected num_kv_heads=2"),
])
def test_validate_rejects(kw, vkw, match):
    with pytest.raises(ValueError, match=match):
        _index(**kw).validate(**vkw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 7, 199, 200])
def test_topk_ids_is_the_set_torch_topk_picks(dtype, k):
    """numpy's selection on CPU fp32 / fp64, torch.topk otherwise: the same ids (distinct scores)."""
    scores = torch.randperm(2 * 3 * 200, generator=torch.Generator().manual_seed(k)).view(2, 3, 200).to(dtype)
    scores = scores.transpose(0, 1)  # a non-contiguous view
    ids = topk_ids(scores, k)
    ref = torch.topk(scores.float(), k, dim=-1).indices
    assert ids.dtype == torch.int64 and ids.shape == (3, 2, k)
    assert torch.equal(ids.sort(-1).values, ref.sort(-1).values)


def test_topk_ids_ranks_nan_first_and_neg_inf_last_like_torch_topk():
    scores = torch.tensor([[0.5, float("nan"), float("-inf"), 2.0, float("-inf"), 1.0]])
    assert sorted(topk_ids(scores, 2)[0].tolist()) == [1, 3]
    assert sorted(topk_ids(scores, 4)[0].tolist()) == [0, 1, 3, 5]


def test_topk_ids_rejects_k_out_of_range():
    with pytest.raises(ValueError, match=r"k=5 must be in \[0, 4\]"):
        topk_ids(torch.zeros(2, 4), 5)
