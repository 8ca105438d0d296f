"""Prefill attention of the model's sliding-window layers: the two routes kvpress has.

A layer the model slides (Gemma 3, hybrid Qwen) prefills through
`kvpress.attention.sliding_causal_attention`: SDPA in the input dtype over query chunks, each
reading only the keys its window reaches. The other route is the policies' streaming one,
`kvpress.attention.streaming_attention` without sinks (it gathers sinks and ring slots too). Both are checked against each other first; then every route runs interleaved
(``kvpress.evals.bench_kernels.timeit``) and one table is printed::

    python -m kvpress.evals.bench_prefill --threads 1 --lengths 4096,8192 --windows 512,1024 \\
        --chunks 64,128,256,512

Shape: Gemma-3-like attention, 8 query and 4 KV heads of 128 dims, batch 1 (``--heads``,
``--kv-heads``, ``--head-dim``). On CUDA times are CUDA events; on CPU wall clock (``--clock
cpu`` for one thread's CPU time on a shared machine).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvpress.attention import sliding_causal_attention, streaming_attention
from kvpress.evals.bench_kernels import DTYPES, parse_ints, timeit


def streaming_route(q, k, v, window: int):
    """The policies' streaming attention with no sinks: the same visibility, fp32 scores."""
    B, H_kv, _, D = k.shape
    empty = k.new_zeros(B, H_kv, 0, D)
    return streaming_attention(q, empty, empty, torch.zeros(B, 0, dtype=torch.long, device=q.device), k, v,
                               D ** -0.5, q_start=0, row_start=torch.zeros(B, dtype=torch.long, device=q.device),
                               sinks=0, window=window)


def bench(length: int, window: int, chunks: list[int], *, heads: int, kv_heads: int, head_dim: int, dtype,
          device, warmup: int, iters: int, clock: str) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(length + window)
    q = torch.randn(1, heads, length, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(1, kv_heads, length, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    scale = head_dim ** -0.5
    routes = {"streaming": lambda: streaming_route(q, k, v, window)}
    for c in chunks:
        routes[f"sdpa_c{c}"] = lambda c=c: sliding_causal_attention(q, k, v, scale, window=window, query_chunk=c)
    ref = routes["streaming"]().float()
    err = max((fn().float() - ref).abs().max().item() for name, fn in routes.items() if name != "streaming")
    times = timeit(list(routes.values()), torch.device(device), warmup, iters, clock)
    row = {"length": length, "window": window, "dtype": str(dtype).replace("torch.", ""), "max_abs_diff": err}
    row.update({f"{name}_ms": t for name, t in zip(routes, times)})
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m kvpress.evals.bench_prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", default="4096,8192", help="prompt tokens, comma list (k = 1024)")
    p.add_argument("--windows", default="512,1024", help="sliding windows, comma list")
    p.add_argument("--chunks", default="64,128,256,512,1024", help="query chunks of the SDPA route")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    chunks = parse_ints(args.chunks)
    if not chunks or min(chunks) < 1:
        raise SystemExit(f"--chunks must be positive ints, got {args.chunks!r}")
    rows = [bench(n, w, chunks, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype,
                  device=args.device, warmup=args.warmup, iters=args.iters, clock=args.clock)
            for n in parse_ints(args.lengths) for w in parse_ints(args.windows)]
    names = ["streaming"] + [f"sdpa_c{c}" for c in chunks]
    print(f"sliding-window prefill attention, {args.device} {rows[0]['dtype']}, H_q={args.heads} "
          f"H_kv={args.kv_heads} D={args.head_dim}, median ms of {args.iters} (x = streaming / route)")
    print(f"{'length':>7} {'window':>6} " + " ".join(f"{n:>16}" for n in names) + f" {'max |diff|':>10}")
    for r in rows:
        cells = [f"{r[n + '_ms']:9.1f} ({r['streaming_ms'] / r[n + '_ms']:4.2f}x)" for n in names]
        print(f"{r['length']:>7} {r['window']:>6} " + " ".join(f"{c:>16}" for c in cells) + f" {r['max_abs_diff']:10.1e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
