"""Fused dequantize-attention decode on a real GPU: fp16/bf16 error at most ~2x plain torch's
error on the same dequantized cache; the kivi layer's CUDA decode path equals its torch path."""
import pytest
import torch
import torch.nn.functional as F

from kvpress.kernels import (dequantize_per_channel, dequantize_per_token, quant_decode, quantize_per_channel,
                             quantize_per_token, reference_quant_decode)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, H_kv, G, T, D, bits, group", [(2, 8, 4, 4096, 128, 4, 32), (1, 2, 8, 1000, 64, 2, 8),
                                                           (3, 3, 3, 64, 64, 4, 64)])
def test_triton_quant_decode_error_within_2x_torch(dtype, B, H_kv, G, T, D, bits, group):
    gen = torch.Generator(device="cuda").manual_seed(T)
    k = torch.randn(B, H_kv, T, D, device="cuda", generator=gen)
    v = torch.randn(B, H_kv, T, D, device="cuda", generator=gen)
    q = torch.randn(B, H_kv * G, D, device="cuda", generator=gen)
    kq, vq = quantize_per_channel(k, bits, group), quantize_per_token(v, bits, group)
    ref, ref_lse = reference_quant_decode(q, *kq, *vq, bits=bits, group_size=group)
    out, lse = quant_decode(q.to(dtype), *kq, *vq, bits=bits, group_size=group, backend="triton")
    assert out.dtype == dtype
    kd = dequantize_per_channel(*kq, bits, group).to(dtype)
    vd = dequantize_per_token(*vq, bits, group).to(dtype)
    plain = F.scaled_dot_product_attention(q.to(dtype)[:, :, None], kd, vd, enable_gqa=True)[:, :, 0]
    torch_err = (plain.float() - ref).abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 1e-4
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits, R", [(4, 8), (4, 16), (2, 32)])
def test_triton_quant_decode_reads_refined_key_channels(dtype, bits, R):
    """zipcache's ``refine_key_channels`` on the GPU: the fused kernel (PTX codes, fp16 tiles) adds
    the second codes as the reference does, within 2x plain torch's error on the same keys."""
    from kvpress.kernels.quant import dequantize_refinement, quantize_refined_keys

    B, H_kv, G, T, D, group = 2, 8, 4, 4096, 128, 32
    gen = torch.Generator(device="cuda").manual_seed(R)
    k = torch.randn(B, H_kv, T, D, device="cuda", generator=gen)
    v = torch.randn(B, H_kv, T, D, device="cuda", generator=gen)
    q = torch.randn(B, H_kv * G, D, device="cuda", generator=gen)
    ch = torch.rand(B, H_kv, D, device="cuda", generator=gen).argsort(-1)[..., :R]
    kc, ks, kz, rc, rs = quantize_refined_keys(k, bits, group, ch)
    vq = quantize_per_token(v, bits, group)
    ref, ref_lse = reference_quant_decode(q, kc, ks, kz, *vq, bits=bits, group_size=group, refine=(rc, rs, ch))
    out, lse = quant_decode(q.to(dtype), kc, ks, kz, *vq, bits=bits, group_size=group, backend="triton",
                            refine=(rc, rs, ch))
    kd = dequantize_per_channel(kc, ks, kz, bits, group)
    kd.scatter_add_(3, ch[:, :, None, :].expand(-1, -1, T, -1), dequantize_refinement(rc, rs, bits, group))
    plain = F.scaled_dot_product_attention(q.to(dtype)[:, :, None], kd.to(dtype),
                                           dequantize_per_token(*vq, bits, group).to(dtype), enable_gqa=True)[:, :, 0]
    torch_err = (plain.float() - ref).abs().max().item()
    assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 1e-4
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-3)


def test_token_quant_values_long_matmul_on_cuda():
    """The torch value read on CUDA (gear's decode) slices its long token axis (`long_matmul`):
    equal to the dequantized product, and to the CPU result, at 32k + 40 tokens."""
    from kvpress.kernels.quant import token_quant_values

    gen = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(1, 2, 32768 + 40, 128, device="cuda", generator=gen)
    p = torch.rand(1, 2, 4, v.shape[2], device="cuda", generator=gen).softmax(-1)  # rows summing to 1, as attention's
    vq = quantize_per_token(v, 4, 32)
    out = token_quant_values(p, *vq, 4, 32, backend="torch")
    ref = p.double() @ dequantize_per_token(*vq, 4, 32).double()
    # the folded read ((p * s) @ codes + p @ zeros) cancels two O(1) sums to a ~0.005 mean here: ~1e-4
    # relative in fp32 on CPU too
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3
    cpu = token_quant_values(p.cpu(), *(t.cpu() for t in vq), 4, 32, backend="torch")
    assert ((out.cpu().double() - cpu.double()).norm() / ref.norm().cpu()).item() < 1e-3


def test_triton_quantize_pack_matches_torch():
    from kvpress.kernels.triton_quant import triton_quantize_pack

    x = torch.randn(2, 4, 256, 128, device="cuda")
    for pc in (True, False):
        ref = (quantize_per_channel if pc else quantize_per_token)(x, 4, 32)
        got = triton_quantize_pack(x, 4, 32, per_channel=pc)
        assert torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2])
        assert (ref[0] != got[0]).float().mean().item() < 1e-3


def test_kivi_cuda_decode_matches_cpu_path():
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvpress
    from conftest import random_ids

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # head_dim 64: the fused kernel runs
    model = LlamaForCausalLM(cfg).eval()
    policy = kvpress.get_policy("kivi", bits=4, group_size=8, residual_length=16)
    ids = random_ids(64)
    outs = []
    for device in ("cpu", "cuda"):
        m = model.to(device)
        with torch.no_grad(), kvpress.apply(m, policy):
            outs.append(m.generate(ids.to(device), max_new_tokens=8, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences.cpu())
    for a, b in zip(outs[0].scores, outs[1].scores):
        torch.testing.assert_close(a, b.cpu(), atol=1e-3, rtol=1e-3)


def test_zipcache_probe_bookkeeping_does_not_synchronize():
    """zipcache chooses the probes it keeps from host-side positions, so a decode step's probe
    update and a flush's saliency never wait for the device (a device boolean mask would cost
    ``nonzero`` synchronizations in every layer and step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvpress

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    policy = kvpress.get_policy("zipcache", group_size=8, value_group_size=8, residual_length=8, flush_size=8,
                                probe_recent=4, probe_random=6)
    layer = kvpress.make_cache(LlamaForCausalLM(cfg).cuda().eval(), policy).layers[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = 48
    q = torch.randn(1, 4, T + 16, 16, device="cuda", generator=gen)
    k, v = torch.randn(2, 1, 2, T, 16, device="cuda", generator=gen)
    layer.update(k, v)
    layer.attend(q[:, :, :T], *layer.take_pending(), 0.25)
    before = list(layer.probe_pos)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(T, T + 16):  # what a decode step does around its attention
            layer.seen += 1
            layer._after_attend(q[:, :, t:t + 1], torch.zeros(1, 4, 1, device="cuda"), t, 0.25)
        sal = layer.saliency(k[:, :, -8:], T - 8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert layer.probe_pos == [p for p in before if p >= layer.n_quant and p < T - 4] + list(range(T + 12, T + 16))
    assert layer.probe_pos_dev.tolist() == layer.probe_pos and torch.isfinite(sal).all()
