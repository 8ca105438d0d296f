"""How far each policy moves the model's next-token distributions along ``full``'s own answers.

``python benchmarks/answer_kl.py --task niah_multivalue --length 4096 --samples 64-75 --policies kivi:bits=8,zipcache``

Answer flips on a needle task are rare, sample-specific events: two policies with the same score
can flip different samples, and a few hundred samples are needed to tell 96% from 98%. This
measures the perturbation that causes flips, continuously, on few samples. For each sample the
unpatched model answers greedily; then, under each policy, the prompt is prefilled and that same
answer is fed back one decode step at a time (teacher forcing, so every policy sees the same
tokens), and at every answer step the policy's next-token distribution is compared with the
unpatched model's: mean KL(full || policy) in nats per step, the share of steps whose top-1
token differs, and the largest KL of a step. Lower is closer to ``full``.

`benchmarks/teacher_forced_kl.py` does the same per step on a random prompt from one shared dense
prefill; this one runs task samples with each policy's own prefill (the quantizers' probes and
stores are built as in an eval) and sums over whole answers.
"""

from __future__ import annotations

import argparse
import time

import torch

import kvpress
from kvpress.compat import cache_kwargs, output_cache
from kvpress.evals.margins import parse_samples
from kvpress.evals.models import load_eval_model
from kvpress.evals.tasks import get_task
from kvpress.evals.tasks.base import build_input_ids


def teacher_forced_logprobs(model, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities (T, vocab) of the next token after the prompt and after each of the
    first T - 1 answer tokens, the answer fed as one-token decode steps on the model's cache."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, rows = output_cache(out), [out.logits[0, -1].float().log_softmax(-1)]
        for t in range(answer.shape[0] - 1):
            out = model(answer[None, t : t + 1], **cache_kwargs(model, cache), use_cache=True)
            cache = output_cache(out)
            rows.append(out.logits[0, -1].float().log_softmax(-1))
    return torch.stack(rows)


def answer_kl(model, tokenizer, samples, specs: list[str], indices: list[int]) -> dict[str, dict]:
    """Per policy spec: answer ``steps``, ``kl`` (summed nats), ``top1_diff`` (steps whose argmax
    differs from the unpatched model's) and ``max_kl`` over the samples ``indices`` (printed as
    they are measured)."""
    policies = [kvpress.get_policy(s) for s in specs]
    totals = {s: dict(steps=0, kl=0.0, top1_diff=0, max_kl=0.0) for s in specs}
    print(f"{'sample':>6}  {'steps':>5}  {'policy':<60}  {'mean KL':>9}  {'top-1 diff':>10}  {'max KL':>9}  {'s':>5}")
    for i in indices:
        prompt = torch.tensor([build_input_ids(tokenizer, samples[i])], device=model.device)
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=samples[i].max_new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
        answer = gen.sequences[0, prompt.shape[1]:]
        ref = torch.stack([x[0].float().log_softmax(-1) for x in gen.logits])  # the greedy steps' own logits
        for spec, policy in zip(specs, policies):
            t0 = time.perf_counter()
            with kvpress.apply(model, policy):
                got = teacher_forced_logprobs(model, prompt, answer)
            kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0)  # (T,) nats
            diff = int((ref.argmax(-1) != got.argmax(-1)).sum())
            tot = totals[spec]
            tot["steps"] += kl.numel()
            tot["kl"] += float(kl.sum())
            tot["top1_diff"] += diff
            tot["max_kl"] = max(tot["max_kl"], float(kl.max()))
            print(f"{i:>6}  {kl.numel():>5}  {spec:<60}  {float(kl.mean()):>9.3e}  {diff:>10}  {float(kl.max()):>9.3e}"
                  f"  {time.perf_counter() - t0:>5.1f}", flush=True)
    return totals


def main(argv=None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, a local folder, random-tiny, ... (kvpress.evals.models)")
    parser.add_argument("--task", default="niah_multivalue", help="task spec, as in `kvpress eval --tasks`")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", default="64-71", help="sample indices, e.g. 64-71 or 0,2,5")
    parser.add_argument("--seed", type=int, default=0, help="task seed (the eval's default is 0)")
    parser.add_argument("--policies", required=True, help="comma-separated policy specs")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [s for s in args.policies.split(",") if s]
    for spec in specs:
        kvpress.get_policy(spec)  # bad specs fail before the model loads
    indices = parse_samples(args.samples)
    model, tokenizer = load_eval_model(args.model)
    samples = get_task(args.task).generate(tokenizer, args.length, max(indices) + 1, args.seed)
    totals = answer_kl(model, tokenizer, samples, specs, indices)
    print(f"\nover samples {args.samples} of {args.task} at {args.length} tokens:")
    print("| policy | answer steps | mean KL (nats) | top-1 differs | max KL |\n|---|---:|---:|---:|---:|")
    for spec, t in totals.items():
        n = max(t["steps"], 1)
        print(f"| `{spec}` | {t['steps']} | {t['kl'] / n:.3e} | {t['top1_diff']} ({t['top1_diff'] / n:.1%}) | {t['max_kl']:.3e} |")
    return totals


if __name__ == "__main__":
    main()
