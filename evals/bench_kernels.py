"""Benchmark `kvpress.kernels.sparse_decode` against dense SDPA decode.

Checks correctness against the reference first, then prints one fixed-width table and writes
``bench_kernels.json`` / ``bench_kernels.csv`` under ``--out``.

GPU (default when CUDA is present; triton backend, fp16)::

    python -m kvpress.evals.bench_kernels --device cuda --out results/
    # Llama-3-8B attention: H_q=32, H_kv=8, D=128; contexts 4k..128k, batch 1..32, budgets 256..4096

Targets: >= 80% of device copy bandwidth at >= 32k; the all-blocks index within 1.1x of dense
SDPA; speedup within 1.5x of the ideal context/budget ratio at 32k. On CUDA ``sparse_ms`` and
``dense_ms`` are device time from CUDA-graph replays (`graph_timeit`), and ``eager_ms`` is one
eager call between events (it adds the launcher's host time). H100 results: BENCHMARKS.md,
"Block-sparse decode kernel against SDPA on an H100".

CPU (torch backend, fp32, batch 1, contexts 8k..32k)::

    python -m kvpress.evals.bench_kernels --device cpu --out results/

Target: sparse/dense time ratio within 2x of budget/context. On a shared machine use one thread
and thread CPU time (``--threads 1 --clock cpu``). ``--shape smollm2`` times the SmolLM2 decode
shape the policies run (H_q=9, H_kv=3, D=64), ``--sinks`` / ``--tail`` add always-attended
tokens, and ``--baseline FILE`` times another ``torch_sparse_decode`` (e.g. an older
``kernels/torch_decode.py`` from ``git show``) in the same run::

    python -m kvpress.evals.bench_kernels --device cpu --threads 1 --clock cpu --shape smollm2 \
        --contexts 4k,8k --budgets 256 --sinks 4 --tail 64 --baseline /tmp/torch_decode_old.py
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpress.kernels import SparseIndex, reference_sparse_decode, select_topk, sparse_decode

H_Q, H_KV, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention
# (H_q, H_kv, head_dim) per --shape; smollm2 is the SmolLM2 decode shape the policies run
SHAPES = {"llama3-8b": (H_Q, H_KV, HEAD_DIM), "smollm2": (9, 3, 64)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
COLUMNS = [("B", 3, "d"), ("context", 7, "d"), ("budget", 7, "s"), ("sparse_ms", 9, ".3f"),
           ("dense_ms", 9, ".3f"), ("eager_ms", 8, ".3f"), ("read_MB", 8, ".1f"), ("GB/s", 7, ".1f"), ("%copy", 6, ".0f"),
           ("speedup", 8, ".2f"), ("ideal", 7, ".1f"), ("time_ratio", 10, ".4f"),
           ("budget_ratio", 12, ".4f"), ("target", 7, "s")]


CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}


def _time_once(fn, device: torch.device, clock: str = "wall") -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = CLOCK[clock]()
    fn()
    return (CLOCK[clock]() - t0) * 1e3


def timeit(fns, device: torch.device, warmup: int, iters: int, clock: str = "wall") -> list[float]:
    """Median time in ms of each function (CUDA events on GPU; on CPU ``clock``: "wall" =
    perf_counter, "cpu" = this thread's CPU time, robust to preemption on a shared machine but
    only meaningful with one thread).

    The functions run interleaved (a, b, a, b, ...) so that on a shared machine both see the
    same background load.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            ts.append(_time_once(fn, device, clock))
    return [statistics.median(ts) for ts in times]


L2_BYTES = 50e6  # an H100's L2; inputs smaller than a few times this are read from cache in replays


