"""ShadowKV (arXiv 2410.21465) against ``full``: quality, memory and decode throughput.

    # quality on the task suite (shared dense prefill, then greedy decoding under each policy)
    python -m kvpress.evals.bench_shadowkv quality --length 4096 --samples 5 --tasks niah_single,niah_multikey,vt
    # device-resident vs host-tier bytes after an 8k prefill (target: resident <= 25% of full)
    python -m kvpress.evals.bench_shadowkv memory --length 8192
    # decode throughput at the largest batch that fits (GPU: a random-weight Llama-3-8B-shaped model)
    python -m kvpress.evals.bench_shadowkv speed --model random-llama3-8b-32l --length 32768 --new-tokens 32
    python -m kvpress.evals.bench_shadowkv speed --model random-tiny --length 2048 --batches 1,2   # CPU

Every mode checks correctness first (shadowkv with a budget covering the prompt must produce
``full``'s greedy tokens), prints one fixed-width table and can write JSON (``--json``). The
ShadowKV defaults here (rank 48, 8 outlier chunks, 32-token window, budget = 3% of the context
+ the always-on parts + 32 generated tokens) keep SmolLM2-135M's device bytes under 25% of full
at 8k (its keys are 3 KV heads x 64 = 192 dims, so the paper's rank 160 would not compress).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

import torch

GEN_ALLOWANCE = 32  # generated tokens the default budget leaves room for


def default_budget(length: int, chunk_size: int, outlier_chunks: int, local_window: int) -> int:
    """3% of the context in selected chunks + row-start chunk + outliers + window + generated tokens."""
    return (math.ceil(0.03 * length / chunk_size) * chunk_size + chunk_size + outlier_chunks * chunk_size
            + local_window + GEN_ALLOWANCE)


def shadowkv_policy(args, length: int):
    import kvpress

    budget = args.budget or default_budget(length, args.chunk_size, args.outlier_chunks, args.local_window)
    return kvpress.get_policy("shadowkv", budget=budget, chunk_size=args.chunk_size, rank=args.rank,
                              outlier_chunks=args.outlier_chunks, local_window=args.local_window,
                              score_reduction=args.score_reduction, backend=args.backend)


def load(name: str):
    """``(model, tokenizer)`` for any name :mod:`kvpress.evals.models` accepts (``smollm2``,
    ``random-llama3-8b-32l``, ``random-tiny`` ...), on CUDA when available."""
    from kvpress.evals.models import default_device, load_eval_model

    return load_eval_model(name, device=default_device())


def check_identity(model, args) -> None:
    """shadowkv with a budget covering the prompt must reproduce full's greedy tokens."""
    import kvpress
    from kvpress.generation import timed_generate

    ids = torch.randint(3, model.config.vocab_size - 1, (1, 96), generator=torch.Generator().manual_seed(0))
    wide = shadowkv_policy(args, 96).with_budget(10_000)
    a = timed_generate(model, ids, kvpress.get_policy("full"), max_new_tokens=4, eos_token_id=[])
    b = timed_generate(model, ids, wide, max_new_tokens=4, eos_token_id=[])
    if not torch.equal(a.tokens, b.tokens):
        raise SystemExit("shadowkv with a budget covering the prompt differs from full: refusing to benchmark")


# ---------------------------------------------------------------------------------------- quality
def run_quality(args) -> dict:
    import kvpress
    from kvpress.evals.decode import decode_from_cache, shared_prefill
    from kvpress.evals.tasks import build_input_ids, get_task
    from kvpress.policies.shadowkv import transfer_summary
    from kvpress.prefill import cache_from_dense

    model, tok = load(args.model)
    check_identity(model, args)
    full = kvpress.get_policy("full")
    rows, results = [], {"mode": "quality", "model": args.model, "length": args.length, "tasks": {}}
    for task_name in args.tasks.split(","):
        task = get_task(task_name)
        scores = {"full": [], "shadowkv": []}
        transfers, ratios = [], []
        for sample in task.generate(tok, args.length, args.samples, args.seed):
            ids = torch.tensor([build_input_ids(tok, sample)])
            pol = shadowkv_policy(args, ids.shape[1])
            sp = shared_prefill(model, ids)
            for name, policy in (("full", full), ("shadowkv", pol)):
                cache = cache_from_dense(model, policy, sp.cache)
                tokens, _ = decode_from_cache(model, policy, cache, sp.first_logits, sp.length,
                                              max_new_tokens=sample.max_new_tokens, eos_token_id=tok.eos_token_id)
                pred = tok.decode(tokens, skip_special_tokens=True)
                scores[name].append(task.score(pred, sample))
                if name == "shadowkv":
                    transfers.append(transfer_summary(cache))
                    ratios.append(kvpress.cache_stats(cache).resident_bytes / kvpress.cache_stats(sp.cache).resident_bytes)
            print(f"[{task_name} #{sample.index}] full {scores['full'][-1]:.2f} shadowkv {scores['shadowkv'][-1]:.2f}",
                  file=sys.stderr, flush=True)
        f, s = (sum(v) / len(v) for v in (scores["full"], scores["shadowkv"]))
        rec = {"full": f, "shadowkv": s, "ratio": s / f if f else float("nan"), "budget": pol.budget,
               "resident_vs_full": sum(ratios) / len(ratios),
               "fetched_bytes_per_step": sum(t["fetched_bytes_per_step"] for t in transfers) / len(transfers),
               "reuse_rate": sum(t["reuse_rate"] for t in transfers) / len(transfers),
               "per_sample": scores}
        results["tasks"][task_name] = rec
        rows.append((task_name, rec))
    print(f"model {args.model}, ~{args.length} tokens, {args.samples} samples/task, rank {args.rank}, "
          f"chunk {args.chunk_size}, outliers {args.outlier_chunks}, window {args.local_window}")
    print(f"{'task':<16} {'budget':>7} {'full':>6} {'shadowkv':>9} {'ratio':>6} {'dev/full':>9} {'KiB/step':>9} {'reuse':>6}")
    for name, r in rows:
        print(f"{name:<16} {r['budget']:>7} {r['full']:>6.2f} {r['shadowkv']:>9.2f} {r['ratio']:>6.2f} "
              f"{r['resident_vs_full']:>9.3f} {r['fetched_bytes_per_step'] / 1024:>9.1f} {r['reuse_rate']:>6.2f}")
    return results


