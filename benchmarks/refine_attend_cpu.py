"""What refined key channels cost the native CPU decode step (`kvpress.kernels.native.quant_attend`).

    OMP_NUM_THREADS=1 python benchmarks/refine_attend_cpu.py --tokens 8192 --channels 0,8,16 --iters 200

One packed store of ``--tokens`` tokens at SmolLM2's attention shape (3 KV heads, 9 query heads,
head_dim 64; 4-bit keys in groups of 32 tokens, 4-bit values in groups of 64 channels, as
``zipcache:bits_low=4``'s low store) and a 16-token window, read by one ``quant_attend`` call per
step with ``R`` refined key channels per head (`kvpress.kernels.quant.quantize_refined_keys`;
0 = none). The settings are timed in turn within each iteration, so machine noise falls on all
of them alike; prints the median and 10th-percentile time per call.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpress.kernels import native
from kvpress.kernels import quant as kq


def main(argv=None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--channels", default="0,8,16", help="refined channels per KV head, comma-separated")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if not native.available():
        raise SystemExit("the native CPU kernels are not built here")
    torch.set_num_threads(args.threads)
    B, H, M, D, G = 1, 3, 3, 64, 32
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, args.tokens, D, generator=gen), torch.randn(B, H, args.tokens, D, generator=gen)
    values = kq.quantize_per_token(v, 4, 64)
    segments = {}
    for R in (int(x) for x in args.channels.split(",")):
        if R:
            ch = torch.rand(B, H, D, generator=gen).argsort(-1)[..., :R].contiguous()
            kc, ks, kz, rc, rs = kq.quantize_refined_keys(k, 4, G, ch)
            segments[R] = native.PackedSegment((kc, ks, kz), values, 4, G, 64, refine=(rc, rs, ch))
        else:
            segments[R] = native.PackedSegment(kq.quantize_per_channel(k, 4, G), values, 4, G, 64)
    q, win = torch.randn(B, H, M, D, generator=gen), torch.randn(B, H, 16, D, generator=gen)
    times = {R: [] for R in segments}
    for it in range(args.iters + 5):
        for R, seg in segments.items():
            t0 = time.perf_counter()
            native.quant_attend(q, k_win=win, v_win=win, segments=[seg])
            if it >= 5:
                times[R].append(time.perf_counter() - t0)
    print(f"quant_attend, {args.tokens} tokens, (B, H_kv, G, D) = ({B}, {H}, {M}, {D}), {args.threads} thread(s)")
    print("| refined channels | median ms | p10 ms |\n|---:|---:|---:|")
    out = {}
    for R, ts in times.items():
        ts.sort()
        out[R] = ts[len(ts) // 2] * 1e3
        print(f"| {R} | {out[R]:.3f} | {ts[len(ts) // 10] * 1e3:.3f} |")
    return out


if __name__ == "__main__":
    main()
