"""What a CUDA launch of the fused quantized decode compiles to, read on any machine (no GPU).

    python benchmarks/gpu/sass_quant.py [--bits 4] [--batch 1] [--tile 64 --warps 2 --pps 16] [--stages 3] [--no-ptx]

Runs the launcher (`kvpress.kernels.triton_quant.triton_quant_decode`) on CPU tensors of the
sweep's shapes (Llama-3-8B attention, 32k tokens, fp16 queries) with the kernel replaced by a
recorder, then compiles the recorded launch for sm_90 (`kvpress.kernels.triton_aot`) **with the
specialization a CUDA launch adds**: ``tt.divisibility=16`` on every pointer and on every integer
argument divisible by 16, integers equal to 1 as constants (without these hints
Triton pipelines none of the loads; with them the tile loads go through ``cp.async``). Prints the resource use (registers, spill stack, static shared memory) from
``cuobjdump -res-usage`` and instruction counts from ``cuobjdump -sass`` (the cuobjdump bundled
with Triton's NVIDIA backend): the whole kernel's, and the tile loop's (``loop``, what a warp
issues per tile, with its most frequent opcodes).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton

import kvpress.kernels.triton_quant as tq
import kvpress.kernels.triton_quant_kernel as kern
from kvpress.kernels.quant import quantize_per_channel, quantize_per_token
from kvpress.kernels.triton_aot import compile_launch

HQ, HKV, D, GROUP, T = 32, 8, 128, 32, 32768
COUNTED = ("LDGSTS", "LDG", "LDS", "STS", "BAR", "I2F", "HMMA", "HFMA2", "PRMT", "LOP3")


def record_launch(bits: int, batch: int):
    """(kernel, args, kwargs) of the decode launch the launcher makes for these shapes on a 132-SM GPU."""
    k = torch.randn(batch, HKV, T, D)
    kq, vq = quantize_per_channel(k, bits, GROUP), quantize_per_token(k, bits, GROUP)
    q = torch.randn(batch, HQ, D, dtype=torch.float16)
    launches, fn = [], kern._quant_decode_split_kernel

    class Recorded(Exception):
        """Raised once the split launch is recorded: the merge launch after it is not needed."""

    class Recorder:
        def __getitem__(self, grid):
            def record(*a, **kw):
                launches.append((fn, a, kw))
                raise Recorded
            return record

    saved = (kern._quant_decode_split_kernel, tq.require_cuda_or_interpreter, tq._sm_count, tq.interpreting,
             tq._splits)
    splits = tq._splits
    kern._quant_decode_split_kernel = Recorder()
    tq.require_cuda_or_interpreter = lambda t, what: None
    tq._sm_count = lambda device: 132
    tq.interpreting = lambda: False
    tq._splits = lambda b, h, t, device, bn, pps: splits(b, h, t, torch.device("cuda"), bn, pps)
    try:
        tq.triton_quant_decode(q, *kq, *vq, bits=bits, group_size=GROUP)
    except Recorded:
        pass
    finally:
        (kern._quant_decode_split_kernel, tq.require_cuda_or_interpreter, tq._sm_count, tq.interpreting,
         tq._splits) = saved
    if not launches:
        raise RuntimeError("triton_quant_decode returned without launching the split kernel")
    return launches[0]


def cubin_report(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    lines = re.findall(r"/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", sass)
    counts = collections.Counter(op for _, op, _ in lines)
    return dict(registers=int(m.group(1)), spill_stack=int(m.group(2)), static_shared=int(m.group(3)),
                instructions=len(lines), **{op: counts[op] for op in COUNTED}, **loop_report(lines))


def loop_report(lines) -> dict:
    """The tile loop: the longest range closed by a backward branch (``loop``: its instruction
    count, what one tile costs a warp) and its most frequent opcodes (``loop_ops``)."""
    best = (0, 0, -1)
    for addr, op, rest in lines:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < int(addr, 16):
            lo, hi = int(target.group(1), 16), int(addr, 16)
            best = max(best, (sum(lo <= int(a, 16) <= hi for a, _, _ in lines), lo, hi))
    n, lo, hi = best
    ops = collections.Counter(op for a, op, _ in lines if lo <= int(a, 16) <= hi)
    return dict(loop=n, loop_ops=" ".join(f"{op}={c}" for op, c in ops.most_common(8)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tile", type=int, default=None, help="with --warps and --pps: override the launch rule")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--pps", type=int, default=16)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--no-ptx", action="store_true", help="codes by int -> float conversions (the form without PTX_CODES)")
    args = ap.parse_args(argv)
    saved = (tq.OVERRIDE, tq.NUM_STAGES, tq.PTX_CODES)
    if args.tile is not None:
        tq.OVERRIDE = (args.tile, args.warps or max(1, args.tile // 32), args.pps)
    tq.NUM_STAGES = args.stages or tq.NUM_STAGES
    tq.PTX_CODES = not args.no_ptx
    try:
        fn, a, kw = record_launch(args.bits, args.batch)
        report = cubin_report(compile_launch(fn, a, kw).asm["cubin"])
    finally:
        tq.OVERRIDE, tq.NUM_STAGES, tq.PTX_CODES = saved
    launch = {key: kw[key] for key in ("BLOCK_N", "num_warps", "num_stages", "PTX_CODES")}
    print(f"bits={args.bits} batch={args.batch} {launch}")
    print(" ".join(f"{key}={value}" for key, value in report.items()))
    return report


if __name__ == "__main__":
    main()
