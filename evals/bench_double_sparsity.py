"""Double Sparsity on SmolLM2 (CPU): decode speed against ``full``, and task scores per budget.

    # speed: 8k prompt, budget 256: interleaved single steps of full, ds and window (the bound)
    python -m kvpress.evals.bench_double_sparsity speed --length 8000 --budget 256 --new-tokens 10 --threads 1
    # quality: one shared dense prefill per sample, greedy decode under each policy
    python -m kvpress.evals.bench_double_sparsity quality --length 4096 --samples 3 \\
        --policies full,ds:256,ds:128,ds:512,ds:256:8 --tasks niah_single,niah_multikey,vt

Policy specs: ``full`` or ``ds:BUDGET[:R[:BITS]]`` (R = label_channels, BITS = label_bits).
The interleaved speed rows alternate one decode step of each policy over caches built from the
same dense prefill, so load changes on a shared machine hit all alike; ``cpu`` columns are
thread CPU time (with one thread: the work done, independent of how busy the machine is).
``attention cpu`` is the time inside the cache layers' ``attend`` (selection + attention), the
rest is the model around it; ``window`` at a small budget (``--window-budget``) has nearly free
attention, so ``full / window`` bounds what any attention policy can gain end to end.
``--timed`` also runs `kvpress.generation.timed_generate` for full and ds (two more prefills).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

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
    """Interleaved decode steps of ``full``, ``double_sparsity`` and ``window`` (the bound) at one length.

    Every policy decodes from a cache built from one shared dense prefill (``window`` runs its
    own); the steps alternate (full, ds, window, full, ...) so load changes on a shared machine
    hit all alike (:func:`kvpress.evals.bench.interleaved_decode`). Per step: end-to-end wall and
    thread CPU time of the forward, and the CPU time spent inside the cache layers' ``attend``
    (selection + attention: the part a policy changes). ``window`` at a small budget makes
    attention nearly free, so ``full / window`` bounds any attention policy's end-to-end speedup
    on this model.
    """
    import kvpress
    from kvpress.evals.bench import interleaved_decode
    from kvpress.evals.tasks import get_task
    from kvpress.generation import timed_generate

    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, args.length)])
    policies = {"full": make_policy("full"), "double_sparsity": make_policy(f"ds:{args.budget}"),
                "window": kvpress.get_policy("window").with_budget(args.window_budget)}
    out: dict = {"length": args.length, "budget": args.budget, "window_budget": args.window_budget,
                 "threads": torch.get_num_threads()}
    if args.timed:
        for name in ("full", "double_sparsity"):
            r = timed_generate(model, ids, policies[name], max_new_tokens=args.new_tokens, eos_token_id=[])
            out[f"{name}_timed_ms"] = r.decode_ms_per_token
    runs = interleaved_decode(model, ids, policies, args.new_tokens)
    for name, run in runs.items():
        out[f"{name}_wall_ms"], out[f"{name}_cpu_ms"] = run["wall_ms"], run["cpu_ms"]
        out[f"{name}_attention_ms"] = run["attention_ms"]
    out["greedy_tokens_equal"] = sum(a == b for a, b in zip(runs["full"]["tokens"][1:], runs["double_sparsity"]["tokens"][1:]))
    print(f"# SmolLM2, {args.length} tokens, {args.new_tokens} interleaved decode steps (first dropped), "
          f"threads={torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}; medians, ms per token")
    print(f"{'':16s} {'e2e wall':>9s} {'e2e cpu':>9s} {'attention cpu':>13s} {'rest cpu':>9s}")
    for name in policies:
        rest = out[f"{name}_cpu_ms"] - out[f"{name}_attention_ms"]
        print(f"{name:16s} {out[f'{name}_wall_ms']:9.1f} {out[f'{name}_cpu_ms']:9.1f} "
              f"{out[f'{name}_attention_ms']:13.2f} {rest:9.1f}")
    f, d, w = (out[f"{n}_cpu_ms"] for n in ("full", "double_sparsity", "window"))
    out["speedup_e2e_cpu"] = f / d
    out["speedup_e2e_wall"] = out["full_wall_ms"] / out["double_sparsity_wall_ms"]
    out["speedup_attention"] = out["full_attention_ms"] / out["double_sparsity_attention_ms"]
    out["bound_e2e_cpu"] = f / w
    print(f"double_sparsity vs full: end-to-end {out['speedup_e2e_cpu']:.2f}x (cpu), "
          f"{out['speedup_e2e_wall']:.2f}x (wall); attention-only {out['speedup_attention']:.2f}x")
    print(f"bound (full / window:{args.window_budget}, attention ~free): {out['bound_e2e_cpu']:.2f}x end-to-end")
    if args.timed:
        print("timed_generate ms/token: " + ", ".join(f"{n} {out[f'{n}_timed_ms']:.1f}" for n in ("full", "double_sparsity")))
    print(f"greedy tokens equal to full: {out['greedy_tokens_equal']}/{args.new_tokens}")
    return out


@torch.no_grad()
def _decode(model, tokenizer, policy, logits, dense, steps: int) -> str:
    import kvpress
    from kvpress.compat import cache_kwargs
    from kvpress.prefill import cache_from_dense

    cache = cache_from_dense(model, policy, dense)
    nxt = logits.argmax(-1, keepdim=True)
    out = [nxt]
    with kvpress.apply(model, policy):
        for _ in range(steps - 1):
            if int(nxt) == tokenizer.eos_token_id:
                break
            nxt = model(nxt, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
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
    parser.add_argument("--window-budget", type=int, default=64, help="speed: budget of the window bound")
    parser.add_argument("--timed", action="store_true", help="speed: also timed_generate full and ds (2 more prefills)")
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
