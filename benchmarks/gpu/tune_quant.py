"""Sweep of the fused dequantize-attention decode kernels on a GPU (CUDA only).

    python benchmarks/gpu/tune_quant.py [--out DIR] [--budget-s 240]

Llama-3-8B attention (32 query / 8 KV heads, D=128), key groups of 32 tokens, value groups of
32 channels, fp16 queries. For each kernel variant (session 8's ``parts`` kernel; the ``folded``
kernel with key / value scales folded or dequantized, with or without prefetch) x BLOCK_N x warps
x programs per SM, at 32k tokens, batch 1 and 8: device time per call from CUDA-graph replays
(``graph_timeit``) against bf16 SDPA, each checked against the dequantizing reference first
(relative error, NaN-free). Batch 1 rotates over ``--sets`` copies of its inputs (4-bit at 32k is
42 MB, under an H100's 50 MB L2: one copy would be timed from cache); batch 8 is 336 MB. Then
2-bit for the best 4-bit configurations, and the best configuration at 8k / 32k / 128k.
Ends with a table; ``--out`` gets the rows as JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvpress.kernels.triton_quant as tq
from kvpress.evals.bench_kernels import graph_timeit
from kvpress.kernels.quant import quantize_per_channel, quantize_per_token, reference_quant_decode

HQ, HKV, D, GROUP = 32, 8, 128, 32
# folded variants in order of interest (the sweep stops at its budget)
VARIANTS = [("folded", fk, fv, pf) for fk, fv, pf in ((1, 1, 1), (1, 0, 1), (0, 0, 1), (1, 1, 0), (0, 0, 0), (1, 0, 0))]


def _inputs(B, T, sets, bits, dev):
    out = []
    for i in range(sets):
        g = torch.Generator(device=dev).manual_seed(1000 * B + T + i)
        k = torch.randn(B, HKV, T, D, device=dev, generator=g)
        v = torch.randn(B, HKV, T, D, device=dev, generator=g)
        q = torch.randn(B, HQ, D, device=dev, generator=g).half()
        kq, vq = quantize_per_channel(k, bits, GROUP), quantize_per_token(v, bits, GROUP)
        out.append((q, kq, vq))
        del k, v
    return out


def _dense_inputs(B, T, sets, dev):
    return [(torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16),
             torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16),
             torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16)) for _ in range(sets)]


def _rotating(fns):
    """One callable that runs the next of ``fns`` at each call (captured into the graph in turn)."""
    state = {"i": 0}

    def call():
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()
    return call


def _time_dense(B, T, sets, dev):
    ins = _dense_inputs(B, T, sets, dev)
    fns = [lambda a=a: F.scaled_dot_product_attention(*a, enable_gqa=True) for a in ins]
    (t,) = graph_timeit([_rotating(fns)], dev, reps=4 * len(fns))
    del ins
    return t


def _configure(variant, bn, nw, pps):
    tq.KERNEL, fk, fv, pf = variant
    tq.FOLD_KEYS, tq.FOLD_VALUES, tq.PREFETCH = bool(fk), bool(fv), bool(pf)
    tq.BLOCK_N, tq.NUM_WARPS, tq.PROGRAMS_PER_SM = bn, nw, pps


def _measure(sets, bits, dev):
    """(ms per call, max relative error over the sets) of the configured kernel."""
    err = 0.0
    for q, kq, vq in sets:
        ref, _ = reference_quant_decode(q.float(), *kq, *vq, bits=bits, group_size=GROUP)
        out, _ = tq.triton_quant_decode(q, *kq, *vq, bits=bits, group_size=GROUP)
        e = ((out.float() - ref).norm() / ref.norm()).item()
        err = max(err, e if e == e else float("inf"))
    fns = [lambda s=s: tq.triton_quant_decode(s[0], *s[1], *s[2], bits=bits, group_size=GROUP) for s in sets]
    (t,) = graph_timeit([_rotating(fns)], dev, reps=4 * len(fns))
    return t, err


def _mb(sets):
    q, kq, vq = sets[0]
    return sum(t.numel() * t.element_size() for t in (*kq, *vq)) / 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this many seconds")
    ap.add_argument("--sets", type=int, default=4, help="input copies rotated at batch 1 (L2)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    t_start = time.time()
    rows = []
    dense = {(B, T): _time_dense(B, T, args.sets if B == 1 else 1, dev) for B, T in ((1, 32768), (8, 32768))}
    print(f"dense bf16 SDPA at 32k: B=1 {dense[1, 32768]*1e3:.1f} us, B=8 {dense[8, 32768]*1e3:.1f} us", flush=True)
    inputs = {(1, 4): _inputs(1, 32768, args.sets, 4, dev), (8, 4): _inputs(8, 32768, 1, 4, dev)}

    def run(variant, bn, nw, pps, bits, B):
        _configure(variant, bn, nw, pps)
        sets = inputs[B, bits]
        try:
            t, err = _measure(sets, bits, dev)
        except Exception as exc:  # a configuration that does not compile / fit is reported, not fatal
            print(f"{variant} BN={bn} w={nw} pps={pps} bits={bits} B={B}: {type(exc).__name__}: {str(exc)[:160]}",
                  flush=True)
            return None
        row = dict(kernel=variant[0], fold_k=variant[1], fold_v=variant[2], prefetch=variant[3], block_n=bn,
                   warps=nw, pps=pps, bits=bits, B=B, T=32768, us=t * 1e3, err=err, mb=_mb(sets),
                   x_dense=dense[B, 32768] / t)
        rows.append(row)
        print(f"{variant[0]:6} fk={variant[1]} fv={variant[2]} pf={variant[3]} BN={bn:3} w={nw} pps={pps} "
              f"bits={bits} B={B}: {t*1e3:7.1f} us {row['mb']/(t*1e3)*1e3:6.0f} GB/s x dense {row['x_dense']:5.2f} "
              f"err {err:.1e}", flush=True)
        return row

    for pps in (2, 4):  # the session-8 kernel at its tuned configuration: the baseline
        for B in (1, 8):
            run(("parts", 1, 1, 0), 128, 4, pps, 4, B)
    for variant, bn, nw in itertools.product(VARIANTS, (64, 32, 128), (8, 4)):
        if time.time() - t_start > args.budget_s * 0.6:
            print("sweep stopped: budget", flush=True)
            break
        for pps in (2, 4, 8):
            for B in (1, 8):
                run(variant, bn, nw, pps, 4, B)

    ok = [r for r in rows if r["err"] < 5e-3]
    best4 = sorted({(r["kernel"], r["fold_k"], r["fold_v"], r["prefetch"], r["block_n"], r["warps"], r["pps"])
                    for r in ok if r["B"] == 1},
                   key=lambda c: sum(r["us"] for r in ok if (r["kernel"], r["fold_k"], r["fold_v"], r["prefetch"],
                                                              r["block_n"], r["warps"], r["pps"]) == c))[:4]
    del inputs[8, 4]
    inputs[1, 2] = _inputs(1, 32768, args.sets, 2, dev)
    inputs[8, 2] = _inputs(8, 32768, 1, 2, dev)
    for cfg in best4:
        if time.time() - t_start > args.budget_s * 0.85:
            break
        for B in (1, 8):
            run(tuple(cfg[:4]), *cfg[4:], 2, B)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_quant.json").write_text(json.dumps({"dense_us": {f"{b}x{t}": v * 1e3 for (b, t), v
                                                                                  in dense.items()}, "rows": rows}))
    print("\nbest (sum of B=1 and B=8 times), 32k, fp16 queries, groups of 32:")
    print("| kernel | fold k/v | prefetch | BLOCK_N | warps | pps | bits | B | us | GB/s | x bf16 SDPA | rel err |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    keyf = lambda r: (r["kernel"], r["fold_k"], r["fold_v"], r["prefetch"], r["block_n"], r["warps"], r["pps"])  # noqa: E731
    shown = [r for r in rows if r["kernel"] == "parts" and r["block_n"] == 128 and r["warps"] == 4 and r["pps"] == 2]
    for cfg in best4:
        shown += [r for r in ok if keyf(r) == cfg]
    for r in shown:
        print(f"| {r['kernel']} | {r['fold_k']}/{r['fold_v']} | {r['prefetch']} | {r['block_n']} | {r['warps']} | "
              f"{r['pps']} | {r['bits']} | {r['B']} | {r['us']:.1f} | {r['mb']/r['us']*1e3:.0f} | "
              f"{r['x_dense']:.2f} | {r['err']:.1e} |")
    print(f"dense bf16 SDPA: B=1 {dense[1, 32768]*1e3:.1f} us, B=8 {dense[8, 32768]*1e3:.1f} us; "
          f"{time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
