"""Where does the per-call time of sparse_decode / quant_decode go on a GPU? (CUDA only)

    python benchmarks/gpu/probe_launch.py

For each context and index: host time per eager call (launches queued without a sync), host +
device time per call, and device time alone from CUDA-graph replays; then a cProfile of the
sparse_decode launcher.
"""
import cProfile, pstats, io, time, torch
import torch.nn.functional as F
from kvpress.kernels import SparseIndex, select_topk, sparse_decode
from kvpress.kernels.checks import check_decode_inputs
from kvpress.kernels.packed_decode import quant_decode
from kvpress.kernels.quant import quantize_per_channel, quantize_per_token
from kvpress.evals.bench_kernels import graph_timeit

dev = "cuda"
B, Hq, Hkv, D = 1, 32, 8, 128
def host(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    return (t1 - t) / n * 1e6, (t2 - t) / n * 1e6
def graph_us(fn):
    return graph_timeit([fn], torch.device(dev))[0] * 1e3


for T in (8192, 32768, 131072):
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.float16)
    k = torch.randn(B, Hkv, T, D, device=dev, dtype=torch.float16); v = torch.randn_like(k)
    lens = torch.full((B,), T, dtype=torch.int32, device=dev)
    for budget in (1024, None):
        idx = (SparseIndex.dense(lens, Hkv, block_size=64, capacity=T) if budget is None else
               select_topk(torch.rand(B, Hkv, T // 64, device=dev), budget // 64, block_size=64, seq_lens=lens))
        out = torch.empty_like(q)
        fns = {
            "sparse_decode": lambda: sparse_decode(q, k, v, idx, out=out, validate_index=False),
            "check_inputs": lambda: check_decode_inputs(q, k, v, idx, out, False),
            "sdpa_grouped": lambda: F.scaled_dot_product_attention(q.view(B, Hkv, -1, D), k, v),
            "sdpa_gqa": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True),
            "empty_x3": lambda: (torch.empty(B, Hq, 8, D, device=dev), torch.empty(B, Hq, 8, device=dev), torch.empty(B, Hq, device=dev)),
        }
        for name, fn in fns.items():
            h, tot = host(fn)
            g = graph_us(fn) if name in ("sparse_decode", "sdpa_grouped", "sdpa_gqa") else float("nan")
            print(f"T={T:>6} budget={str(budget):>5} {name:<14} host {h:8.1f} us/call  host+gpu {tot:8.1f} us/call  graph {g:8.1f} us", flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(300): sparse_decode(q, k, v, idx, out=out, validate_index=False)
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue())
# quant
for T in (32768, 131072):
    kk = torch.randn(1, Hkv, T, D, device=dev); vv = torch.randn_like(kk)
    kq = quantize_per_channel(kk, 4, 32); vq = quantize_per_token(vv, 4, 32)
    q = torch.randn(1, Hq, D, device=dev, dtype=torch.float16)
    fn = lambda: quant_decode(q, *kq, *vq, bits=4, group_size=32, backend="triton")
    h, tot = host(fn); g = graph_us(fn)
    print(f"quant T={T} host {h:.1f} host+gpu {tot:.1f} graph {g:.1f} us", flush=True)
