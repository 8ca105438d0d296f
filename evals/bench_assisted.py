"""Assisted decoding under each policy: plain greedy against prompt lookup decoding.

transformers' ``generate(prompt_lookup_num_tokens=K)`` drafts up to ``K`` tokens by finding the
last generated n-gram earlier in the prompt and copying what followed it; one forward verifies
the drafts, and the cache takes back the rejected ones (``crop``, which every policy but
``zipcache`` supports). When the answer copies the context -- quoting, extraction, code edits --
most drafts are accepted and a forward yields several tokens. This benchmark asks the model to
repeat a paragraph of a long prose context (the shipped book; the paragraph from the middle)
and times, per policy, plain greedy decoding and prompt lookup decoding of the same number of
tokens, one after the other::

    python -m kvpress.evals.bench_assisted --model smollm2 --length 4096 --new-tokens 64 \\
        --policies full,streaming,duo,kivi:bits=4,double_sparsity,quest,shadowkv,snapkv --budget 256

First the cost of a verification: ``full``'s forward of ``K + 1`` tokens against one token's on
the prompt's cache (on a CPU a multi-token forward is far from free: the linear layers' GEMMs of a
few rows cost several GEMVs). Columns: decode ms per token after the first (generate's wall time less its first forward, over
``new_tokens - 1``), the speed-up of prompt lookup, forwards after the prompt's and tokens per
verification forward, whether prompt lookup gave plain greedy's tokens ("same"), and the tokens
agreeing with ``full``'s plain output. EOS is suppressed until ``new_tokens`` (``min_new_tokens``)
so every run decodes the same count.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import kvpress
from kvpress.compat import cache_kwargs, output_cache

from .models import check_model_name, default_device, load_eval_model
from .results import MIB, environment, write_jsonl
from .runner import add_policy_bench_args, expand_policies, policy_bench_setup
from .tasks.haystack import prose_text


def copy_prompt(tokenizer, length: int) -> torch.Tensor:
    """``(1, ~length)`` ids: prose, then a request to repeat the paragraph at the middle of it."""
    paragraphs = [p.strip() for p in prose_text().split("\n\n") if len(p.split()) >= 40]
    ask = "Repeat, word for word, the paragraph of the story above that begins with: \"{}\""
    words_per_token = 0.7
    text = ""
    for n in range(1, len(paragraphs) + 1):
        text = "\n\n".join(paragraphs[:n])
        if len(text.split()) / words_per_token >= length:
            break
    used = text.split("\n\n")
    while True:  # trim to the length with the question and chat formatting counted
        target = used[len(used) // 2]
        question = ask.format(" ".join(target.split()[:8]))
        ids = _encode(tokenizer, "\n\n".join(used) + "\n\n" + question)
        if ids.shape[1] <= length or len(used) < 3:
            return ids
        used = used[:-1]


def _encode(tokenizer, text: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        return torch.as_tensor(ids)
    return torch.as_tensor(tokenizer(text, return_tensors="pt")["input_ids"])


class _ForwardClock:
    """Wall time of each forward of ``model`` (a pre- and a post-hook)."""

    def __init__(self, model):
        self.times: list[float] = []
        self._t0 = 0.0
        self._handles = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._stop)]

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.times.append(time.perf_counter() - self._t0)

    def close(self):
        for h in self._handles:
            h.remove()


def timed(model, ids: torch.Tensor, policy, new_tokens: int, **generate_kwargs) -> dict:
    """One greedy ``generate`` of exactly ``new_tokens`` under ``policy``; wall times and forwards."""
    clock = _ForwardClock(model)
    try:
        with torch.no_grad(), kvpress.apply(model, policy):
            start = time.perf_counter()
            out = model.generate(ids.to(model.device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, return_dict_in_generate=True, **generate_kwargs)
            wall = time.perf_counter() - start
    finally:
        clock.close()
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    stats = kvpress.cache_stats(output_cache(out))
    return {"tokens": tokens, "wall_s": wall, "prefill_s": clock.times[0], "forwards": len(clock.times) - 1,
            "decode_ms": 1000 * (wall - clock.times[0]) / max(1, len(tokens) - 1),
            "resident_mib": stats.resident_bytes / MIB}


def forward_cost(model, ids: torch.Tensor, tokens: int, repeats: int = 3) -> float:
    """Median seconds of a ``tokens``-token forward on ``ids``' cache under ``full`` (crop undoes each)."""
    policy = kvpress.get_policy("full")
    cache = kvpress.make_cache(model, policy)
    times = []
    with torch.no_grad(), kvpress.apply(model, policy):
        model(ids.to(model.device), use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        for _ in range(repeats):
            x = ids[:, -tokens:].to(model.device)
            start = time.perf_counter()
            model(x, use_cache=True, logits_to_keep=tokens, **cache_kwargs(model, cache))
            times.append(time.perf_counter() - start)
            cache.crop(-tokens)
    return sorted(times)[len(times) // 2]


def run(model_name: str, policies, *, budget: int | None, length: int, new_tokens: int, lookup: int,
        out: str | None = None, loaded=None) -> list[dict]:
    check_model_name(model_name)
    names = tuple(sorted(policies, key=lambda n: n.split(":")[0] != "full")) or ("full",)
    variants = expand_policies(names, (budget,) if budget else (), (), {})
    model, tokenizer = loaded or load_eval_model(model_name, device=default_device())
    ids = copy_prompt(tokenizer, length)
    print(f"# model={model_name} device={model.device} threads={torch.get_num_threads()} prompt={ids.shape[1]} "
          f"tokens new_tokens={new_tokens} prompt_lookup_num_tokens={lookup} budget={budget}")
    one, verify = forward_cost(model, ids, 1), forward_cost(model, ids, lookup + 1)
    print(f"# full: a forward of 1 token {1000 * one:.1f} ms, of {lookup + 1} tokens (a verification) "
          f"{1000 * verify:.1f} ms ({verify / one:.2f}x): drafts pay when a verification yields more tokens than that")
    width = max([24] + [len(v.label) for v in variants])
    header = (f"{'policy':<{width}} {'plain ms/tok':>12} {'lookup ms/tok':>13} {'speed-up':>8} {'forwards':>8} "
              f"{'tok/fwd':>7} {'same':>5} {'agree full':>10} {'resident MiB':>12}")
    print(header)
    print("-" * len(header))
    rows, reference = [], None
    env = environment()
    for v in variants:
        plain = timed(model, ids, v.policy, new_tokens)
        if reference is None and v.policy.name == "full":
            reference = plain["tokens"]
        try:
            assisted = timed(model, ids, v.policy, new_tokens, prompt_lookup_num_tokens=lookup)
        except ValueError as exc:  # a policy that cannot take tokens back
            print(f"{v.label:<{width}} {plain['decode_ms']:>12.1f}  prompt lookup refused: {str(exc)[:60]}...")
            continue
        agree = float("nan") if reference is None else sum(
            a == b for a, b in zip(assisted["tokens"], reference)) / len(reference)
        row = {"policy_label": v.label, "policy": v.config, "model": model_name, "prompt_tokens": ids.shape[1],
               "new_tokens": new_tokens, "prompt_lookup_num_tokens": lookup,
               "plain_decode_ms_per_token": plain["decode_ms"], "lookup_decode_ms_per_token": assisted["decode_ms"],
               "speedup": plain["decode_ms"] / assisted["decode_ms"], "lookup_forwards": assisted["forwards"],
               "tokens_per_forward": (new_tokens - 1) / max(1, assisted["forwards"]),
               "same_tokens": assisted["tokens"] == plain["tokens"], "agree_full": agree,
               "resident_mib": assisted["resident_mib"], "plain_prefill_s": plain["prefill_s"],
               "full_forward_ms_1": 1000 * one, f"full_forward_ms_{lookup + 1}": 1000 * verify,
               "threads": torch.get_num_threads(), **env}
        rows.append(row)
        print(f"{v.label:<{width}} {row['plain_decode_ms_per_token']:>12.1f} {row['lookup_decode_ms_per_token']:>13.1f} "
              f"{row['speedup']:>8.2f} {row['lookup_forwards']:>8} {row['tokens_per_forward']:>7.2f} "
              f"{'yes' if row['same_tokens'] else 'no':>5} {agree:>10.2f} {row['resident_mib']:>12.1f}", flush=True)
    if out:
        write_jsonl(out, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpress.evals.bench_assisted", description=__doc__.split("\n\n")[0])
    add_policy_bench_args(p, policies="full,streaming,kivi:bits=4,double_sparsity,shadowkv,snapkv", length=4096)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    args = p.parse_args(argv)
    common = policy_bench_setup(args)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (the first token comes from the prompt's forward)")
    run(args.model, common.pop("policies"), new_tokens=args.new_tokens, lookup=args.lookup, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