# ---------------------------------------------------------------------------------------- memory
def run_memory(args) -> dict:
    import kvpress
    from kvpress.evals.decode import decode_from_cache, shared_prefill
    from kvpress.evals.tasks import get_task
    from kvpress.policies.shadowkv import transfer_summary
    from kvpress.prefill import cache_from_dense

    model, tok = load(args.model)
    ids = torch.tensor([get_task("ppl").token_ids(tok, args.length)])
    sp = shared_prefill(model, ids.to(model.device))
    pol = shadowkv_policy(args, ids.shape[1])
    cache = cache_from_dense(model, pol, sp.cache)
    decode_from_cache(model, pol, cache, sp.first_logits, sp.length, max_new_tokens=8, eos_token_id=[])
    st, full = kvpress.cache_stats(cache), kvpress.cache_stats(sp.cache)
    by_name: dict[str, int] = {}
    for layer in cache.layers:
        for name, t in layer.state_tensors().items():
            if t is not None:
                by_name[name] = by_name.get(name, 0) + t.numel() * t.element_size()
    res = {"mode": "memory", "model": args.model, "length": ids.shape[1], "budget": pol.budget, "rank": pol.rank,
           "resident_bytes": st.resident_bytes, "host_bytes": st.offloaded_bytes,
           "full_resident_bytes": full.resident_bytes, "resident_vs_full": st.resident_bytes / full.resident_bytes,
           "resident_by_tensor": by_name, "transfers": transfer_summary(cache)}
    mib = 2.0**20
    print(f"model {args.model}, {ids.shape[1]} tokens, budget {pol.budget}, rank {pol.rank}")
    print(f"{'':<22} {'MiB':>10}")
    print(f"{'full resident':<22} {full.resident_bytes / mib:>10.2f}")
    print(f"{'shadowkv resident':<22} {st.resident_bytes / mib:>10.2f}   ({res['resident_vs_full']:.1%} of full)")
    print(f"{'shadowkv host tier':<22} {st.offloaded_bytes / mib:>10.2f}")
    for name, b in sorted(by_name.items(), key=lambda kv: -kv[1]):
        print(f"{'  ' + name:<22} {b / mib:>10.2f}")
    return res


