"""Decode speed of the sparse policies against ``full``: ``python -m kvpress.evals.bench_sparse_decode``.

For each policy and budget, one greedy generation with :func:`kvpress.generation.timed_generate`
(no early stop) on a ``--length``-token prompt (the ``ppl`` document). Columns:

``decode ms/tok``  end-to-end decode step (model forward + greedy pick), mean over the steps;
``attn ms/tok``    time inside the cache layers' ``attend`` per decode step, summed over the
                   layers (cache update, selection, sparse_decode): thread CPU time on CPU,
                   wall time between device syncs on CUDA (``kvpress.evals.bench.time_attention``);
``speedup``        full's decode ms/token / the policy's, at the same context.

Before timing, each policy's first generated tokens are printed next to ``full``'s as a sanity
check. Results are also written as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json

import torch


def run(args) -> list[dict]:
    from kvpress.evals.bench import time_attention
    from kvpress.evals.cli import parse_options
    from kvpress.evals.models import default_device, load_eval_model
    from kvpress.evals.runner import expand_policies
    from kvpress.evals.tasks import get_task
    from kvpress.generation import timed_generate

    torch.set_num_threads(args.threads)
    variants = expand_policies(args.policies.split(","), args.budgets, (), parse_options(args.option))
    model, tokenizer = load_eval_model(args.model, dtype=args.dtype, device=args.device or default_device())
    cuda = model.device.type == "cuda"
    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, args.length)])
    rows, reference, full_ms = [], None, None
    for variant in variants:
        name, budget = variant.spec, variant.budget
        sink = [0.0]  # attention seconds over the decode steps (the prefill is not timed)
        result = timed_generate(model, ids, variant.policy, max_new_tokens=args.new_tokens, eos_token_id=[],
                                on_prefill=lambda cache: time_attention(cache, sink, cuda_sync=cuda))
        steps = max(1, result.tokens.shape[1] - 1)
        tokens = result.tokens[0].tolist()
        if reference is None:
            reference = tokens
        agree = sum(a == b for a, b in zip(tokens, reference))
        if name == "full":
            full_ms = result.decode_ms_per_token
        rows.append(dict(policy=name, context=args.length, budget=budget, prefill_s=result.prefill_s,
                         decode_ms_per_token=result.decode_ms_per_token,
                         attention_ms_per_token=1000.0 * sink[0] / steps,
                         resident_mib=result.stats.resident_bytes / 2**20,
                         speedup_vs_full=(full_ms / result.decode_ms_per_token) if full_ms else None,
                         tokens_agreeing_with_first=f"{agree}/{len(tokens)}"))
        print(f"# {variant.label}: first tokens {tokenizer.decode(tokens[:12])!r} "
              f"(agree with {variants[0].label}: {agree}/{len(tokens)})", flush=True)
    print(f"# model={args.model} device={model.device} dtype={model.dtype} threads={args.threads} "
          f"new_tokens={args.new_tokens}")
    print(f"{'policy':<16} {'context':>7} {'budget':>6} {'decode ms/tok':>13} {'attn ms/tok':>11} "
          f"{'speedup':>7} {'resident MiB':>12} {'prefill s':>9}")
    for r in rows:
        speed = "-" if r["speedup_vs_full"] is None else f"{r['speedup_vs_full']:.2f}x"
        print(f"{r['policy']:<16} {r['context']:>7} {str(r['budget'] or '-'):>6} {r['decode_ms_per_token']:>13.1f} "
              f"{r['attention_ms_per_token']:>11.1f} {speed:>7} {r['resident_mib']:>12.1f} {r['prefill_s']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, device=str(model.device), dtype=str(model.dtype), threads=args.threads,
                           new_tokens=args.new_tokens, rows=rows), f, indent=2)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, random-llama3-8b[-Nl], random-tiny, ... "
                        "(kvpress.evals.models)")
    parser.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: the model's)")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="POLICY.FIELD=VALUE",
                        help="policy field (repeatable), e.g. double_sparsity.artifact=ds.safetensors")
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens (default 8192)")
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[256])
    parser.add_argument("--policies", default="full,quest,tidal,snapkv", help="comma-separated; full first")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the rows here")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
