"""Triton sparse_decode on a real GPU: fp16/bf16 error at most ~2x plain torch's error."""
import pytest
import torch
import torch.nn.functional as F

from kvpress.kernels import reference_sparse_decode, sparse_decode
from kvpress_kernel_cases import build, case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_CASES = [
    case(B=2, H_kv=2, G=4, D=128, T_cap=1000, lens=[1000, 613], starts=[0, 7], block_size=16, mode="topk",
         budget=20, sinks=4, tail=32),
    case(B=1, H_kv=8, G=4, D=128, T_cap=4096, block_size=64, mode="all", seed=1),
    case(B=3, H_kv=1, G=8, D=64, T_cap=67, block_size=1, mode="random", budget=40, sinks=3, tail=5, seed=2),
    case(B=2, H_kv=3, G=3, D=64, T_cap=13, block_size=8, mode="none", sinks=2, tail=2, seed=3),
]


def _torch_error(q, k, v, index, ref):
    """Error of plain torch masked SDPA run in the low-precision dtype itself."""
    mask = index.token_mask(k.shape[2])[:, :, None, None, :]  # (B, H_kv, 1, 1, T)
    G = q.shape[1] // k.shape[1]
    mask = mask.expand(-1, -1, G, -1, -1).flatten(1, 2)  # (B, H_q, 1, T)
    dense = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]
    has = mask.any(-1)[..., 0]
    return (dense.float() - ref)[has].abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("i", range(len(GPU_CASES)))
def test_triton_low_precision_error_within_2x_torch(i, dtype):
    q32, k32, v32, index = build(GPU_CASES[i], device="cuda")
    q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
    ref, ref_lse = reference_sparse_decode(q.float(), k.float(), v.float(), index)
    out, lse = sparse_decode(q, k, v, index, backend="triton")
    assert out.dtype == dtype
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        err = (out.float() - ref)[finite].abs().max().item()
        assert err <= 2 * _torch_error(q, k, v, index, ref) + 1e-3 * (dtype == torch.bfloat16) + 1e-4, err
        torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-2, rtol=2e-3)


def test_triton_fp32_and_auto_on_cuda():
    q, k, v, index = build(GPU_CASES[0], device="cuda")
    out, lse = sparse_decode(q, k, v, index, validate_index=False)  # auto -> triton
    ref, ref_lse = reference_sparse_decode(q, k, v, index)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_decode_attention_on_cuda_uses_the_kernel_and_matches_sdpa(dtype, monkeypatch):
    """`dense_causal_attention` sends one-token decode on CUDA to the Triton kernel (left padding
    as seq_starts); its output matches masked SDPA in fp32 within 2x SDPA's own error."""
    import kvpress.kernels as kernels
    from kvpress.attention import dense_causal_attention

    calls = []
    real = kernels.sparse_decode
    monkeypatch.setattr(kernels, "sparse_decode", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 1, 128, generator=gen).cuda()
    k, v = (torch.randn(2, 2, 777, 128, generator=gen).cuda() for _ in range(2))
    row_start = torch.tensor([0, 300], device="cuda")
    mask = (torch.arange(777, device="cuda")[None, :] >= row_start[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    torch_out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                               enable_gqa=True)
    out = dense_causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), 128 ** -0.5, q_start=776,
                                 row_start=row_start)
    assert len(calls) == 1 and out.dtype == dtype and out.shape == q.shape
    err, torch_err = ((x.double() - ref).abs().max().item() for x in (out, torch_out))
    assert err <= 2 * torch_err + (1e-3 if dtype == torch.float32 else 0)  # fp32 dots run in tf32
