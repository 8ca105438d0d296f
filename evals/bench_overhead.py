"""Overhead of ``apply(full)`` against the unpatched model (target: decode within 5%).

    python -m kvpress.evals.bench_overhead --length 2048 --new-tokens 32 --repeats 5

Runs alternate between the unpatched model (transformers' DynamicCache + SDPA) and the same
model under ``kvpress.apply(model, get_policy("full"))``, so machine noise hits both alike; the
table reports medians and the ratio of medians. Greedy tokens are checked equal first.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import kvpress
    from kvpress.evals.tasks import get_task
    from kvpress.generation import timed_generate

    model, tokenizer = kvpress.load_model(args.model)
    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, args.length)[: args.length]])
    full = kvpress.get_policy("full")
    # Correctness first: identical greedy tokens.
    a = timed_generate(model, ids, None, max_new_tokens=8, eos_token_id=[])
    b = timed_generate(model, ids, full, max_new_tokens=8, eos_token_id=[])
    if not torch.equal(a.tokens, b.tokens):
        raise SystemExit("full under apply() generated different tokens than the unpatched model")
    runs = {"unpatched": [], "kvpress full": []}
    prefill = {"unpatched": [], "kvpress full": []}
    for _ in range(args.repeats):
        for name, policy in (("unpatched", None), ("kvpress full", full)):
            res = timed_generate(model, ids, policy, max_new_tokens=args.new_tokens, eos_token_id=[])
            runs[name].append(res.decode_ms_per_token)
            prefill[name].append(res.prefill_s)
    base = statistics.median(runs["unpatched"])
    print(f"model {args.model}, prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens, {args.repeats} alternating repeats, "
          f"{torch.get_num_threads()} threads")
    print(f"{'mode':<14} {'prefill s':>10} {'decode ms/tok':>14} {'min':>8} {'max':>8} {'vs unpatched':>13}")
    results = {}
    for name in runs:
        med = statistics.median(runs[name])
        results[name] = {"decode_ms_per_token": med, "prefill_s": statistics.median(prefill[name]), "all": runs[name]}
        print(f"{name:<14} {statistics.median(prefill[name]):>10.2f} {med:>14.1f} {min(runs[name]):>8.1f} "
              f"{max(runs[name]):>8.1f} {med / base:>12.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
