"""Launch-configuration sweep of the fused dequantize-attention decode kernel. (CUDA only)

    python benchmarks/gpu/tune_quant.py

Times `quant_decode` (4- and 2-bit, group 32, B=1, 32k tokens, Llama-3-8B heads) from CUDA-graph
replays for each (BLOCK_N, num_warps, num_stages, programs per SM), against bf16 SDPA, checks
each against the dequantizing reference, then runs ``bench_quant kernel`` (8k-128k, batch 1
and 8) with the configuration fastest over both bit widths. Session 8's H100 sweep set the
defaults in kernels/triton_quant.py (BENCHMARKS "Session 8").
"""
import itertools, torch, torch.nn.functional as F
import kvpress.kernels.triton_quant as tq
from kvpress.kernels.quant import quant_decode, quantize_per_channel, quantize_per_token, reference_quant_decode
from kvpress.evals.bench_kernels import graph_timeit
dev = torch.device("cuda")
B, Hq, Hkv, D, T = 1, 32, 8, 128, 32768
k = torch.randn(B, Hkv, T, D, device=dev); v = torch.randn_like(k)
q = torch.randn(B, Hq, D, device=dev, dtype=torch.float16)
kd, vd = k.bfloat16(), v.bfloat16()
(dense,) = graph_timeit([lambda: F.scaled_dot_product_attention(q.bfloat16()[:, :, None], kd, vd, enable_gqa=True)], dev)
print(f"dense bf16 SDPA {dense*1e3:.1f} us", flush=True)
packs = {bits: (quantize_per_channel(k, bits, 32), quantize_per_token(v, bits, 32)) for bits in (4, 2)}
rows = []
for bits in (4, 2):
    kq, vq = packs[bits]
    ref, _ = reference_quant_decode(q.float(), *kq, *vq, bits=bits, group_size=32)
    mb = sum(t.numel() * t.element_size() for t in (*kq, *vq)) / 1e6
    for bn, nw, ns, pps in itertools.product((32, 64, 128), (4, 8), (2, 3), (2,)):
        tq.BLOCK_N, tq.NUM_WARPS, tq.NUM_STAGES, tq.PROGRAMS_PER_SM = bn, nw, ns, pps
        try:
            out, _ = quant_decode(q, *kq, *vq, bits=bits, group_size=32, backend="triton")
            err = (out.float() - ref).abs().max().item()
            (t,) = graph_timeit([lambda: quant_decode(q, *kq, *vq, bits=bits, group_size=32, backend="triton")], dev)
        except Exception as exc:  # noqa
            print(f"bits={bits} BLOCK_N={bn} warps={nw} stages={ns} pps={pps}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        rows.append((t, bits, bn, nw, ns, pps, err))
        print(f"bits={bits} BLOCK_N={bn:>3} warps={nw} stages={ns} pps={pps}: {t*1e3:7.1f} us  {mb/(t*1e3)*1e3:7.1f} GB/s  "
              f"x dense {dense/t:5.2f}  err {err:.1e}", flush=True)
for bits in (4, 2):
    best = min(r for r in rows if r[1] == bits)
    print("BEST", bits, "bit:", best)
cfgs = {}
for t, bits, *cfg, err in rows:
    cfgs.setdefault(tuple(cfg), 0.0)
    cfgs[tuple(cfg)] += t
best = min(cfgs, key=cfgs.get)
print("BEST for both (BLOCK_N, warps, stages, pps):", best, flush=True)
tq.BLOCK_N, tq.NUM_WARPS, tq.NUM_STAGES, tq.PROGRAMS_PER_SM = best
del k, v, kd, vd, packs
torch.cuda.empty_cache()
import sys
from kvpress.evals import bench_quant
sys.argv = ["bench_quant", "kernel", "--device", "cuda", "--contexts", "8k,32k,128k", "--batches", "1,8"]
bench_quant.main()
