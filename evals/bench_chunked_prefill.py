"""Peak memory of ``generate`` with the prompt in one forward or in chunks (``prefill_chunk_size``).

A compressed cache saves memory only if the prefill does not spend it first: one forward of a
long prompt holds the MLP's activations for every prompt token (``T x intermediate`` floats,
several at once), which at long context rivals or exceeds a compressed cache.
``generate(prefill_chunk_size=N)`` bounds them to ``N`` tokens; under ``kvpress.apply`` the
prompt still ends as one forward would leave it (`kvpress.cache.PolicyCache.prompt`), except
that ``snapkv`` / ``shadowkv`` / ``duo:prefill=dense`` hold the whole dense prompt until its
end, and the quantizers' later chunks read the earlier ones quantized. Per policy and chunk::

    python -m kvpress.evals.bench_chunked_prefill --model smollm2 --length 8192 --chunks 0,1024 \\
        --policies full,kivi:bits=4,streaming,duo,snapkv,shadowkv --budget 256 --threads 1

Columns: peak bytes of live tensors allocated during ``generate`` (on CPU from the torch
profiler's allocation events; on CUDA ``max_memory_allocated`` above what was allocated before;
model weights excluded), the resident KV and the host tier at the end (``cache_stats``), the
peak less what the cache holds at the end (the prefill's working memory; on a CPU the host
tier is the same memory and is subtracted too), with ``--time`` the wall time of ``generate`` in a separate run
without the profiler, and whether the tokens equal the one-forward run's. ``--new-tokens``
tokens are generated (greedy).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import kvpress
from kvpress.compat import output_cache

from .bench_kernels import parse_ints
from .models import check_model_name, default_device, load_eval_model
from .results import MIB, environment, write_jsonl
from .runner import add_policy_bench_args, expand_policies, policy_bench_setup
from .tasks import build_input_ids, get_task


def _generate(model, ids, policy, new_tokens: int, chunk: int):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    if chunk:
        kw["prefill_chunk_size"] = chunk
    with torch.no_grad(), kvpress.apply(model, policy):
        return model.generate(ids, **kw)


def peak_bytes(fn, device: torch.device) -> tuple[int, object]:
    """(peak bytes of the tensors allocated while ``fn()`` runs, its result): on CUDA the allocator's
    peak above what was allocated before; on CPU the running sum of the profiler's allocation events."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, nbytes in events:  # frees of tensors made before the profile started are not reported
        live += nbytes
        peak = max(peak, live)
    return peak, out


def run(model_name: str, policies, *, budget: int | None, length: int, chunks: list[int], new_tokens: int,
        timed: bool = False, out: str | None = None, loaded=None) -> list[dict]:
    check_model_name(model_name)
    variants = expand_policies(tuple(policies), (budget,) if budget else (), (), {})
    model, tokenizer = loaded or load_eval_model(model_name, device=default_device())
    task = get_task("niah_single", haystack="noise", value_type="numbers", depth=0.5)
    sample = task.generate(tokenizer, length=length, num_samples=1, seed=0)[0]
    ids = torch.tensor([build_input_ids(tokenizer, sample)], device=model.device)
    print(f"# model={model_name} device={model.device} threads={torch.get_num_threads()} prompt={ids.shape[1]} "
          f"tokens new_tokens={new_tokens} budget={budget}")
    width = max([24] + [len(v.label) for v in variants])
    header = (f"{'policy':<{width}} {'chunk':>6} {'peak MiB':>9} {'KV MiB':>8} {'host MiB':>8} {'peak - KV':>9} "
              f"{'generate s':>10} {'same':>5}")
    print(header)
    print("-" * len(header))
    rows, env = [], environment()
    for v in variants:
        first = None
        for chunk in chunks:
            seconds = float("nan")
            if timed:
                t0 = time.perf_counter()
                _generate(model, ids, v.policy, new_tokens, chunk)
                seconds = time.perf_counter() - t0
            peak, res = peak_bytes(lambda: _generate(model, ids, v.policy, new_tokens, chunk), model.device)
            tokens = res.sequences[0, ids.shape[1]:].tolist()
            first = tokens if first is None else first
            stats = kvpress.cache_stats(output_cache(res))
            kv, host = stats.resident_bytes, stats.offloaded_bytes
            # on a CPU the host tier is the same memory: both count against the peak
            held = kv + host if model.device.type == "cpu" else kv
            row = {"policy_label": v.label, "policy": v.config, "model": model_name, "prompt_tokens": ids.shape[1],
                   "prefill_chunk_size": chunk or None, "new_tokens": new_tokens, "peak_mib": peak / MIB,
                   "kv_mib": kv / MIB, "host_mib": host / MIB, "generate_s": seconds,
                   "same_tokens_as_first": tokens == first, "threads": torch.get_num_threads(), **env}
            rows.append(row)
            print(f"{v.label:<{width}} {chunk or '-':>6} {peak / MIB:>9.1f} {kv / MIB:>8.1f} {host / MIB:>8.1f} "
                  f"{(peak - held) / MIB:>9.1f} {seconds:>10.1f} {'yes' if tokens == first else 'no':>5}", flush=True)
    if out:
        write_jsonl(out, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpress.evals.bench_chunked_prefill",
                                description=__doc__.split("\n\n")[0])
    add_policy_bench_args(p, policies="full,kivi:bits=4,streaming,duo,snapkv,shadowkv", length=8192)
    p.add_argument("--chunks", default="0,1024", help="prefill_chunk_size values, comma list (0: one forward)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--time", action="store_true", help="also time generate in a run without the profiler")
    args = p.parse_args(argv)
    common = policy_bench_setup(args)
    run(args.model, common.pop("policies"), chunks=parse_ints(args.chunks), new_tokens=args.new_tokens,
        timed=args.time, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
