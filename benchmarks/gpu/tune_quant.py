"""Sweep of the fused dequantize-attention decode kernels on a GPU (CUDA only).

    python benchmarks/gpu/tune_quant.py [--out DIR] [--budget-s 240]

Llama-3-8B attention (32 query / 8 KV heads, D=128), key groups of 32 tokens, value groups of
32 channels, fp16 queries. ``sweep``: each BLOCK_N x warps x programs per SM x stages (``--block-n`` ...) at 32k tokens, batch
1 and 8, 4- and 2-bit. ``table`` (after the sweep, or alone with ``--table-only``): the
kernel's defaults at 8k / 32k / 128k. ``--forms``: the kernel's ``EARLY_LOADS`` /
``FP32_SCALES`` / ``PTX_CODES`` forms against each other, twice each (the spread between the two is the noise),
at 32k / 128k, batch 1 and 8. Device time per call from CUDA-graph replays
(``graph_timeit``) against bf16 SDPA, each configuration checked against the dequantizing
reference first (relative error, NaN-free). Batch 1 rotates over ``--sets`` copies of its
inputs (4-bit at 32k is 42 MB, under an H100's 50 MB L2: one copy would be timed from cache).
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
from kvpress.evals.bench_kernels import graph_timeit, rotating
from kvpress.kernels.packed_decode import reference_quant_decode
from kvpress.kernels.quant import quantize_per_channel, quantize_per_token

HQ, HKV, D, GROUP = 32, 8, 128, 32


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


def _time_dense(B, T, sets, dev):
    ins = _dense_inputs(B, T, sets, dev)
    fns = [lambda a=a: F.scaled_dot_product_attention(*a, enable_gqa=True) for a in ins]
    (t,) = graph_timeit([rotating(fns)], dev, reps=4 * len(fns))
    del ins
    return t


def _measure(sets, bits, dev):
    """(ms per call, max relative error over the sets) of the kernel as configured."""
    err = 0.0
    for q, kq, vq in sets:
        ref, _ = reference_quant_decode(q.float(), *kq, *vq, bits=bits, group_size=GROUP)
        out, _ = tq.triton_quant_decode(q, *kq, *vq, bits=bits, group_size=GROUP)
        e = ((out.float() - ref).norm() / ref.norm()).item()
        err = max(err, e if e == e else float("inf"))
    fns = [lambda s=s: tq.triton_quant_decode(s[0], *s[1], *s[2], bits=bits, group_size=GROUP) for s in sets]
    (t,) = graph_timeit([rotating(fns)], dev, reps=4 * len(fns))
    return t, err


def _mb(sets):
    q, kq, vq = sets[0]
    return sum(t.numel() * t.element_size() for t in (*kq, *vq)) / 1e6


def _row(rows, dense, sets, bits, B, T, dev, **cfg):
    try:
        t, err = _measure(sets, bits, dev)
    except Exception as exc:  # a configuration that does not compile / fit is reported, not fatal
        print(f"{cfg} bits={bits} B={B} T={T}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return
    row = dict(cfg, bits=bits, B=B, T=T, us=t * 1e3, err=err, mb=_mb(sets), dense_us=dense * 1e3, x_dense=dense / t)
    rows.append(row)
    print(f"{cfg} bits={bits} B={B} T={T}: {t*1e3:7.1f} us {row['mb']/(t*1e3)*1e3:6.0f} GB/s "
          f"x dense {row['x_dense']:5.2f} err {err:.1e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this many seconds")
    ap.add_argument("--sets", type=int, default=4, help="input copies rotated at batch 1 (L2)")
    ap.add_argument("--table-only", action="store_true", help="only the defaults at 8k / 32k / 128k")
    ap.add_argument("--forms", action="store_true", help="only the A/B of the kernel's forms")
    ap.add_argument("--block-n", default="32,64,128", help="sweep: tokens per tile")
    ap.add_argument("--warps", default="4,8", help="sweep: warps per program")
    ap.add_argument("--pps", default="2,8", help="sweep: split-K programs per multiprocessor")
    ap.add_argument("--sweep-batches", default="1,8", help="sweep: batch sizes")
    ap.add_argument("--num-stages", default="2", help="sweep: Triton software-pipelining stages")
    ap.add_argument("--contexts", default="32768,131072", help="--forms: context lengths")
    ap.add_argument("--form-names", default="conversions,default", help=f"forms to compare, of {sorted(FORMS)}")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.forms:
        return forms(args, dev)
    t_start = time.time()
    sweep, table = [], []
    stages = tq.NUM_STAGES
    batches = tuple(map(int, args.sweep_batches.split(",")))
    grid = [tuple(map(int, a.split(","))) for a in (args.block_n, args.warps, args.pps, args.num_stages)]
    if not args.table_only:
        dense = {B: _time_dense(B, 32768, args.sets if B == 1 else 1, dev) for B in batches}
        for bits in (4, 2):
            inputs = {B: _inputs(B, 32768, args.sets if B == 1 else 1, bits, dev) for B in batches}
            for bn, nw, pps, ns in itertools.product(*grid):
                if time.time() - t_start > args.budget_s * 0.5 * (1 + (bits == 2)):
                    print("sweep stopped: budget", flush=True)
                    break
                tq.OVERRIDE, tq.NUM_STAGES = (bn, nw, pps), ns
                for B in batches:
                    _row(sweep, dense[B], inputs[B], bits, B, 32768, dev, block_n=bn, warps=nw, pps=pps, stages=ns)
            del inputs
    tq.OVERRIDE, tq.NUM_STAGES = None, stages
    for T, B in itertools.product((8192, 32768, 131072), (1, 8)):
        if time.time() - t_start > args.budget_s:
            print("table stopped: budget", flush=True)
            break
        sets = args.sets if B * T * 2 * HKV * D * 2 < 4e9 / args.sets and B == 1 else 1
        dense = _time_dense(B, T, sets, dev)
        for bits in (4, 2):
            bn, nw, pps = tq.launch_config(B * HKV, GROUP, bits)
            _row(table, dense, _inputs(B, T, sets, bits, dev), bits, B, T, dev, block_n=bn, warps=nw, pps=pps,
                 stages=tq.NUM_STAGES)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_quant.json").write_text(json.dumps({"sweep": sweep, "table": table}))
    if sweep:
        print("\nfastest at 32k by the sum of the B=1 and B=8 times:")
        for bits in (4, 2):
            tot = {}
            for r in sweep:
                if r["bits"] == bits and r["err"] < 5e-3:
                    k = (r["block_n"], r["warps"], r["pps"], r["stages"])
                    tot[k] = tot.get(k, 0.0) + r["us"]
            for k in sorted(tot, key=tot.get)[:3]:
                print(f"  {bits}-bit BLOCK_N={k[0]} warps={k[1]} pps={k[2]} stages={k[3]}: "
                      + ", ".join(f"B={r['B']} {r['us']:.1f} us ({r['x_dense']:.2f}x)" for r in sweep
                                  if r["bits"] == bits and (r["block_n"], r["warps"], r["pps"], r["stages"]) == k))
    print("\n|  B | context | bits | quant us | dense us | speedup | GB/s | packed MB | rel err |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['B']} | {r['T']} | {r['bits']} | {r['us']:.1f} | {r['dense_us']:.1f} | {r['x_dense']:.2f} | "
              f"{r['mb']/r['us']*1e3:.0f} | {r['mb']:.1f} | {r['err']:.1e} |")
    print(f"defaults: tiles of {tq.TILE_FEW} / {tq.TILE_MANY} tokens up to / over {tq.FEW_PAIRS} (row, KV head) pairs, "
          f"a warp per 32 tokens, {tq.PROGRAMS_PER_SM} programs per SM, {tq.NUM_STAGES} stages; "
          f"{time.time() - t_start:.0f} s", flush=True)


# EARLY_LOADS, FP32_SCALES, PTX_CODES; "conversions" is the form without PTX_CODES
FORMS = {"late_v": (False, False, True), "loads_first": (True, False, True), "conversions": (True, True, False),
         "default": (True, True, True)}


def forms(args, dev):
    """A/B of the kernel's forms (``--form-names``), 4-bit at BLOCK_N 64 and 128, 2-bit at 128."""
    rows = []
    names = args.form_names.split(",")
    for T, B in itertools.product(map(int, args.contexts.split(",")), (1, 8)):
        sets = args.sets if B == 1 else 1
        dense = _time_dense(B, T, sets, dev)
        for bits in (4, 2):
            ins = _inputs(B, T, sets, bits, dev)
            for rep in range(2):
                cells = []
                for name in names:
                    tq.EARLY_LOADS, tq.FP32_SCALES, tq.PTX_CODES = FORMS[name]
                    for bn in ((64, 128) if bits == 4 else (128,)):
                        tq.OVERRIDE = (bn, 4, 8)  # one fixed configuration for every form
                        t, err = _measure(ins, bits, dev)
                        rows.append(dict(form=name, block_n=bn, bits=bits, B=B, T=T, rep=rep, us=t * 1e3, err=err,
                                         dense_us=dense * 1e3))
                        cells.append(f"{name}/{bn} {t*1e3:.1f}us {dense/t:.2f}x")
                print(f"T={T} B={B} bits={bits} dense={dense*1e3:.1f}us rep{rep}: " + " | ".join(cells), flush=True)
            del ins
            torch.cuda.empty_cache()
    tq.EARLY_LOADS = tq.FP32_SCALES = tq.PTX_CODES = True
    tq.OVERRIDE = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_quant_forms.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
