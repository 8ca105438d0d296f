"""``kvpress bench``: end-to-end decode ms/token, prefill time and KV bytes per policy and length.

Each cell greedily generates ``new_tokens`` tokens (eos ignored, so every run times the same
number of steps) from a prompt of random token ids, under the policy's own prefill. Random
weights of real shapes (``--model random-llama3-8b``, see :mod:`kvpress.evals.models`) measure
speed at lengths a small real model does not reach. ``agree`` is the fraction of generated tokens
equal to ``full``'s for the same prompt (1.0 for exact policies; a quick sanity check).

``attn ms/tok`` is the time spent inside the cache layers' ``attend`` per decode step (selection
plus attention: the part a policy changes; the rest of the step is the model around it), as
thread CPU time -- measured on CPU only (CUDA work is asynchronous; the column is blank there).
``x full`` is ``full``'s decode ms/token over the policy's, at the same length.

``--interleave`` decodes all policies from one shared dense prefill (policies whose prefill is
not plain attention run their own), one step of each policy in turn, so load changes on a shared
machine hit every policy alike; ``decode ms/tok`` is then the median wall time per step (the
first step, which grows buffers, left out) and ``cpu ms/tok`` the median thread CPU time of the
step (with one thread, the work done whatever the load).

    kvpress bench --model random-llama3-8b --policies full,streaming --lengths 4096,16384 --budget 512
    OMP_NUM_THREADS=1 kvpress bench --policies full,quest,tidal,double_sparsity --lengths 8192 --interleave
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import kvpress
from kvpress.compat import cache_kwargs, output_cache
from kvpress.generation import timed_generate
from kvpress.patching import apply, make_cache
from kvpress.prefill import cache_from_dense, dense_prefill

from .models import check_model_name, default_device, load_eval_model
from .results import MIB, environment
from .runner import expand_policies

BENCH_COLUMNS = ("policy_label", "length", "prefill_s", "decode_ms_per_token", "cpu_ms_per_token",
                 "attention_ms_per_token", "speedup_vs_full", "resident_mib", "offloaded_mib", "dense_mib", "agree")


def time_attention(cache, sink: list, *, cuda_sync: bool = False) -> None:
    """Wrap every layer's ``attend`` so its time (seconds) adds to ``sink[-1]``.

    Thread CPU time by default (with one thread: the work done, whatever the machine's load).
    ``cuda_sync=True`` times wall clock between device synchronisations instead, the only way to
    see asynchronous CUDA work per layer -- the syncs then slow the whole decode step a little.
    """
    clock = time.perf_counter if cuda_sync else time.thread_time
    for layer in cache.layers:
        def attend(q, *args, _inner=layer.attend, **kw):
            if cuda_sync:
                torch.cuda.synchronize(q.device)
            t0 = clock()
            try:
                return _inner(q, *args, **kw)
            finally:
                if cuda_sync:
                    torch.cuda.synchronize(q.device)
                sink[-1] += clock() - t0
        layer.attend = attend


def bench_cell(model, policy, ids: torch.Tensor, new_tokens: int, repeats: int = 1):
    """Best of ``repeats`` timed generations (on CUDA after an untimed 3-token warm-up).

    Returns the GenerationResult of the fastest decode and its attention ms per decode step
    (thread CPU time inside the cache layers' ``attend``; NaN off CPU).
    """
    best = best_attn = None
    if model.device.type == "cuda":  # untimed: Triton compiles its kernels on their first launch
        timed_generate(model, ids, policy, max_new_tokens=3, eos_token_id=[])
    for _ in range(max(1, repeats)):
        sink = [0.0]
        result = timed_generate(model, ids, policy, max_new_tokens=new_tokens, eos_token_id=[],
                                on_prefill=lambda cache: time_attention(cache, sink))
        steps = result.tokens.shape[1] - 1
        attn = 1e3 * sink[0] / steps if model.device.type == "cpu" and steps else math.nan
        if best is None or result.decode_ms_per_token < best.decode_ms_per_token:
            best, best_attn = result, attn
    return best, best_attn


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def interleaved_decode(model, ids: torch.Tensor, policies: dict, steps: int) -> dict:
    """Greedy decode of every policy in ``policies`` (label -> Policy), one step of each in turn.

    Policies whose prefill is plain attention (``prefills_densely()``) start from one shared dense
    prefill; the others run their own. Per policy, returns a dict with ``prefill_s``,
    ``shared_prefill``, medians over steps 2..``steps`` of ``wall_ms``, ``cpu_ms`` (thread CPU
    time) and ``attention_ms`` (thread CPU time inside the cache layers' ``attend``; NaN off CPU),
    ``tokens`` (the prefill's greedy token, then one per step) and ``stats`` (``cache_stats``).
    """
    from kvpress.stats import cache_stats

    if steps < 3:
        raise ValueError(f"steps must be >= 3 (the first step is left out of the medians), got {steps}")
    device = model.device
    ids = ids.to(device)
    runs = {}
    shared = None
    capacity = ids.shape[1] + steps + 1  # every cache planned for the whole run, as generate plans its own
    for label, policy in policies.items():
        run = {"wall": [], "cpu": [], "attn": [], "tokens": []}
        if policy.prefills_densely():
            if shared is None:  # (last-token logits, dense cache, seconds)
                _sync(device)
                t0 = time.perf_counter()
                first_logits, dense = dense_prefill(model, ids)
                _sync(device)
                shared = (first_logits, dense, time.perf_counter() - t0)
            logits, dense, run["prefill_s"] = shared
            run["cache"], run["shared_prefill"] = cache_from_dense(model, policy, dense, capacity=capacity), True
        else:
            cache = make_cache(model, policy)
            cache.plan_capacity(capacity)
            _sync(device)
            t0 = time.perf_counter()
            with apply(model, policy):
                out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            _sync(device)
            run["prefill_s"], run["shared_prefill"] = time.perf_counter() - t0, False
            logits, run["cache"] = out.logits[:, -1], output_cache(out)
        run["next"] = logits.argmax(-1, keepdim=True)
        run["tokens"].append(int(run["next"][0]))
        time_attention(run["cache"], run["attn"])
        runs[label] = run
    shared = None  # the dense prefill's cache is no longer needed
    for _ in range(steps):
        for label, policy in policies.items():
            run = runs[label]
            with apply(model, policy):
                run["attn"].append(0.0)
                _sync(device)
                t0, c0 = time.perf_counter(), time.thread_time()
                logits = model(run["next"], **cache_kwargs(model, run["cache"]), use_cache=True).logits
                run["next"] = logits[:, -1].argmax(-1, keepdim=True)
                _sync(device)
                run["wall"].append(time.perf_counter() - t0)
                run["cpu"].append(time.thread_time() - c0)
                run["tokens"].append(int(run["next"][0]))
    on_cpu = device.type == "cpu"
    return {
        label: {
            "prefill_s": run["prefill_s"], "shared_prefill": run["shared_prefill"], "tokens": run["tokens"],
            "wall_ms": 1e3 * statistics.median(run["wall"][1:]),
            "cpu_ms": 1e3 * statistics.median(run["cpu"][1:]) if on_cpu else math.nan,
            "attention_ms": 1e3 * statistics.median(run["attn"][1:]) if on_cpu else math.nan,
            "stats": cache_stats(run["cache"]),
        }
        for label, run in runs.items()
    }


def run_bench(model: str = "smollm2", policies=(), budget: int | None = 256, lengths=(2048, 4096),
              new_tokens: int = 16, options=None, out=None, dtype=None, device=None, repeats: int = 1,
              interleave: bool = False, loaded=None) -> int:
    """Benchmark every policy (with ``budget`` where it takes one) at every length; print a table.

    Parameters
    ----------
    interleave : bool
        Decode all policies in turn from a shared prefill (:func:`interleaved_decode`) instead of
        one :func:`~kvpress.generation.timed_generate` run per policy; ``repeats`` is then unused.
    loaded : (model, tokenizer), optional
        Use this model instead of loading ``model`` (tests).
    """
    if new_tokens < (4 if interleave else 2):
        raise ValueError(f"new_tokens must be >= {4 if interleave else 2} (decode steps are timed after the "
                         f"first{', and the first timed step is left out' if interleave else ''}), got {new_tokens}")
    lengths = tuple(lengths)
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive ints, got {lengths!r}")
    names = tuple(policies) or tuple(kvpress.list_policies())
    names = tuple(sorted(names, key=lambda n: n != "full"))  # the reference first, for `agree`
    variants = expand_policies(names, (budget,) if budget else (), (), options or {})
    check_model_name(model)
    if loaded is None:
        t0 = time.perf_counter()
        loaded = load_eval_model(model, dtype=dtype, device=device or default_device())
        print(f"loaded {model} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    lm = loaded[0]
    vocab = lm.config.vocab_size
    env = environment()
    width = max([22] + [len(v.label) for v in variants])  # policy column fits the longest label
    header = (f"{'policy':<{width}} {'length':>7} {'prefill s':>9} {'decode ms/tok':>13} {'cpu ms/tok':>10} "
              f"{'attn ms/tok':>11} {'x full':>6} {'resident MiB':>12} {'offload MiB':>11} {'dense MiB':>9} "
              f"{'agree':>6}")
    mode = ("interleaved steps from a shared prefill, medians over steps 2..N" if interleave
            else f"one run per policy, mean over steps, best of {max(1, repeats)}")
    print(f"# model={model} device={lm.device} dtype={lm.dtype} threads={torch.get_num_threads()} "
          f"new_tokens={new_tokens} budget={budget} ({mode})")
    print(header)
    print("-" * len(header))
    rows = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(3, min(vocab, 32000) - 1, (1, length), generator=gen)
        cells = _interleaved_cells(lm, ids, variants, new_tokens) if interleave else _separate_cells(
            lm, ids, variants, new_tokens, repeats)
        reference = next((c for v, c in cells if v.policy.name == "full" and not isinstance(c, Exception)), None)
        for variant, cell in cells:
            if isinstance(cell, Exception):  # e.g. a policy that cannot run this model
                print(f"{variant.label:<{width}} {length:>7}  skipped: {cell}")
                continue
            agree = math.nan if reference is None else float(
                (torch.tensor(cell["tokens"]) == torch.tensor(reference["tokens"])).float().mean())
            speedup = math.nan if reference is None else reference["decode_ms"] / cell["decode_ms"]
            stats = cell["stats"]
            row = {
                "policy_label": variant.label, "policy": variant.config, "length": length, "model": model,
                "prefill_s": cell["prefill_s"], "decode_ms_per_token": cell["decode_ms"],
                "cpu_ms_per_token": cell["cpu_ms"], "attention_ms_per_token": cell["attention_ms"],
                "speedup_vs_full": speedup, "interleaved": interleave,
                "resident_mib": stats.resident_bytes / MIB, "offloaded_mib": stats.offloaded_bytes / MIB,
                "dense_mib": stats.dense_bytes / MIB, "agree": agree, "new_tokens": new_tokens,
                "threads": torch.get_num_threads(), "device": str(lm.device), "dtype": str(lm.dtype), **env,
            }
            rows.append(row)
            print(f"{variant.label:<{width}} {length:>7} {row['prefill_s']:>9.2f} {row['decode_ms_per_token']:>13.1f} "
                  f"{_fmt(row['cpu_ms_per_token'], 10)} {_fmt(row['attention_ms_per_token'], 11, 2)} "
                  f"{_fmt(speedup, 6, 2)} {row['resident_mib']:>12.2f} {row['offloaded_mib']:>11.2f} "
                  f"{row['dense_mib']:>9.2f} {agree:>6.2f}", flush=True)
    if out:
        _write(rows, Path(out))
    return 0


def _fmt(x: float, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if math.isnan(x) else f"{x:>{width}.{digits}f}"


def _separate_cells(model, ids, variants, new_tokens: int, repeats: int) -> list:
    cells = []
    for variant in variants:
        try:
            res, attn = bench_cell(model, variant.policy, ids, new_tokens, repeats)
        except (ValueError, RuntimeError) as exc:
            cells.append((variant, exc))
            continue
        cells.append((variant, {"prefill_s": res.prefill_s, "decode_ms": res.decode_ms_per_token, "cpu_ms": math.nan,
                                "attention_ms": attn, "tokens": res.tokens[0].tolist(), "stats": res.stats}))
    return cells


def _interleaved_cells(model, ids, variants, new_tokens: int) -> list:
    runnable, cells = {}, []
    for variant in variants:  # a policy that cannot run this model is reported, the others still run
        try:
            make_cache(model, variant.policy)  # checks the policy against the model (and its artifacts)
            runnable[variant.label] = variant
        except (ValueError, RuntimeError) as exc:
            cells.append((variant, exc))
    results = interleaved_decode(model, ids, {label: v.policy for label, v in runnable.items()}, new_tokens - 1)
    for label, variant in runnable.items():
        r = results[label]
        cells.append((variant, {**r, "decode_ms": r["wall_ms"]}))
    order = {v.label: i for i, v in enumerate(variants)}
    return sorted(cells, key=lambda c: order[c[0].label])


def _write(rows: list[dict], out: Path) -> None:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.jsonl", "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    with open(out / "bench.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, BENCH_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
