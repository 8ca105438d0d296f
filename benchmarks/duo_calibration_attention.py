"""What the streaming branch of ``kvpress calibrate duo`` costs per layer, forward and backward.

    OMP_NUM_THREADS=1 python benchmarks/duo_calibration_attention.py --lengths 512,768,2048,4096 --windows 64,240

One layer of SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64, fp32, batch 1)
with sinks 16 and each ``--windows`` window: the streaming pattern (key ``j`` visible to query
``i`` when ``j <= i`` and ``j < sinks`` or ``i - j < window``) through one SDPA call with a
[T, T] boolean mask against
``kvpress.attention.sliding_causal_attention(..., sinks=16)`` (query chunks over the keys each
can see; the route now). Each timed repeat is a forward plus a backward of the output's sum,
the two routes alternating so machine noise falls on both; prints the median per route and
checks the two outputs agree.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvpress.attention import sliding_causal_attention
from kvpress.policies._duo_calibrate import streaming_mask

SINKS = 16


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,768,2048,4096")
    ap.add_argument("--windows", default="64,240")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'window':>6} {'tokens':>6} {'masked ms':>10} {'chunked ms':>11} {'ratio':>6}")
    for window in (int(x) for x in args.windows.split(",")):
        for t in (int(x) for x in args.lengths.split(",")):
            q = torch.randn(1, 9, t, 64, generator=gen).requires_grad_()
            k, v = (torch.randn(1, 3, t, 64, generator=gen).requires_grad_() for _ in range(2))
            mask = streaming_mask(t, SINKS, window, q.device)
            routes = {
                "masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True),
                "chunked": lambda: sliding_causal_attention(q, k, v, 0.125, window=window, sinks=SINKS),
            }
            with torch.no_grad():
                torch.testing.assert_close(routes["chunked"](), routes["masked"](), rtol=1e-4, atol=1e-5)
            times = {name: [] for name in routes}
            for _ in range(args.repeats):
                for name, fn in routes.items():
                    t0 = time.perf_counter()
                    fn().sum().backward()
                    times[name].append(time.perf_counter() - t0)
            med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
            rows.append({"window": window, "tokens": t, **med})
            print(f"{window:>6} {t:>6} {med['masked']:>10.1f} {med['chunked']:>11.1f} {med['masked'] / med['chunked']:>6.2f}")
    return rows


if __name__ == "__main__":
    main()
