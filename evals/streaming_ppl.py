"""Perplexity beyond the trained context: full vs window vs StreamingLLM (with/without re-rotation).

    python -m kvpress.evals.streaming_ppl --tokens 16384 --budget 1024 --chunk 512

Feeds >= 16k tokens of natural prose (Botchan, public domain; see evals/data/README.md) through
each policy's cache in chunks and prints perplexity per 2k-token segment. SmolLM2 was trained
with an 8k context: ``full`` must attend beyond it, ``streaming`` with ``rerotate=True`` never
sees a relative distance beyond its budget.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--segment", type=int, default=2048)
    parser.add_argument("--policies", default="full,window,streaming,streaming:rerotate=true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import kvpress
    from kvpress.evals.tasks import get_task
    from kvpress.generation import chunked_nll

    policies = []
    for spec in args.policies.split(","):
        policies.append((spec, kvpress.get_policy(spec).with_budget(args.budget)))
    model, tokenizer = kvpress.load_model(args.model)
    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, args.tokens)[: args.tokens]])
    segments = list(range(0, ids.shape[1] - 1, args.segment))
    header = f"{'policy':<26}" + "".join(f"{f'{s // 1024}-{min(s + args.segment, ids.shape[1]) // 1024}k':>9}" for s in segments) + f"{'all':>9}{'min':>7}"
    print(f"model {args.model}, {ids.shape[1]} tokens of prose, budget {args.budget}, chunk {args.chunk}; perplexity per segment")
    print(header)
    results = {}
    for spec, policy in policies:
        start = time.perf_counter()
        nll = chunked_nll(model, ids, policy, chunk_size=args.chunk)
        per_seg = [math.exp(float(nll[s : s + args.segment].mean())) for s in segments]
        overall = math.exp(float(nll.mean()))
        minutes = (time.perf_counter() - start) / 60
        results[spec] = {"segments": per_seg, "overall": overall, "minutes": minutes, "config": policy.to_dict()}
        print(f"{spec:<26}" + "".join(f"{p:>9.2f}" for p in per_seg) + f"{overall:>9.2f}{minutes:>6.1f}m", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