def copies_beyond_l2(nbytes: float, most: int = 4) -> int:
    """How many copies of a ``nbytes`` working set to rotate over so that consecutive calls do not
    find their inputs in a GPU's L2 (at least ~3x its size in all, at most ``most`` copies)."""
    return max(1, min(most, int(-(-3 * L2_BYTES // max(1.0, nbytes)))))


def rotating(fns):
    """One callable that runs the next of ``fns`` (the same call on different copies of its
    inputs) at each call; captured into a graph, the copies alternate in the replays."""
    state = {"i": 0}

    def call():
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()
    return call


def graph_timeit(fns, device: torch.device, reps: int = 20, replays: int = 9) -> list[float]:
    """CUDA only: device time per call in ms of each function, the median over ``replays`` replays
    of one CUDA graph that holds ``reps`` back-to-back calls. Host-side launch cost is left out
    (it is what `timeit`'s eager figure adds); inputs are the same each call, so a working set
    that fits in L2 (under ~50 MB on an H100) is read from cache."""
    times = []
    for fn in fns:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up (Triton compiles, cuBLAS / cuDNN pick kernels) off the graph
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        per_call = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / reps)
        times.append(statistics.median(per_call))
        del graph
    return times


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int, iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    (ms,) = timeit([lambda: dst.copy_(src)], device, warmup, iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense decode baseline: torch SDPA, in the form that is fastest on the device.

    CPU: the G query heads of a group as G query rows, ``(B, H_q, D) -> (B, H_kv, G, D)`` (exact
    for one decode token; ``enable_gqa=True`` was ~3.5x slower on CPU here). CUDA: one query row
    per head with ``enable_gqa=True`` -- on an H100 (2026-11-22, torch 2.11) the grouped form ran
    at 0.37 ms for B=1 at 32k against 0.051 ms for this one (``scratch`` probe, BENCHMARKS).
    """
    B, H_q, D = q.shape
    if q.is_cuda:
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True).view(B, H_q, D)
    out = F.scaled_dot_product_attention(q.view(B, k.shape[1], -1, D), k, v)  # (B, H_kv, G, D)
    return out.view(B, H_q, D)


def check_correctness(device: torch.device, backend: str, dtype: torch.dtype,
                      heads: tuple[int, int, int] = SHAPES["llama3-8b"]) -> float:
    """Max abs error against the fp32 reference on a small odd-sized GQA case; exits on failure."""
    H_Q, H_KV, HEAD_DIM = heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, H_Q, HEAD_DIM, generator=gen).to(device, dtype)
    k = torch.randn(2, H_KV, 1000, HEAD_DIM, generator=gen).to(device, dtype)
    v = torch.randn(2, H_KV, 1000, HEAD_DIM, generator=gen).to(device, dtype)
    lens = torch.tensor([1000, 613], dtype=torch.int32, device=device)
    index = select_topk(torch.randn(2, H_KV, 63, generator=gen).to(device), 9, block_size=16,
                        seq_lens=lens, sinks=4, dense_tail=32)
    out, _ = sparse_decode(q, k, v, index, backend=backend)
    ref, _ = reference_sparse_decode(q.float(), k.float(), v.float(), index)
    err = (out.float() - ref).abs().max().item()
    dense = dense_decode(q, k, v).float()
    full = SparseIndex.dense(torch.full_like(lens, 1000), H_KV, block_size=16)
    err = max(err, (dense - reference_sparse_decode(q.float(), k.float(), v.float(), full)[0]).abs().max().item())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not err <= tol:
        sys.exit(f"correctness check failed: {backend} max abs error {err:.3g} > {tol}")
    return err


def bench_one(B: int, context: int, budget: int | None, *, device, dtype, backend, block_size, warmup, iters,
              copy_gbps, caches, clock="wall", heads: tuple[int, int, int] = SHAPES["llama3-8b"],
              sinks: int = 0, tail: int = 0, baseline=None) -> dict:
    """One row: sparse decode with ``budget`` tokens (None = every block) vs dense SDPA.

    ``budget`` counts block tokens; ``sinks`` / ``tail`` add always-attended tokens (the
    accounting columns use the exact `SparseIndex.num_attended`). ``baseline``: another
    ``torch_sparse_decode``-like function timed in the same run (``base_ms`` / ``base_ratio``).
    """
    H_Q, H_KV, HEAD_DIM = heads
    key = (B, context, heads)
    if key not in caches:
        caches.clear()  # keep one context's cache resident at a time
        gen = torch.Generator(device=device).manual_seed(B * 7919 + context)
        shape = (B, H_KV, context, HEAD_DIM)
        caches[key] = tuple(torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(2)) + (
            torch.randn(B, H_Q, HEAD_DIM, generator=gen, device=device, dtype=dtype),)
    k, v, q = caches[key]
    lens = torch.full((B,), context, dtype=torch.int32, device=device)
    if budget is None:
        index = SparseIndex.dense(lens, H_KV, block_size=block_size, capacity=context)
    else:
        scores = torch.rand(B, H_KV, -(-context // block_size), device=device)
        index = select_topk(scores, budget // block_size, block_size=block_size, seq_lens=lens,
                            sinks=sinks, dense_tail=tail)
    index.validate(num_kv_heads=H_KV, capacity=context)
    out = torch.empty_like(q)
    sparse = lambda: sparse_decode(q, k, v, index, backend=backend, out=out, validate_index=False)  # noqa: E731
    dense = lambda: dense_decode(q, k, v)  # noqa: E731
    if baseline is None:
        sparse_ms, dense_ms = timeit([sparse, dense], device, warmup, iters, clock)
        eager_ms = sparse_ms
        if device.type == "cuda":  # device time from graph replays; the eager figure keeps the launch cost
            sparse_ms, dense_ms = graph_timeit([sparse, dense], device)
        base_ms = None
    else:
        # each sparse variant runs right after a dense pass, so both see the same cold caches
        base = lambda: baseline(q, k, v, index, out=out, validate_index=False)  # noqa: E731
        d1, base_ms, d2, sparse_ms = timeit([dense, base, dense, sparse], device, warmup, iters, clock)
        dense_ms = (d1 + d2) / 2
        eager_ms = sparse_ms
    attended = int(index.num_attended().sum())
    elt = k.element_size()
    read = 2 * attended * HEAD_DIM * elt + 2 * q.numel() * elt + index.block_idx.numel() * 4
    gbps = read / (sparse_ms * 1e-3) / 1e9
    per_head = attended / (B * H_KV)
    ideal = context / per_head
    time_ratio, budget_ratio = sparse_ms / dense_ms, per_head / context
    if budget is None:
        target = "ok" if sparse_ms <= 1.1 * dense_ms else "miss"  # all blocks within 1.1x of dense
    elif device.type == "cuda":
        target = "ok" if dense_ms / sparse_ms >= ideal / 1.5 else "miss"
    else:
        target = "ok" if time_ratio <= 2 * budget_ratio else "miss"
    return {"device": device.type, "backend": backend, "dtype": str(dtype).replace("torch.", ""),
            "block_size": block_size, "B": B, "context": context, "budget": "all" if budget is None else str(budget),
            "sparse_ms": sparse_ms, "dense_ms": dense_ms, "eager_ms": eager_ms, "read_MB": read / 1e6, "GB/s": gbps,
            "%copy": 100 * gbps / copy_gbps, "speedup": dense_ms / sparse_ms, "ideal": ideal,
            "time_ratio": time_ratio, "budget_ratio": budget_ratio, "target": target,
            **({} if base_ms is None else {"base_ms": base_ms, "base_ratio": base_ms / dense_ms})}


def table(rows: list[dict]) -> str:
    cols = COLUMNS + ([("base_ms", 8, ".3f"), ("base_ratio", 10, ".4f")] if rows and "base_ms" in rows[0] else [])
    head = " ".join(f"{name:>{w}}" for name, w, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{r[name]:>{w}{fmt}}" for name, w, fmt in cols))
    return "\n".join(lines)


def load_baseline(path: str):
    """``torch_sparse_decode`` from a source file written as a module of `kvpress.kernels`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvpress.kernels._bench_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # relative imports resolve inside kvpress.kernels
    return module.torch_sparse_decode


def parse_ints(text: str) -> list[int]:
    return [int(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1) for x in text.split(",")]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", help="comma list, k = 1024 (default: cuda 4k..128k, cpu 8k,16k,32k)")
    p.add_argument("--budgets", default="256,1024,4096", help="tokens per KV head per step")
    p.add_argument("--batches", help="comma list (default: cuda 1,8,32; cpu 1)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), help="default: fp16 on cuda, fp32 on cpu")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="CPU timer: wall (perf_counter) or cpu (thread CPU time; use with --threads 1)")
    p.add_argument("--shape", choices=list(SHAPES), default="llama3-8b",
                   help="attention shape: llama3-8b (H_q=32, H_kv=8, D=128) or smollm2 (9, 3, 64)")
    p.add_argument("--sinks", type=int, default=0, help="always-attended first tokens")
    p.add_argument("--tail", type=int, default=0, help="always-attended last tokens")
    p.add_argument("--baseline", default=None,
                   help="file defining torch_sparse_decode (e.g. an older kernels/torch_decode.py from git show) "
                        "to time in the same run: adds base_ms / base_ratio")
    p.add_argument("--out", default=None, help="directory for bench_kernels.json / .csv")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda requested but CUDA is not available")
    dtype = DTYPES[args.dtype or ("fp16" if cuda else "fp32")]
    backend = "triton" if cuda else "torch"
    contexts = parse_ints(args.contexts or ("4k,8k,16k,32k,64k,128k" if cuda else "8k,16k,32k"))
    batches = parse_ints(args.batches or ("1,8,32" if cuda else "1"))
    budgets = parse_ints(args.budgets)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    iters = args.iters if args.iters is not None else (50 if cuda else 7)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        sys.exit("--clock cpu measures one thread: add --threads 1")
    torch.manual_seed(0)

    heads = SHAPES[args.shape]
    baseline = None if args.baseline is None else load_baseline(args.baseline)
    err = check_correctness(device, backend, dtype, heads)
    copy_gbps = copy_bandwidth(device, 1 << 30 if cuda else 1 << 26, warmup, iters)
    print(f"# device={torch.cuda.get_device_name(device) if cuda else 'cpu'} threads={torch.get_num_threads()} "
          f"backend={backend} dtype={dtype} block_size={args.block_size} H_q={heads[0]} H_kv={heads[1]} D={heads[2]} "
          f"sinks={args.sinks} tail={args.tail} clock={'cuda-events' if cuda else args.clock}")
    print(f"# correctness: max abs error vs fp32 reference {err:.2e}; copy bandwidth {copy_gbps:.1f} GB/s; "
          f"load average {os.getloadavg()[0]:.1f}")

    rows, caches = [], {}
    for B in batches:
        for context in contexts:
            need = 2 * B * heads[1] * context * heads[2] * torch.empty(0, dtype=dtype).element_size()
            if cuda and need > 0.4 * torch.cuda.mem_get_info(device)[0]:
                print(f"# skip B={B} context={context}: cache needs {need / 2**30:.1f} GiB")
                continue
            for budget in [b for b in budgets if b < context] + [None]:
                rows.append(bench_one(B, context, budget, device=device, dtype=dtype, backend=backend,
                                      block_size=args.block_size, warmup=warmup, iters=iters,
                                      copy_gbps=copy_gbps, caches=caches, clock=args.clock, heads=heads,
                                      sinks=args.sinks, tail=args.tail, baseline=baseline))
    caches.clear()
    print(table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"copy_GBps": copy_gbps, "threads": torch.get_num_threads(), "clock": args.clock,
                "load_average": os.getloadavg()[0], "correctness_max_abs_err": err, "argv": sys.argv[1:] if argv is None else argv}
        (out / "bench_kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        with open(out / "bench_kernels.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
            writer.writeheader()
            writer.writerows(rows)
        print(f"# wrote {out / 'bench_kernels.json'} and {out / 'bench_kernels.csv'}")
    return rows


if __name__ == "__main__":
    main()
