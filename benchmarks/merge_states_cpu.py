"""Time one `merge_states` call on the CPU: the torch reference against the compiled one.

    OMP_NUM_THREADS=1 python benchmarks/merge_states_cpu.py [--iters 2000]

Shapes: SmolLM2's decode step (1 row, 9 query heads, head_dim 64), and 8 rows of 32 heads of 128.
``shadowkv``'s compiled step merges its tail estimate once per layer and step (30 layers for
SmolLM2), through `kvpress.kernels.native.merge_states`. Prints microseconds per
call (median of 5 repeats of ``--iters`` calls each).
"""
import argparse
import statistics
import time

import torch

from kvpress.kernels import native
from kvpress.kernels.merge import torch_merge_states


def per_call_us(fn, args, iters: int) -> float:
    for _ in range(50):
        fn(*args)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        times.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args(argv)
    if not native.available():
        raise SystemExit("the native library is not built here (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"{'shape (rows, heads, D)':<24} {'torch us':>9} {'native us':>10} {'ratio':>6}")
    for B, H, D in [(1, 9, 64), (8, 32, 128)]:
        states = (torch.randn(B, H, D, generator=g), torch.randn(B, H, generator=g),
                  torch.randn(B, H, D, generator=g), torch.randn(B, H, generator=g))
        t_torch = per_call_us(torch_merge_states, states, args.iters)
        t_native = per_call_us(native.merge_states, states, args.iters)
        print(f"{str((B, H, D)):<24} {t_torch:>9.1f} {t_native:>10.1f} {t_torch / t_native:>5.1f}x")


if __name__ == "__main__":
    main()