# ---------------------------------------------------------------------------------------- speed
def _decode_throughput(model, policy, batch: int, length: int, new_tokens: int) -> dict:
    """Prefill ``batch`` random prompts, then time ``new_tokens`` greedy steps (tokens/s over the batch)."""
    import kvpress
    from kvpress.compat import cache_kwargs, output_cache
    from kvpress.policies.shadowkv import transfer_summary

    device = model.device
    ids = torch.randint(3, model.config.vocab_size - 1, (batch, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad(), kvpress.apply(model, policy):
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync()
        prefill_s = time.perf_counter() - t0
        cache, nxt = output_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        times = []
        for step in range(new_tokens):
            t0 = time.perf_counter()
            pos = torch.full((batch, 1), length + step, device=device)
            out = model(input_ids=nxt, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            times.append(time.perf_counter() - t0)
    steady = times[1:] if len(times) > 1 else times
    step_s = sum(steady) / len(steady)
    st = kvpress.cache_stats(cache)
    # every step kept: a mean inflated by a few slow steps (a recompile, a host stall) shows
    res = {"batch": batch, "prefill_s": prefill_s, "decode_ms_per_step": 1000 * step_s,
           "decode_ms_median": 1000 * statistics.median(steady), "step_ms": [1000 * t for t in times],
           "tokens_per_s": batch / step_s, "resident_bytes": st.resident_bytes, "host_bytes": st.offloaded_bytes}
    if policy.name == "shadowkv":
        res.update(transfer_summary(cache))
    if device.type == "cuda":
        res["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return res


def run_speed(args) -> dict:
    import kvpress

    model, _ = load(args.model)
    check_identity(model, args)
    on_gpu = model.device.type == "cuda"
    policies = {"full": kvpress.get_policy("full"), "shadowkv": shadowkv_policy(args, args.length)}
    for fields in filter(None, (args.variants or "").split(",")):  # e.g. select=tokens:fetch_keys=True
        base = dataclasses.asdict(policies["shadowkv"])
        policies[f"shadowkv:{fields}"] = kvpress.get_policy(
            "shadowkv", **{**base, **kvpress.parse_policy_spec(f"shadowkv:{fields}")[1]})
    for name in filter(None, (args.skip or "").split(",")):
        if name not in ("full", "shadowkv"):
            raise SystemExit(f"--skip takes full and/or shadowkv (the baselines), not {name!r}")
        del policies[name]
    results = {"mode": "speed", "model": args.model, "length": args.length, "device": str(model.device),
               "budget": shadowkv_policy(args, args.length).budget, "rank": args.rank, "runs": {}}
    for name, policy in policies.items():
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
        b, runs = 1, []
        while True:
            batch = batches.pop(0) if batches is not None else b
            try:
                if on_gpu:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                runs.append(_decode_throughput(model, policy, batch, args.length, args.new_tokens))
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"{name} batch {batch}: out of memory", flush=True)
                break
            except Exception as err:  # one configuration failing must not cost the others' figures
                results.setdefault("errors", {})[name] = f"batch {batch}: {type(err).__name__}: {err}"
                print(f"{name} batch {batch}: FAILED {type(err).__name__}: {err}", flush=True)
                break
            r = runs[-1]
            print(f"{name} batch {batch}: prefill {r['prefill_s']:.2f} s, {r['decode_ms_per_step']:.1f} ms/step "
                  f"(median {r['decode_ms_median']:.1f}, slowest {max(r['step_ms'][1:] or r['step_ms']):.1f})",
                  flush=True)
            if batches is not None and not batches:
                break
            if batches is None:
                if not on_gpu or batch >= args.max_batch:
                    break
                b = batch * 2
        results["runs"][name] = runs
    print(f"model {args.model} on {model.device}, {args.length}-token prompts, {args.new_tokens} decode steps, "
          f"shadowkv budget {results['budget']} rank {args.rank}")
    print(f"{'policy':<9} {'batch':>6} {'prefill s':>10} {'ms/step':>9} {'tok/s':>9} {'dev MiB':>9} {'host MiB':>9} "
          f"{'MiB fetched/step':>17} {'reuse':>6}")
    for name, runs in results["runs"].items():
        for r in runs:
            fetched = r.get("fetched_bytes_per_step")
            print(f"{name:<9} {r['batch']:>6} {r['prefill_s']:>10.2f} {r['decode_ms_per_step']:>9.1f} "
                  f"{r['tokens_per_s']:>9.1f} {r['resident_bytes'] / 2**20:>9.1f} {r['host_bytes'] / 2**20:>9.1f} "
                  f"{'' if fetched is None else f'{fetched / 2**20:.3f}':>17} "
                  f"{'' if fetched is None else format(r['reuse_rate'], '.2f'):>6}")
        if runs:
            best = max(runs, key=lambda r: r["batch"])
            print(f"{name}: largest batch that fit {best['batch']}, {best['tokens_per_s']:.1f} tokens/s")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("quality", "memory", "speed"))
    parser.add_argument("--model", default="smollm2", help="smollm2, random-llama3-8b[-Nl], random-tiny, ... (kvpress.evals.models)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--tasks", default="niah_single,niah_multikey,vt")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=None, help="default: 3%% of the context + always-on parts")
    parser.add_argument("--rank", type=int, default=48)
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--outlier-chunks", type=int, default=8)
    parser.add_argument("--local-window", type=int, default=32)
    parser.add_argument("--score-reduction", default="softmax_max", help="GQA group reduction of landmark scores")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--variants", default=None,
                        help="speed mode: also these shadowkv configurations, comma-separated field lists on top of "
                             "the one above, e.g. rerank=32:tail_chunk=64:select=tokens:fetch_keys=True")
    parser.add_argument("--skip", default=None,
                        help="speed mode: leave out these baselines (full, shadowkv), e.g. when only --variants are new")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: double until OOM on GPU, 1 on CPU)")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"quality": run_quality, "memory": run_memory, "speed": run_speed}[args.mode](args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=float)
    for name, err in results.get("errors", {}).items():
        print(f"{name} failed at {err}", file=sys.stderr)
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
