"""One decode step's attention over a ShadowKV-like split store: `attend_rows` (one launch on
CUDA) against `sparse_decode` of each store merged by `merge_states` (the reference path).

    python -m kvpress.evals.bench_rows --device cuda --json results/rows.json

The stores of one (row, KV head): ``--gen`` generated tokens (capacity rounded up to 64),
``--exact`` exact outlier / window tokens and ``--selected`` selected tokens, each with a
per-head count of rows in use (Llama-3-8B attention: H_q 32, H_kv 8, head_dim 128). Both paths are
checked against each other first. Reported: microseconds per call of each, host included -- the
calls are issued back to back and the device synchronised once at the end, as a decode loop
issues them -- because on a host-bound machine the launches, not the device, are the cost
(on an H200 a `full` decode step at 32k spends 7.5 of its 38 ms on the device; BENCHMARKS.md
"End-to-end decode on an H200 at 32k"). On CPU both run their torch / native paths (a check of
the plumbing).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from kvpress.kernels import SparseIndex, merge_states, sparse_decode
from kvpress.kernels.rows import attend_rows


def make_stores(batch: int, gen: int, exact: int, selected: int, *, h_q: int, h_kv: int, d: int, dtype, device,
                seed: int = 0):
    """q and three (k, v, cnt, n) row sets with random counts of rows in use per (row, KV head)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, h_q, d, generator=g).to(device, dtype)
    sets = []
    for n, cap, counted in ((gen, -(-gen // 64) * 64, False), (exact, exact, True), (selected, selected, True)):
        k = torch.randn(batch, h_kv, cap, d, generator=g).to(device, dtype)
        v = torch.randn(batch, h_kv, cap, d, generator=g).to(device, dtype)
        cnt = torch.randint(n // 2, n + 1, (batch, h_kv), generator=g, dtype=torch.int32).to(device) if counted else None
        sets.append((k, v, cnt, n))
    return q, sets


def composed(q, sets, scale):
    """The reference path: each store through `sparse_decode` (its own index), merged."""
    B, dev = q.shape[0], q.device
    out = lse = None
    for k, v, cnt, n in sets:
        c = cnt if cnt is not None else torch.full((B, k.shape[1]), n, dtype=torch.int32, device=dev)
        slots = torch.arange(n, dtype=torch.int32, device=dev)
        index = SparseIndex(1, torch.where(slots < c[..., None], slots, -1), c,
                            torch.full((B,), n, dtype=torch.int32, device=dev))
        o, l = sparse_decode(q, k, v, index, scale=scale, validate_index=False)
        out, lse = (o, l) if out is None else merge_states(out, lse, o, l)
    return out, lse


def _us_per_call(fn, iters: int, warmup: int, sync) -> float:
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t0) / iters


def run(args) -> dict:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        q, sets = make_stores(batch, args.gen, args.exact, args.selected, h_q=args.h_q, h_kv=args.h_kv, d=args.d,
                              dtype=dtype, device=dev)
        scale = 1 / math.sqrt(args.d)
        one, _ = attend_rows(q, sets, scale=scale)
        ref, _ = composed(q, sets, scale)
        err = ((one.float() - ref.float()).norm() / ref.float().norm()).item()
        if not err < 2e-2:
            raise SystemExit(f"attend_rows and the composed path differ (relative error {err:.2e}): not timing")
        t_rows = _us_per_call(lambda: attend_rows(q, sets, scale=scale), args.iters, args.warmup, sync)
        t_comp = _us_per_call(lambda: composed(q, sets, scale), args.iters, args.warmup, sync)
        rows.append({"batch": batch, "attend_rows_us": t_rows, "composed_us": t_comp, "speedup": t_comp / t_rows,
                     "rel_err": err})
    print(f"{args.device}, {dtype}, H_q {args.h_q} H_kv {args.h_kv} D {args.d}; stores: {args.gen} generated, "
          f"{args.exact} exact, {args.selected} selected tokens; us per call, host included")
    print(f"{'batch':>5} {'attend_rows':>12} {'3x sparse_decode + 2 merges':>28} {'speedup':>8} {'rel err':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['attend_rows_us']:>12.1f} {r['composed_us']:>28.1f} {r['speedup']:>8.2f} "
              f"{r['rel_err']:>9.1e}")
    return {"device": args.device, "dtype": str(dtype), "args": vars(args), "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--exact", type=int, default=96)
    parser.add_argument("--selected", type=int, default=1024)
    parser.add_argument("--h-q", type=int, default=32)
    parser.add_argument("--h-kv", type=int, default=8)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    res = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
