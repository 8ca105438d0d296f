"""Double Sparsity on SmolLM2 (CPU): decode speed against ``full``, and task scores per budget.

    # speed: 8k prompt, budget 256 (timed_generate each, then interleaved single steps)
    python -m kvpress.evals.bench_double_sparsity speed --length 8000 --budget 256 --new-tokens 10 --threads 1
    # quality: one shared dense prefill per sample, greedy decode under each policy
    python -m kvpress.evals.bench_double_sparsity quality --length 4096 --samples 3 \\
        --policies full,ds:256,ds:128,ds:512,ds:256:8 --tasks niah_single,niah_multikey,vt

Policy specs: ``full`` or ``ds:BUDGET[:R[:BITS]]`` (R = label_channels, BITS = label_bits).
The interleaved speed rows alternate one decode step of each policy over caches built from the
same dense prefill, so load changes on a shared machine hit both alike; ``cpu`` columns are
process CPU time (with one thread: the work done, independent of how busy the machine is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def make_policy(spec: str):
    import kvpress

    if spec == "full":
        return kvpress.get_policy("full")
    name, *parts = spec.split(":")
    if name != "ds" or not 1 <= len(parts) <= 3:
        raise ValueError(f"policy spec {spec!r}: use full or ds:BUDGET[:R[:BITS]]")
    keys = ("budget", "label_channels", "label_bits")
    return kvpress.get_policy("double_sparsity", **{k: int(v) for k, v in zip(keys, parts)})


def speed(model, tokenizer, args) -> dict:
    import kvpress
    from kvpress.evals.tasks import get_task
    from kvpress.generation import timed_generate
    from kvpress.prefill import cache_from_dense, dense_prefill

    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, args.length)])
    policies = {"full": make_policy("full"), "double_sparsity": make_policy(f"ds:{args.budget}")}
    out: dict = {"length": args.length, "budget": args.budget}
    tokens = {}
    for name, pol in policies.items():
        r = timed_generate(model, ids, pol, max_new_tokens=args.new_tokens, eos_token_id=[])
        tokens[name] = r.tokens
        out[f"{name}_timed_ms"] = r.decode_ms_per_token
        out[f"{name}_prefill_s"] = r.prefill_s
        out[f"{name}_resident_mib"] = r.stats.resident_bytes / 2**20
    out["greedy_tokens_equal"] = int((tokens["full"] == tokens["double_sparsity"]).sum())
    logits, dense = dense_prefill(model, ids)
    caches = {n: cache_from_dense(model, p, dense) for n, p in policies.items()}
    nxt = {n: logits.argmax(-1, keepdim=True) for n in policies}
    wall = {n: [] for n in policies}
    cpu = {n: [] for n in policies}
    with torch.no_grad():
        for _ in range(args.new_tokens):
            for name, pol in policies.items():
                with kvpress.apply(model, pol):
                    t0, c0 = time.perf_counter(), time.process_time()
                    logits_step = model(nxt[name], past_key_values=caches[name], use_cache=True).logits
                    nxt[name] = logits_step[:, -1].argmax(-1, keepdim=True)
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
    for name in policies:  # the first step warms up buffers: leave it out
        out[f"{name}_interleaved_ms"] = 1e3 * statistics.median(wall[name][1:])
        out[f"{name}_interleaved_cpu_ms"] = 1e3 * statistics.median(cpu[name][1:])
    print(f"{'':16s} {'timed ms/tok':>12s} {'interl. ms':>10s} {'interl. cpu':>11s} {'resident MiB':>12s}")
    for name in policies:
        print(f"{name:16s} {out[f'{name}_timed_ms']:12.1f} {out[f'{name}_interleaved_ms']:10.1f} "
              f"{out[f'{name}_interleaved_cpu_ms']:11.1f} {out[f'{name}_resident_mib']:12.1f}")
    for col in ("timed_ms", "interleaved_ms", "interleaved_cpu_ms"):
        out[f"speedup_{col}"] = out[f"full_{col}"] / out[f"double_sparsity_{col}"]
    print("speedup (full / double_sparsity): " + ", ".join(
        f"{c} {out[f'speedup_{c}']:.2f}x" for c in ("timed_ms", "interleaved_ms", "interleaved_cpu_ms")))
    print(f"greedy tokens equal to full: {out['greedy_tokens_equal']}/{args.new_tokens}")
    return out


@torch.no_grad()
def _decode(model, tokenizer, policy, logits, dense, steps: int) -> str:
    import kvpress
    from kvpress.prefill import cache_from_dense

    cache = cache_from_dense(model, policy, dense)
    nxt = logits.argmax(-1, keepdim=True)
    out = [nxt]
    with kvpress.apply(model, policy):
        for _ in range(steps - 1):
            if int(nxt) == tokenizer.eos_token_id:
                break
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
    return tokenizer.decode(torch.cat(out, 1)[0], skip_special_tokens=True)


def quality(model, tokenizer, args) -> dict:
    from kvpress.evals.tasks import build_input_ids, get_task
    from kvpress.prefill import dense_prefill

    specs = args.policies.split(",")
    scores = {t: {s: [] for s in specs} for t in args.tasks.split(",")}
    for tname in scores:
        task = get_task(tname)
        for i, sample in enumerate(task.generate(tokenizer, args.length, num_samples=args.samples, seed=0)):
            ids = torch.tensor([build_input_ids(tokenizer, sample)])
            logits, dense = dense_prefill(model, ids)
            for spec in specs:
                pred = _decode(model, tokenizer, make_policy(spec), logits, dense, args.new_tokens)
                scores[tname][spec].append(task.score(pred, sample))
                print(f"{tname} #{i} {spec:12s} {scores[tname][spec][-1]:.2f} {pred!r}", flush=True)
    print(f"\n{'task':14s} " + " ".join(f"{s:>12s}" for s in specs))
    for tname, row in scores.items():
        print(f"{tname:14s} " + " ".join(f"{statistics.mean(v):12.2f}" for v in row.values()))
    return {"length": args.length, "samples": args.samples, "scores": scores}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("speed", "quality"))
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=None, help="speed: 10; quality: 24")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--policies", default="full,ds:256,ds:128,ds:512")
    parser.add_argument("--tasks", default="niah_single,niah_multikey,vt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.new_tokens is None:
        args.new_tokens = 10 if args.mode == "speed" else 24
    import kvpress

    model, tokenizer = kvpress.load_model("smollm2")
    result = (speed if args.mode == "speed" else quality)(model, tokenizer, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
