"""Decode speed on a shared CPU: one process alone vs several at once, per OpenMP wait policy.

    python benchmarks/cpu_contention.py --policies full,kivi:bits=4,zipcache --length 2048 --procs 2 --threads 2

For each OpenMP wait policy (the runtime's default, which spins between parallel regions, and
``OMP_WAIT_POLICY=PASSIVE``) it starts one worker process, then ``--procs`` workers at once.
Each worker loads SmolLM2, and for every policy prefills ``--length`` random tokens and times
``--steps`` one-token decode steps; the table gives the median ms per token of each run (the
mean over the concurrent workers). The environment variable is read when the OpenMP runtime
starts, so it is set before the worker imports torch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def worker(policies: list[str], length: int, steps: int, threads: int) -> None:
    import time

    import torch

    import kvpress
    from kvpress.compat import cache_kwargs, output_cache
    from kvpress.evals.runner import parse_policy_spec

    torch.set_num_threads(threads)
    model, _ = kvpress.load_model("smollm2")
    ids = torch.randint(10, model.config.vocab_size - 1, (1, length), generator=torch.Generator().manual_seed(0))
    for spec in policies:
        name, fields = parse_policy_spec(spec)
        policy = kvpress.get_policy(name, **fields)
        times = []
        with torch.no_grad(), kvpress.apply(model, policy):
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache, nxt = output_cache(out), out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                start = time.perf_counter()
                nxt = model(nxt, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - start)
        print(json.dumps({"policy": spec, "ms": 1000 * statistics.median(times)}), flush=True)


def run(args, wait: str | None, procs: int) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if wait:
        env["OMP_WAIT_POLICY"] = wait
    cmd = [sys.executable, __file__, "--worker", "--policies", args.policies, "--length", str(args.length),
           "--steps", str(args.steps), "--threads", str(args.threads)]
    running = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    per_policy: dict[str, list[float]] = {}
    for p in running:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"worker failed with exit code {p.returncode}")
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                per_policy.setdefault(row["policy"], []).append(row["ms"])
    return {k: statistics.mean(v) for k, v in per_policy.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="full,kivi:bits=4,zipcache")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.procs < 1 or args.threads < 1 or args.steps < 1:
        ap.error("--procs, --threads and --steps must be >= 1")
    if args.worker:
        worker(args.policies.split(","), args.length, args.steps, args.threads)
        return
    columns = {}
    for wait in (None, "PASSIVE"):
        name = wait or "default"
        columns[f"alone, {name}"] = run(args, wait, 1)
        columns[f"{args.procs} at once, {name}"] = run(args, wait, args.procs)
    print(f"SmolLM2, {args.length}-token prompt, {args.threads} torch threads per process, median decode ms/token "
          f"({os.cpu_count()} CPUs)")
    print("| policy | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for spec in args.policies.split(","):
        print(f"| `{spec}` | " + " | ".join(f"{col[spec]:.1f}" for col in columns.values()) + " |")


if __name__ == "__main__":
    main()
