"""``kvpress bench``: end-to-end decode ms/token, prefill time and KV bytes per policy and length.

Each cell greedily generates ``new_tokens`` tokens (eos ignored, so every run times the same
number of steps) from a prompt of random token ids, under the policy's own prefill. Random
weights of real shapes (``--model random-llama3-8b``, see :mod:`kvpress.evals.models`) measure
speed at lengths a small real model does not reach. ``agree`` is the fraction of generated tokens
equal to ``full``'s for the same prompt (1.0 for exact policies; a quick sanity check).

    kvpress bench --model random-llama3-8b --policies full,streaming --lengths 4096,16384 --budget 512
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

import kvpress
from kvpress.generation import timed_generate

from .models import check_model_name, default_device, load_eval_model
from .results import MIB, environment
from .runner import expand_policies

BENCH_COLUMNS = ("policy_label", "length", "prefill_s", "decode_ms_per_token", "resident_mib", "offloaded_mib",
                 "dense_mib", "agree")


def bench_cell(model, policy, ids: torch.Tensor, new_tokens: int, repeats: int = 1):
    """Best of ``repeats`` timed generations; returns the GenerationResult of the fastest decode."""
    best = None
    for _ in range(max(1, repeats)):
        result = timed_generate(model, ids, policy, max_new_tokens=new_tokens, eos_token_id=[])
        if best is None or result.decode_ms_per_token < best.decode_ms_per_token:
            best = result
    return best


def run_bench(model: str = "smollm2", policies=(), budget: int | None = 256, lengths=(2048, 4096),
              new_tokens: int = 16, options=None, out=None, dtype=None, device=None, repeats: int = 1,
              loaded=None) -> int:
    """Benchmark every policy (with ``budget`` where it takes one) at every length; print a table.

    Parameters
    ----------
    loaded : (model, tokenizer), optional
        Use this model instead of loading ``model`` (tests).
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (decode steps are timed after the first), got {new_tokens}")
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
    header = (f"{'policy':<22} {'length':>7} {'prefill s':>9} {'decode ms/tok':>13} {'resident MiB':>12} "
              f"{'offload MiB':>11} {'dense MiB':>9} {'agree':>6}")
    print(f"# model={model} device={lm.device} dtype={lm.dtype} new_tokens={new_tokens} budget={budget}")
    print(header)
    print("-" * len(header))
    rows = []
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(3, min(vocab, 32000) - 1, (1, length), generator=gen)
        reference = None
        for variant in variants:
            try:
                res = bench_cell(lm, variant.policy, ids, new_tokens, repeats)
            except (ValueError, RuntimeError) as exc:  # e.g. a policy that cannot run this model
                print(f"{variant.label:<22} {length:>7}  skipped: {exc}")
                continue
            tokens = res.tokens[0]
            if variant.policy.name == "full":
                reference = tokens
            agree = float((tokens == reference).float().mean()) if reference is not None else math.nan
            row = {
                "policy_label": variant.label, "policy": variant.config, "length": length, "model": model,
                "prefill_s": res.prefill_s, "decode_ms_per_token": res.decode_ms_per_token,
                "resident_mib": res.stats.resident_bytes / MIB, "offloaded_mib": res.stats.offloaded_bytes / MIB,
                "dense_mib": res.stats.dense_bytes / MIB, "agree": agree, "new_tokens": new_tokens,
                "device": str(lm.device), "dtype": str(lm.dtype), **env,
            }
            rows.append(row)
            print(f"{variant.label:<22} {length:>7} {res.prefill_s:>9.2f} {res.decode_ms_per_token:>13.1f} "
                  f"{row['resident_mib']:>12.2f} {row['offloaded_mib']:>11.2f} {row['dense_mib']:>9.2f} "
                  f"{agree:>6.2f}", flush=True)
    if out:
        _write(rows, Path(out))
    return 0


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
