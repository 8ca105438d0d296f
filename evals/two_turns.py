"""Needles across two turns: does a policy still answer after a long second turn?

A chat's first turn (``--length`` minus ``--turn`` tokens of a niah_single haystack) fills the
cache; its second turn (the last ``--turn`` tokens: the rest of the haystack and the question)
arrives as one forward on that cache, as a second ``generate`` on a kept cache sends it; then
greedy decoding answers. The needle sits either in the first turn (``--needle prompt``: the
second turn must not crowd it out) or in the second (``--needle turn``: the policy must keep
what arrived after its prefill), spread over that part (the question's end of the second turn
excepted), one position per sample::

    python -m kvpress.evals.two_turns --model smollm2 --length 4096 --turn 1024 --samples 8 \\
        --policies full,shadowkv,shadowkv:fold_size=0 --budget 256 --needle prompt,turn

Columns per policy and placement: the fraction answered (the tasks' scorer), decode ms per
token after the turn, resident MiB after decoding (``kvpress.cache_stats``) and the most tokens
one KV head attended in a step where the policy reports it (``max_attended``).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

import kvpress
from kvpress.compat import cache_kwargs
from kvpress.prefill import cache_from_dense

from .decode import decode_from_cache, shared_prefill
from .models import check_model_name, default_device, load_eval_model
from .results import environment, write_jsonl
from .runner import add_policy_bench_args, expand_policies, policy_bench_setup
from .tasks import build_input_ids, get_task
from .tasks.base import score_prediction

PLACEMENTS = ("prompt", "turn")


def _needle_token(tokenizer, ids: list[int], answers) -> int:
    """Index of the token that completes the first answer string in ``ids`` (binary search on prefixes)."""
    lo, hi = 0, len(ids)
    if not any(a in tokenizer.decode(ids) for a in answers):
        raise RuntimeError("the sample's needle is not in its tokens")
    while lo < hi:
        mid = (lo + hi) // 2
        if any(a in tokenizer.decode(ids[: mid + 1]) for a in answers):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _sample(tokenizer, part: str, index: int, samples: int, length: int, turn: int):
    """A niah_single sample of ``length`` tokens whose needle lies in ``part``; its input ids.

    Depth is a fraction of the haystack's words, so it is mapped to token positions through the
    needle's position at depths 0 and 1 of the same seed; targets spread over the part."""
    def make(depth):
        sample = get_task("niah_single", depth=min(max(depth, 0.0), 1.0)).generate(
            tokenizer, length=length, num_samples=1, seed=index)[0]
        ids = build_input_ids(tokenizer, sample)
        return sample, ids, _needle_token(tokenizer, ids, sample.answers)

    (_, _, p0), (_, ids1, p1) = make(0.0), make(1.0)
    split = len(ids1) - turn  # first token of the second turn (lengths vary by a few tokens)
    lo, hi = (p0 + 0.05 * (split - p0), split - 0.1 * (split - p0)) if part == "prompt" else (split + 32, p1 - 8)
    target = lo + (hi - lo) * index / max(samples - 1, 1)
    depth = (target - p0) / max(p1 - p0, 1)
    for _ in range(8):  # the word-to-token mapping is close to linear: correct it from the miss
        sample, ids, pos = make(depth)
        if (pos < len(ids) - turn) == (part == "prompt"):
            break
        depth += (target - pos) / max(p1 - p0, 1) + (0.002 if part == "turn" else -0.002)
    else:
        raise RuntimeError(f"sample {index}: no depth puts its needle in the {part} "
                           f"(last at token {pos} of {len(ids)})")
    return sample, ids, pos


