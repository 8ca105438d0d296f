"""Every CPU code path of the torch sparse_decode backend against the reference.

Paths: embedding_bag P @ V (fp32 default), gather K and V + torch's fused CPU attention op,
gather + explicit baddbmm/logsumexp/bmm (what non-CPU devices run), each with several chunks;
cache layouts: contiguous, spare capacity (KVBuffer views), transposed (B, T, H, D) storage,
overlapping rows, K and V with different strides; host vs device row tables.
"""
import pytest
import torch

from kvpress.kernels import SparseIndex, reference_sparse_decode, sparse_decode
from kvpress.kernels import torch_decode as td
from kvpress_kernel_cases import build, case, case_id

PATHS = {
    "bag": dict(USE_BAG_CPU=True, USE_FUSED_CPU=True),
    "fused": dict(USE_BAG_CPU=False, USE_FUSED_CPU=True),
    "explicit": dict(USE_BAG_CPU=False, USE_FUSED_CPU=False),
    "bag-chunked": dict(USE_BAG_CPU=True, CPU_CHUNK_BYTES=1),
    "fused-chunked": dict(USE_BAG_CPU=False, USE_FUSED_CPU=True, CPU_CHUNK_BYTES=1),
}

CASES = [
    case(T_cap=1, block_size=1, budget=1, sinks=2, tail=3),  # everything overlaps one token
    case(T_cap=13, block_size=8, mode="topk", budget=2, sinks=2, tail=3),
    case(H_kv=1, G=3, D=128, T_cap=67, block_size=16, budget=3, sinks=5, tail=9, seed=1),
    case(H_kv=2, G=8, D=64, T_cap=67, block_size=1, mode="topk", budget=40, sinks=1, tail=2, seed=2),
    case(B=3, T_cap=150, lens=[150, 97, 0], starts=[0, 11, 0], block_size=32, budget=3, sinks=4, tail=6, seed=3),
    case(B=2, T_cap=1000, lens=[1000, 613], starts=[5, 0], block_size=64, mode="topk", budget=4, seed=4),
    case(B=2, T_cap=200, lens=[200, 130], block_size=16, mode="cnt0", budget=3, seed=5),  # nothing attended
    case(B=2, T_cap=70, lens=[70, 3], starts=[0, 3], block_size=8, budget=5, sinks=2, tail=2, seed=6),  # empty row
    case(B=2, T_cap=64, lens=[64, 40], block_size=8, mode="all", sinks=3, tail=5, seed=7),
]


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(td, name, value)
    return request.param


def _check(q, k, v, index, **kw):
    out, lse = sparse_decode(q, k, v, index, backend="torch", **kw)
    ref_out, ref_lse = reference_sparse_decode(q.float(), k.float(), v.float(), index)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (out[~finite] == 0).all()
    tol = 2e-5 if q.dtype == torch.float32 else 2e-3  # fp32 math on the same (rounded) inputs
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-5, rtol=2e-5)
    return out


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_paths_match_reference(path, c, dtype):
    _check(*build({**c, "dtype": dtype}))


