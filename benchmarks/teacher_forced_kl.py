"""How far each decode step of a policy is from `full`'s, teacher-forced on `full`'s tokens (CPU).

    python benchmarks/teacher_forced_kl.py --length 4096 --steps 8 --policies exact_topk@256,exact_topk:tail_chunk=64@256

A random-id prompt is prefilled once densely; `full` then decodes ``--steps`` greedy tokens, and
each policy, from a cache built from the same prefill (`kvpress.prefill.cache_from_dense`), is fed
exactly those tokens. Printed per step: KL(full || policy) of the next-token distributions, with
``*`` where the policy's argmax differs from `full`'s. Free-running greedy agreement (the
`agree` column of ``kvpress bench``) compounds the first differing token; this isolates each step.
Useful to check an estimate (e.g. ``tail_chunk``) on random prompts, where greedy agreement is
meaningless.
"""
import argparse

import torch

import kvpress
from kvpress.evals.bench_layer_decode import parse_spec
from kvpress.prefill import cache_from_dense, dense_prefill


@torch.no_grad()
def step_logits(model, policy, dense, tokens):
    cache = cache_from_dense(model, policy, dense)
    out = []
    with kvpress.apply(model, policy):
        for tok in tokens:
            out.append(model(tok, past_key_values=cache, use_cache=True).logits[0, -1].float())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--policies", default="exact_topk@256,exact_topk:tail_chunk=64@256")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model, tokenizer = kvpress.load_model(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, tokenizer.vocab_size, (1, args.length), generator=gen)
    last, dense = dense_prefill(model, ids)
    tokens, full = [last.argmax(-1, keepdim=True)], kvpress.get_policy("full")
    ref = []
    cache = cache_from_dense(model, full, dense)
    with torch.no_grad(), kvpress.apply(model, full):
        for _ in range(args.steps):
            ref.append(model(tokens[-1], past_key_values=cache, use_cache=True).logits[0, -1].float())
            tokens.append(ref[-1].argmax().view(1, 1))
    print(f"# {args.model}, random prompt of {args.length} tokens, {args.steps} teacher-forced steps: "
          "KL(full || policy), * = other argmax than full")
    for spec in args.policies.split(","):
        got = step_logits(model, parse_spec(spec), dense, tokens[: args.steps])
        cells = []
        for g, r in zip(got, ref):
            kl = torch.nn.functional.kl_div(g.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum")
            cells.append(f"{float(kl):.3f}{'*' if int(g.argmax()) != int(r.argmax()) else ''}")
        print(f"{spec:<32}", " ".join(cells))


if __name__ == "__main__":
    main()
