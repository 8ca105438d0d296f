"""Torch backend of sparse_decode against the reference, SDPA, and its bad-input errors."""
import pytest
import torch
import torch.nn.functional as F

from kvpress.kernels import SparseIndex, reference_sparse_decode, sparse_decode
from kvpress.kernels.triton_decode import triton_sparse_decode
from kvpress_kernel_cases import build, case, case_id

CASES = (
    [case(T_cap=t, lens=[t], block_size=bs, budget=b, sinks=2, tail=3, mode=m)
     for t, bs, b, m in ((1, 1, 1, "random"), (13, 8, 2, "topk"), (67, 16, 3, "random"), (1000, 32, 7, "topk"))]
    + [case(B=2, T_cap=150, lens=[150, 97], starts=[0, 11], block_size=bs, budget=bg, sinks=5, tail=9, seed=bs)
       for bs, bg in ((1, 40), (8, 6), (16, 4), (32, 3), (64, 2))]
    + [case(H_kv=h, G=g, D=d, T_cap=67, mode="topk", budget=3, sinks=1, tail=3, seed=g)
       for h, g, d in ((2, 1, 64), (1, 3, 128), (2, 4, 64), (1, 8, 128), (2, 2, 80))]
    + [case(mode="none"), case(mode="cnt0", budget=3), case(B=2, T_cap=20, lens=[20, 0], budget=2, sinks=2),
       case(mode="none", sinks=3, tail=7), case(B=2, T_cap=70, lens=[70, 50], starts=[0, 9], mode="all",
                                                   block_size=32, sinks=4, tail=6)]
)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_torch_matches_reference(c, dtype):
    c = {**c, "dtype": dtype}
    q, k, v, index = build(c)
    out, lse = sparse_decode(q, k, v, index, backend="torch")
    ref_out, ref_lse = reference_sparse_decode(q, k, v, index)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (out[~finite] == 0).all()
    tol = 1e-5 if dtype == "fp32" else 1e-3  # both compute in fp32 from the same inputs
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", [1, 64])
@pytest.mark.parametrize("G,D", [(1, 64), (4, 128)])
def test_all_blocks_equals_sdpa(bs, G, D):
    q, k, v, index = build(case(B=2, H_kv=2, G=G, D=D, T_cap=67, mode="all", block_size=bs))
    out, _ = sparse_decode(q, k, v, index)
    dense = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]  # (B, H_q, D)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_strided_cache_out_and_scale():
    q, k, v, index = build(case(B=2, T_cap=40, block_size=8, mode="topk", budget=2, sinks=1, tail=2))
    big_k = torch.zeros(2, 2, 64, 64)
    big_k[:, :, :40] = k
    k_view = big_k[:, :, :40]  # non-contiguous token stride, contiguous last dim
    out = torch.empty_like(q)
    got, _ = sparse_decode(q, k_view, v, index, out=out, scale=0.3)
    assert got.data_ptr() == out.data_ptr()
    ref, _ = reference_sparse_decode(q, k, v, index, scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _inputs():
    return build(case(B=1, H_kv=2, G=2, D=64, T_cap=24, block_size=8, budget=2))


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v, i: (q[0], k, v, i, {}), r"q must have shape \(B, H_q, D\)"),
    (lambda q, k, v, i: (q.double(), k, v, i, {}), "float16, bfloat16, float32"),
    (lambda q, k, v, i: (q.half(), k, v, i, {}), "share one dtype"),
    (lambda q, k, v, i: (q, k, v[:, :, :20], i, {}), "same shape"),
    (lambda q, k, v, i: (q[:, :3], k, v, i, {}), r"multiple G \* H_kv of the KV heads \(2\)"),
    (lambda q, k, v, i: (q.repeat(1, 9, 1), k, v, i, {"backend": "triton"}), r"GQA groups of 1\.\.16 .* got 18"),
    (lambda q, k, v, i: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, i, {}), "contiguous last"),
    (lambda q, k, v, i: (q, k, v, "idx", {}), "index must be a SparseIndex"),
    (lambda q, k, v, i: (q, k, v, i, {"backend": "cuda"}), r"backend must be one of \('auto', 'triton', 'torch', 'native'\)"),
    (lambda q, k, v, i: (q, k, v, i, {"out": torch.empty(1, 4, 64, dtype=torch.float16)}), "out must be"),
    (lambda q, k, v, i: (q, k[:, :, :8], v[:, :, :8], i, {}), "seq_lens must be <= capacity=8"),
    (lambda q, k, v, i: (q, k[:, :, :16], v[:, :, :16],
                         SparseIndex(8, torch.tensor([[[0, 2], [1, -1]]], dtype=torch.int32),
                                     torch.tensor([[2, 1]], dtype=torch.int32),
                                     torch.tensor([16], dtype=torch.int32)), {}),
     r"valid block ids must lie in \[0, 2\)"),
])
def test_bad_inputs(mutate, match):
    q, k, v, index, kw = mutate(*_inputs())
    with pytest.raises(ValueError, match=match):
        sparse_decode(q, k, v, index, **kw)


def test_triton_backend_rejects_cpu_and_head_dims(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, index = _inputs()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sparse_decode(q, k, v, index, backend="triton")
    q, k, v, index = build(case(D=80, T_cap=24, block_size=8))
    with pytest.raises(ValueError, match=r"head_dim in \(64, 128\)"):
        triton_sparse_decode(q, k, v, index)
    # auto never picks triton for CPU tensors: it runs (and is right) on the torch path
    out, _ = sparse_decode(q, k, v, index, backend="auto")
    torch.testing.assert_close(out, reference_sparse_decode(q, k, v, index)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_gqa_groups_above_the_compiled_kernels_limit_run_on_torch(backend):
    """G = 16 query heads per KV head (Qwen3-235B's): the torch path (and "auto") take it."""
    q, k, v, index = build(case(B=2, H_kv=2, G=16, D=32, T_cap=40, block_size=8, budget=3))
    out, lse = sparse_decode(q, k, v, index, scale=0.2, backend=backend)
    ref, ref_lse = reference_sparse_decode(q, k, v, index, scale=0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