def _strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Same values as ``x`` (B, H, T, D) in another storage layout."""
    B, H, T, D = x.shape
    if layout == "capacity":  # KVBuffer.keys: a prefix view of a bigger buffer
        big = torch.randn(B, H, T + 37, D, dtype=x.dtype)
        big[:, :, :T] = x
        return big[:, :, :T]
    if layout == "transposed":  # (B, T, H, D) storage
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "overlap":  # head stride not a multiple of D: the row view overlaps
        hs = T * D + 3
        base = torch.randn(B * H * hs, dtype=x.dtype)
        y = base.as_strided((B, H, T, D), (H * hs, hs, D, 1))
        y.copy_(x)
        return y
    raise ValueError(layout)


@pytest.mark.parametrize("k_layout,v_layout", [("capacity", "capacity"), ("transposed", "transposed"),
                                               ("overlap", "overlap"), ("capacity", "transposed"),
                                               ("transposed", "overlap")])
def test_strided_caches(path, k_layout, v_layout):
    c = case(B=2, H_kv=2, G=3, T_cap=90, lens=[90, 71], starts=[0, 4], block_size=16, budget=3, sinks=2,
             tail=5, seed=11)
    q, k, v, index = build(c)
    ks, vs = _strided(k, k_layout), _strided(v, v_layout)
    assert torch.equal(ks, k) and torch.equal(vs, v) and not vs.is_contiguous()
    _check(q, ks, vs, index)


def test_out_argument_and_fresh_output(path):
    q, k, v, index = build(case(B=2, T_cap=50, block_size=8, mode="topk", budget=2, sinks=1, tail=4))
    out = torch.full_like(q, float("nan"))
    got, lse = sparse_decode(q, k, v, index, backend="torch", out=out)
    assert got.data_ptr() == out.data_ptr()
    fresh, lse2 = sparse_decode(q, k, v, index, backend="torch")
    assert fresh.data_ptr() != out.data_ptr()
    torch.testing.assert_close(fresh, out, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse2, atol=0, rtol=0)


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_host_and_device_row_tables_agree(c):
    index = build(c)[3]
    host, any_empty, maybe_nothing = td._row_table_host(index)
    dev, _, _ = td._row_table_device(index)
    assert torch.equal(host, dev)
    lo, hi = host[:, 2::2], host[:, 3::2]  # (B, 3) inclusive bounds per segment
    empty = lo == td._EMPTY
    assert torch.equal(empty, hi == td._EMPTY) and (lo[~empty] <= hi[~empty]).all()
    has_slots = torch.tensor([index.sinks > 0, index.dense_tail > 0, index.max_blocks > 0])
    assert any_empty == bool((empty & has_slots).any())  # the host flags are exact
    assert maybe_nothing == bool((empty[:, 0] & empty[:, 1]).any())


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_selected_positions_are_the_token_mask(c):
    index = build(c)[3]
    pos, valid = td.selected_positions(index)
    V = index.sinks + index.dense_tail + index.max_blocks * index.block_size
    assert pos.shape == valid.shape == (index.batch_size, index.num_kv_heads, V)
    assert (pos[~valid] == 0).all()
    mask = index.token_mask(c["T_cap"])
    got = torch.zeros_like(mask, dtype=torch.long)
    got.scatter_add_(2, pos, valid.long())  # each attended token exactly once
    assert torch.equal(got, mask.long())
    assert torch.equal(valid.sum(-1).int(), index.num_attended())


def test_constant_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(td, "_MAX_CACHE", 4)
    monkeypatch.setattr(td, "_CACHE", {})
    for k_max in range(1, 9):  # K_max grows with the context
        q, k, v, _ = build(case(T_cap=80, block_size=8))
        index = SparseIndex(8, torch.arange(k_max, dtype=torch.int32).expand(1, 2, k_max).contiguous(),
                            torch.full((1, 2), k_max, dtype=torch.int32), torch.tensor([80], dtype=torch.int32))
        _check(q, k, v, index)
        assert len(td._CACHE) <= 4


def test_bench_smollm2_shape_sinks_tail_and_baseline(tmp_path):
    from kvpress.evals.bench_kernels import main

    rows = main(["--device", "cpu", "--shape", "smollm2", "--contexts", "1k", "--budgets", "256", "--sinks", "4",
                 "--tail", "64", "--warmup", "0", "--iters", "1", "--baseline", td.__file__, "--out", str(tmp_path)])
    assert [r["budget"] for r in rows] == ["256", "all"]
    assert all(r["sparse_ms"] > 0 and r["base_ms"] > 0 and r["dense_ms"] > 0 for r in rows)
    # 4 sinks + 64 tail + 4 blocks of 64 (a chosen block that overlaps the sinks counts once)
    assert (4 + 64 + 256 - 4) / 1024 <= rows[0]["budget_ratio"] <= (4 + 64 + 256) / 1024


@pytest.mark.parametrize("T,bs,sinks,tail", [(64, 8, 0, 0), (67, 16, 3, 5), (1000, 64, 4, 64)])
def test_whole_cache_selection_is_plain_attention(path, T, bs, sinks, tail):
    q, k, v, index = build(case(B=2, H_kv=2, G=4, T_cap=T, block_size=bs, mode="all", sinks=sinks, tail=tail))
    assert td._selects_whole_cache(index, T)
    fewer = (index.block_cnt - 1).to(torch.int32)  # one block short: not everything
    assert not td._selects_whole_cache(SparseIndex(bs, index.block_idx, fewer, index.seq_lens, None, sinks, tail), T)
    short = torch.tensor([T, T - 1], dtype=torch.int32)  # one row shorter than the cache
    assert not td._selects_whole_cache(SparseIndex(bs, index.block_idx, index.block_cnt, short, None, sinks, tail), T)
    _check(q, k, v, index)
    out = sparse_decode(q, k, v, index, backend="torch")[0]
    dense = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