def _answer(model, tokenizer, policy, prefill, first, new, sample) -> dict:
    """Second turn ``new`` (1, n) on a cache holding the first (``first``, densely in ``prefill``),
    then greedy decoding."""
    if policy.prefills_densely():
        cache = cache_from_dense(model, policy, prefill.cache)
    else:  # the policy's own prefill
        cache = kvpress.make_cache(model, policy)
        with kvpress.apply(model, policy):
            model(first, use_cache=True, **cache_kwargs(model, cache))
    start, n = prefill.length, new.shape[1]
    with kvpress.apply(model, policy):
        out = model(input_ids=new, attention_mask=torch.ones(1, start + n, dtype=torch.long, device=new.device),
                    position_ids=torch.arange(start, start + n, device=new.device)[None],
                    use_cache=True, **cache_kwargs(model, cache))
    tokens, ms = decode_from_cache(model, policy, cache, out.logits[:, -1], start + n,
                                   max_new_tokens=sample.max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    attended = [getattr(layer, "max_attended", None) for layer in cache.layers]
    attended = [a for a in attended if a is not None]
    return {"score": score_prediction(text, sample.answers), "prediction": text, "decode_ms_per_token": ms,
            "resident_bytes": kvpress.cache_stats(cache).resident_bytes,
            "max_attended": max(attended) if attended else None}


def run(model_name: str, policies, *, budget: int | None, length: int, turn: int, samples: int,
        needle=PLACEMENTS, out: str | None = None, loaded=None) -> list[dict]:
    check_model_name(model_name)
    bad = [p for p in needle if p not in PLACEMENTS]
    if bad or not needle:
        raise ValueError(f"needle={list(needle)!r}: allowed placements are {PLACEMENTS}")
    if not 64 <= turn <= length // 2:
        raise ValueError(f"turn={turn} must be in [64, length / 2] = [64, {length // 2}]")
    variants = expand_policies(tuple(policies), (budget,) if budget else (), (), {})
    model, tokenizer = loaded or load_eval_model(model_name, device=default_device())
    print(f"# model={model_name} device={model.device} threads={torch.get_num_threads()} length={length} "
          f"turn={turn} budget={budget} samples={samples}")
    rows, env = [], environment()
    with torch.no_grad():
        for part in needle:
            for index in range(samples):
                sample, ids, pos = _sample(tokenizer, part, index, samples, length, turn)
                ids = torch.tensor([ids], device=model.device)
                first = ids[:, :-turn]
                prefill = shared_prefill(model, first)
                for v in variants:
                    row = _answer(model, tokenizer, v.policy, prefill, first, ids[:, -turn:], sample)
                    rows.append({"policy_label": v.label, "policy": v.config, "model": model_name, "needle": part,
                                 "sample": index, "needle_token": pos, "tokens": ids.shape[1],
                                 "answers": sample.answers, "prompt_tokens": first.shape[1], "turn_tokens": turn,
                                 **row, "threads": torch.get_num_threads(), **env})
                    print(f"  {part:<6} #{index} (needle at {pos}/{ids.shape[1]}) {v.label:<28} "
                          f"score {row['score']:.2f}  {row['prediction']!r}", flush=True)
    width = max([24] + [len(v.label) for v in variants])
    header = (f"{'policy':<{width}} {'needle':>6} {'score':>6} {'n':>3} {'ms/token':>9} {'resident MiB':>12} "
              f"{'max attended':>12}")
    print(header)
    print("-" * len(header))
    for part in needle:
        for v in variants:
            mine = [r for r in rows if r["policy_label"] == v.label and r["needle"] == part]
            attended = [r["max_attended"] for r in mine if r["max_attended"] is not None]
            ms = [r["decode_ms_per_token"] for r in mine if r["decode_ms_per_token"] == r["decode_ms_per_token"]]
            print(f"{v.label:<{width}} {part:>6} {statistics.mean(r['score'] for r in mine):>6.2f} {len(mine):>3} "
                  f"{statistics.mean(ms) if ms else float('nan'):>9.1f} "
                  f"{statistics.mean(r['resident_bytes'] for r in mine) / 2**20:>12.1f} "
                  f"{(str(max(attended)) if attended else '-'):>12}")
    if out:
        write_jsonl(out, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpress.evals.two_turns", description=__doc__.split("\n\n")[0])
    add_policy_bench_args(p, policies="full,shadowkv", length=4096)
    p.add_argument("--turn", type=int, default=1024, help="tokens of the second turn")
    p.add_argument("--samples", type=int, default=4, help="samples per needle placement")
    p.add_argument("--needle", default="prompt,turn", help="where the needle is: prompt, turn or both")
    args = p.parse_args(argv)
    common = policy_bench_setup(args)
    run(args.model, common.pop("policies"), turn=args.turn, samples=args.samples,
        needle=tuple(s for s in args.needle.split(",") if s), **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
