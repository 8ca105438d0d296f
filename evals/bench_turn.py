"""The cost of a new turn: one forward of ``--turn`` tokens on a cache that already holds a prompt.

A chat's next user message, a document's next question, or an assisted-decoding verification
is a forward of several tokens after the prompt. A verification must attend as that many decode
steps would; a new turn (what this times: no past recording) is attended as a prompt
continuation by most policies, ``snapkv`` selects again over its kept tokens and the turn's
(``snapkv:reselect_turns=false``: as steps). Per policy (one after the other, repeated
``--rounds`` times, interleaved)::

    python -m kvpress.evals.bench_turn --model smollm2 --length 4096 --turn 256 \\
        --policies full,snapkv,shadowkv,window,kivi:bits=4 --budget 256 --threads 2

Columns: the prompt forward's seconds (not the point, printed for scale), the turn's seconds
(median over rounds), its ms per token, the ratio to ``full``'s turn in the same round, and with
``--check`` the largest difference between the turn's last logits and those of the same tokens
fed one at a time on a second cache (0 up to rounding where the policy attends a new turn as
one-token steps: ``window``, ``streaming``, ``snapkv:reselect_turns=false``; that costs a second
prefill per policy).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import kvpress
from kvpress.compat import cache_kwargs

from .models import check_model_name, default_device, load_eval_model
from .results import environment, write_jsonl
from .runner import add_policy_bench_args, expand_policies, policy_bench_setup
from .tasks import build_input_ids, get_task


def _prefilled(model, policy, prompt):
    cache = kvpress.make_cache(model, policy)
    t0 = time.perf_counter()
    model(prompt, use_cache=True, **cache_kwargs(model, cache))
    return cache, time.perf_counter() - t0


def run(model_name: str, policies, *, budget: int | None, length: int, turn: int, rounds: int = 1,
        check: bool = False, out: str | None = None, loaded=None) -> list[dict]:
    check_model_name(model_name)
    if turn < 2:
        raise ValueError(f"turn={turn} must be >= 2 (one token is a decode step)")
    variants = expand_policies(tuple(policies), (budget,) if budget else (), (), {})
    model, tokenizer = loaded or load_eval_model(model_name, device=default_device())
    task = get_task("niah_single", haystack="noise", value_type="numbers", depth=0.5)
    sample = task.generate(tokenizer, length=length + turn, num_samples=1, seed=0)[0]
    ids = torch.tensor([build_input_ids(tokenizer, sample)], device=model.device)
    if ids.shape[1] <= turn:
        raise ValueError(f"the sample has {ids.shape[1]} tokens, not more than turn={turn}")
    prompt, new = ids[:, :-turn], ids[:, -turn:]
    print(f"# model={model_name} device={model.device} threads={torch.get_num_threads()} prompt={prompt.shape[1]} "
          f"tokens turn={turn} budget={budget} rounds={rounds}")
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    prefill: dict[str, float] = {}
    diffs: dict[str, float] = {}
    with torch.no_grad():
        for r in range(rounds):
            for v in variants:
                with kvpress.apply(model, v.policy):
                    cache, prefill[v.label] = _prefilled(model, v.policy, prompt)
                    t0 = time.perf_counter()
                    logits = model(new, use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
                    times[v.label].append(time.perf_counter() - t0)
                    if check and r == 0:
                        steps, _ = _prefilled(model, v.policy, prompt)
                        for t in range(turn):
                            last = model(new[:, t:t + 1], use_cache=True, **cache_kwargs(model, steps)).logits[0, -1]
                        diffs[v.label] = float((logits.float() - last.float()).abs().max())
    width = max([24] + [len(v.label) for v in variants])
    header = (f"{'policy':<{width}} {'prefill s':>9} {'turn s':>8} {'ms/token':>9} {'vs full':>8}"
              + (f" {'max |dlogit| vs steps':>22}" if check else ""))
    print(header)
    print("-" * len(header))
    base = times.get(next((v.label for v in variants if v.policy.name == "full"), ""), None)
    rows, env = [], environment()
    for v in variants:
        med = statistics.median(times[v.label])
        ratio = (statistics.median(a / b for a, b in zip(times[v.label], base)) if base else float("nan"))
        row = {"policy_label": v.label, "policy": v.config, "model": model_name, "prompt_tokens": prompt.shape[1],
               "turn_tokens": turn, "prefill_s": prefill[v.label], "turn_s": med, "turn_s_all": times[v.label],
               "turn_vs_full": ratio, "max_abs_logit_diff_vs_steps": diffs.get(v.label),
               "threads": torch.get_num_threads(), **env}
        rows.append(row)
        print(f"{v.label:<{width}} {prefill[v.label]:>9.2f} {med:>8.3f} {1000 * med / turn:>9.2f} {ratio:>8.2f}"
              + (f" {diffs[v.label]:>22.2e}" if check else ""), flush=True)
    if out:
        write_jsonl(out, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpress.evals.bench_turn", description=__doc__.split("\n\n")[0])
    add_policy_bench_args(p, policies="full,snapkv,shadowkv", length=4096)
    p.add_argument("--turn", type=int, default=256, help="tokens of the new turn (>= 2)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of all policies (medians reported)")
    p.add_argument("--check", action="store_true", help="compare the turn's last logits with one token at a time")
    args = p.parse_args(argv)
    common = policy_bench_setup(args)
    run(args.model, common.pop("policies"), turn=args.turn, rounds=args.rounds, check=args.check, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
