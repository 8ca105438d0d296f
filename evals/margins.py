"""Greedy decision margins on eval samples: how close each answer is to flipping.

``python -m kvpress.evals.margins --task niah_multikey --length 4096 --samples 0-7``

A policy that perturbs attention a little (4-bit keys, streaming heads, a sparse selection)
changes a greedy answer first where the model's own top-1 and top-2 next tokens are close. For
each sample this decodes greedily (the unmodified model, or ``--policy``) and reports, over the
steps that produce the answer, the smallest ``log p(top-1) - log p(top-2)`` (nats) and the
runner-up token there, and the same minimum over the answer's own tokens only (``content``:
format steps such as a leading space are left out). Reading an eval with it separates a policy that loses retrieval from one
that flips samples the model itself nearly got wrong.

Measured on SmolLM2 at 4k: the needle samples ``kivi:bits=4`` and
``duo`` lose are those where the full model's margin is below 1 nat (kivi answers exactly the
runner-up digit), while samples with margins of 1.4 nats and more survive both.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch

import kvpress
from kvpress.evals.tasks import get_task
from kvpress.evals.tasks.base import build_input_ids


@dataclass(frozen=True)
class SampleMargin:
    """Greedy decoding of one sample with the closest decision on the way to its answer."""

    index: int
    prediction: str
    score: float
    min_margin: float  # nats, over the steps up to the one that completes the answer
    step: int  # the step where it occurs (0 = first generated token)
    token: str  # the token chosen there
    runner_up: str  # the token that came second there
    content_margin: float  # the same minimum over the steps whose token is part of an answer (digits, words)


def answer_steps(pieces: list[str], answers: list[str]) -> int:
    """Number of leading generated steps that produce the answer: up to the first step after
    which the decoded text contains every answer string (all steps when it never does)."""
    text = ""
    for step, piece in enumerate(pieces):
        text += piece
        if answers and all(a in text for a in answers):
            return step + 1
    return len(pieces)


def sample_margin(model, tokenizer, task, sample, index: int, max_new_tokens: int | None = None) -> SampleMargin:
    """Decode ``sample`` greedily with ``model`` as it is (patched or not) and measure margins."""
    ids = torch.tensor([build_input_ids(tokenizer, sample)], device=model.device)
    new = max_new_tokens or sample.max_new_tokens
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
    gen = out.sequences[0, ids.shape[1]:]
    pieces = [tokenizer.decode(t) for t in gen]
    prediction = tokenizer.decode(gen, skip_special_tokens=True)
    best, content = None, float("nan")
    for step in range(answer_steps(pieces, sample.answers)):
        logp = out.scores[step][0].float().log_softmax(-1)  # (vocab,)
        top = logp.topk(2)
        margin = float(top.values[0] - top.values[1])
        if best is None or margin < best[0]:
            best = (margin, step, pieces[step], tokenizer.decode(top.indices[1]))
        # Format steps (a space, a colon) can flip without changing the answer -- or derail it
        # (a quote instead of a space); the content steps are the answer's own tokens.
        piece = pieces[step].strip()
        if piece and any(piece in a for a in sample.answers) and not margin >= content:
            content = margin
    margin, step, token, runner_up = best if best is not None else (float("nan"), -1, "", "")
    return SampleMargin(index, prediction, task.score(prediction, sample), margin, step, token, runner_up, content)


def parse_samples(text: str) -> list[int]:
    """``"0-3,7"`` -> [0, 1, 2, 3, 7]."""
    out = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
        except ValueError:
            raise ValueError(f"--samples expects indices and ranges like 0-3,7, got {text!r}") from None
    if not out or min(out) < 0:
        raise ValueError(f"--samples must name indices >= 0, got {text!r}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress.evals.margins", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", required=True, help="task spec, as in `kvpress eval --tasks`")
    parser.add_argument("--length", type=int, default=4096, help="context length in tokens")
    parser.add_argument("--samples", default="0-7", help="sample indices, e.g. 0-7 or 0,2,5")
    parser.add_argument("--seed", type=int, default=0, help="task seed (the eval's default is 0)")
    parser.add_argument("--policy", default=None, help="decode under this policy spec (name[:field=value...]); default: the model as loaded")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    indices = parse_samples(args.samples)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = kvpress.load_model(args.model)
    task = get_task(args.task)
    data = task.generate(tokenizer, args.length, max(indices) + 1, args.seed)
    patch = contextlib.nullcontext()
    if args.policy:
        patch = kvpress.apply(model, kvpress.get_policy(args.policy))
    print(f"{'sample':>6}  {'score':>5}  {'margin':>6}  {'step':>4}  {'chosen':>8}  {'runner-up':>9}  {'content':>7}  prediction")
    with patch:
        for i in indices:
            m = sample_margin(model, tokenizer, task, data[i], i)
            print(f"{m.index:>6}  {m.score:>5.2f}  {m.min_margin:>6.2f}  {m.step:>4}  {m.token!r:>8}  {m.runner_up!r:>9}  {m.content_margin:>7.2f}  {m.prediction.strip()!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
