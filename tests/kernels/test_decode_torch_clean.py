"""The mask-free CPU path of the torch backend (`kvpress.kernels.torch_fast`).

Clean indices (no padding, every block strictly between the sinks and the tail of every row)
skip positions and masks; these tests check when an index counts as clean, and that the lean
embedding_bag path and the chunked gather path agree with the reference and with the masked
path on the same index, for every cache layout and dtype.
"""
import pytest
import torch
from test_decode_torch_paths import PATHS, _check, _strided

from kvpress.kernels import SparseIndex, sparse_decode
from kvpress.kernels import torch_decode as td
from kvpress.kernels import torch_fast as tf


def clean_case(B=2, H_kv=2, G=3, D=64, T=300, lens=(300, 261), starts=(0, 7), bs=16, K=4, sinks=4, tail=9,
               dtype=torch.float32, seed=0):
    """A clean index: K distinct blocks per (row, KV head) inside every row's middle range."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * G, D, generator=gen).to(dtype)
    k = torch.randn(B, H_kv, T, D, generator=gen).to(dtype)
    v = torch.randn(B, H_kv, T, D, generator=gen).to(dtype)
    first = -(-(max(starts) + sinks) // bs)  # first block after every row's sinks
    last = (min(lens) - tail) // bs  # one past the last block before every row's tail
    assert last - first >= K
    ids = torch.stack([torch.randperm(last - first, generator=gen)[:K] + first for _ in range(B * H_kv)])
    index = SparseIndex(bs, ids.view(B, H_kv, K).to(torch.int32), torch.full((B, H_kv), K, dtype=torch.int32),
                        torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), sinks, tail)
    return q, k, v, index


CLEAN_PATHS = {**PATHS, "bag-large": dict(CLEAN_FUSED_ROWS=0)}  # the embedding_bag path for any size


@pytest.fixture(params=list(CLEAN_PATHS))
def path(request, monkeypatch):
    for name, value in CLEAN_PATHS[request.param].items():
        monkeypatch.setattr(td, name, value)
    return request.param


CLEAN = [
    dict(),
    dict(B=1, lens=(300,), starts=(0,), sinks=0, tail=0, bs=64, K=2, G=4, D=128),  # blocks only
    dict(B=1, lens=(300,), starts=(0,), bs=1, K=40, sinks=4, tail=32, G=8),  # token-level (double_sparsity)
    dict(K=0),  # sinks + tail only
    dict(B=3, lens=(300, 300, 120), starts=(0, 0, 30), bs=8, K=5, sinks=1, tail=1, G=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kw", CLEAN, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()) or "default")
def test_clean_indices_match_reference_and_masked_path(path, kw, dtype, monkeypatch):
    q, k, v, index = clean_case(**kw, dtype=dtype)
    rows = tf.clean_rows(index)
    assert rows == list(zip(index.seq_starts.tolist(), index.seq_lens.tolist()))
    out = _check(q, k, v, index)
    monkeypatch.setattr(td, "USE_CLEAN_CPU", False)
    masked, _ = sparse_decode(q, k, v, index, backend="torch")
    torch.testing.assert_close(out, masked, atol=2e-6 if dtype == torch.float32 else 1e-3, rtol=1e-5)


@pytest.mark.parametrize("k_layout,v_layout", [("capacity", "capacity"), ("transposed", "transposed"),
                                               ("overlap", "overlap"), ("capacity", "transposed")])
def test_clean_strided_caches(path, k_layout, v_layout):
    q, k, v, index = clean_case(T=180, lens=(180, 150), K=3, seed=3)
    assert tf.clean_rows(index) is not None
    _check(q, _strided(k, k_layout), _strided(v, v_layout), index)


def test_unclean_indices_take_the_masked_path():
    q, k, v, index = clean_case()
    bs, ids, cnt, lens, starts = index.block_size, index.block_idx, index.block_cnt, index.seq_lens, index.seq_starts

    def variant(ids=ids, cnt=cnt, lens=lens, starts=starts, sinks=index.sinks, tail=index.dense_tail):
        return SparseIndex(bs, ids.to(torch.int32), cnt.to(torch.int32), lens, starts, sinks, tail)

    padded = ids.clone()
    padded[1, 1, -1] = -1
    sink_block = ids.clone()
    sink_block[0, 0, 0] = 0  # overlaps the sinks
    tail_block = ids.clone()
    tail_block[1, 0, 0] = (int(lens[1]) - 1) // bs  # overlaps row 1's tail
    short = torch.tensor([300, 12], dtype=torch.int32)  # row 1 too short for sinks + tail
    for bad in (variant(padded, cnt - (padded == -1).sum(-1)), variant(sink_block), variant(tail_block),
                variant(lens=short, ids=torch.zeros_like(ids[..., :0]), cnt=torch.zeros_like(cnt))):
        assert tf.clean_rows(bad) is None
        _check(q, k, v, bad)


def test_workspace_grows_and_memo_stays_bounded(monkeypatch):
    monkeypatch.setattr(tf, "_MAX_ENTRIES", 3)
    for K in (2, 9, 1, 5, 9, 3):  # the K workspace grows, then is reused by smaller selections
        q, k, v, index = clean_case(K=K, seed=K)
        out = torch.full_like(q, float("nan"))
        got, _ = sparse_decode(q, k, v, index, backend="torch", out=out)
        assert got.data_ptr() == out.data_ptr()
        _check(q, k, v, index)
        assert len(tf._LOCAL.memo) <= 3


def test_id_range_hint_is_checked_and_used():
    q, k, v, index = clean_case(bs=8, K=3)
    ids = index.block_idx
    lo, hi = int(ids.min()), int(ids.max())
    hinted = SparseIndex(8, ids, index.block_cnt, index.seq_lens, index.seq_starts, index.sinks, index.dense_tail,
                         id_range=(lo, hi))
    hinted.validate(capacity=k.shape[2])
    assert tf.clean_rows(hinted) == tf.clean_rows(index)
    torch.testing.assert_close(sparse_decode(q, k, v, hinted, backend="torch")[0],
                               sparse_decode(q, k, v, index, backend="torch")[0], atol=0, rtol=0)
    assert hinted.to("cpu").id_range == (lo, hi)
    wrong = SparseIndex(8, ids, index.block_cnt, index.seq_lens, index.seq_starts, index.sinks, index.dense_tail,
                        id_range=(lo + 1, hi))
    with pytest.raises(ValueError, match="id_range"):
        wrong.validate()
    # a hint that puts the ids over the sinks or the tail: the masked path
    wide = SparseIndex(8, ids, index.block_cnt, index.seq_lens, index.seq_starts, index.sinks, index.dense_tail,
                       id_range=(0, hi))
    assert tf.clean_rows(wide) is None
    _check(q, k, v, wide)
    for bad in ((1,), (3, 2), (0.5, 2), [0, 2]):
        with pytest.raises(ValueError, match="id_range"):
            SparseIndex(8, ids, index.block_cnt, index.seq_lens, id_range=bad)
