"""Greedy tokens and scores of one policy on tiny random models, saved to compare two commits.

    python benchmarks/policy_outputs.py SPEC OUT.pt            # at one commit
    python benchmarks/policy_outputs.py SPEC OUT2.pt --compare OUT.pt   # at another: same or not

For a change meant to keep a policy's outputs (an op-count cut, a host-side shortcut): a random
Llama of conftest's shape, left-padded and unpadded batches of two 30-token prompts, 40 new
tokens, several budgets (``--budgets``) so that eviction and growth both happen. Prints, per case,
whether the tokens are equal and the largest score difference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import kvpress

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import random_ids, tiny_model  # noqa: E402

CASES = ((10, 40), (3, 30), (0, 30), (12, 40))  # (left padding of row 1, new tokens)


def outputs(spec: str, budgets: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = tiny_model("llama")
    name, overrides = kvpress.parse_policy_spec(spec)
    res = []
    for budget, (pad, new) in zip(budgets, CASES):
        ids = random_ids(30, batch=2, seed=3)
        mask = torch.ones_like(ids)
        mask[1, :pad] = 0
        policy = kvpress.get_policy(name, **overrides).with_budget(budget)
        with torch.no_grad(), kvpress.apply(model, policy):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=[],
                                 return_dict_in_generate=True, output_scores=True)
        res.append((out.sequences, torch.stack(out.scores)))
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="policy spec, e.g. snapkv:window_size=4")
    parser.add_argument("out", help="where to save this run's outputs (.pt)")
    parser.add_argument("--budgets", default="16,24,12,40", help="one budget per case (comma-separated)")
    parser.add_argument("--compare", default=None, help="outputs saved by an earlier run")
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    if len(budgets) != len(CASES):
        raise SystemExit(f"--budgets needs {len(CASES)} values, got {budgets}")
    res = outputs(args.spec, budgets)
    torch.save(res, args.out)
    same = True
    if args.compare:
        for (pad, new), budget, (s1, c1), (s2, c2) in zip(CASES, budgets, res, torch.load(args.compare)):
            equal = torch.equal(s1, s2)
            same &= equal
            print(f"budget {budget}, padding {pad}, {new} new: tokens {'equal' if equal else 'DIFFER'}, "
                  f"max score difference {float((c1 - c2).abs().max()):.3g}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
