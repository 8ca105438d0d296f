"""Per-layer decode cost of a policy's cache layer, isolated from the rest of the model.

    python -m kvpress.evals.bench_layer_decode --contexts 1024,4096,8192 --policies full,window@256,streaming@1024
    python -m kvpress.evals.bench_layer_decode --model smollm2 --contexts 8192 \\
        --policies double_sparsity:rerank=1:tail_chunk=0@256,double_sparsity@256 --profile 8

Drives one cache layer directly with random q/k/v of the model's attention shape (by default a
one-layer random model of SmolLM2's: 9 query heads, 3 KV heads, head_dim 64; fp32, batch 1): a
prefill of ``context`` tokens, then ``steps`` one-token decode steps, and prints the median
time of ``attend`` per step. A policy is ``name[:field=value...][@budget]`` (``name:budget``
also works). Policies that need a calibration artifact take the shipped one with
``--model smollm2`` (its layer ``--layer``); on the random model they are skipped.
``--profile N`` prints, per policy and context, the N torch operators that took most time over
the timed steps. One thread unless ``--threads N`` (torch's and the native kernels'); compare
rows of one run (machines are noisy). In a whole model a layer's step costs about twice this
(the MLP between layers evicts the CPU caches).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _tiny_model(heads: int, kv_heads: int, head_dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=65536)
    return LlamaForCausalLM(config).eval()


def parse_spec(spec: str):
    """``name[:field=value...][@budget]`` or ``name:budget`` -> a policy."""
    import kvpress

    spec, at, budget = spec.partition("@")
    name, _, maybe_budget = spec.partition(":")
    if not at and maybe_budget.isdigit():  # the older ``name:budget`` form
        spec, budget = name, maybe_budget
    policy = kvpress.get_policy(spec)
    return policy.with_budget(int(budget)) if budget else policy


def time_layer(model, policy, context: int, steps: int, heads: int, kv_heads: int, head_dim: int, *,
               layer_idx: int = 0, profile: int = 0) -> float:
    import kvpress

    cache = kvpress.make_cache(model, policy)
    cache._session = type("ActiveSession", (), {"active": True})()  # drive the layer without a forward
    layer = cache.layers[layer_idx]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, kv_heads, context, head_dim, generator=gen)
    q = torch.randn(1, heads, context, head_dim, generator=gen)
    layer.update(k, k.clone())
    layer.attend(q, *layer.take_pending(), head_dim**-0.5)
    steps_in = [(torch.randn(1, kv_heads, 1, head_dim, generator=gen), torch.randn(1, heads, 1, head_dim, generator=gen))
                for _ in range(steps)]
    times = []

    def run():
        for k1, q1 in steps_in:
            layer.update(k1, k1.clone())
            start = time.perf_counter()
            layer.attend(q1, *layer.take_pending(), head_dim**-0.5)
            times.append(time.perf_counter() - start)

    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=profile))
    else:
        run()
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--policies", default="full,window@256,streaming@1024")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default=None, help="a kvpress model name (default: a one-layer random SmolLM2 shape)")
    parser.add_argument("--layer", type=int, default=1, help="the layer driven, with --model (default 1)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest torch operators")
    parser.add_argument("--threads", type=int, default=1, help="torch (and native-kernel) threads (default 1)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)

    if args.model is None:
        heads, kv_heads, head_dim, layer_idx = 9, 3, 64, 0
        model = _tiny_model(heads, kv_heads, head_dim)
    else:
        from .models import load_eval_model

        model, _ = load_eval_model(args.model, dtype=torch.float32, device="cpu")
        cfg = model.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layer_idx = args.layer
    specs = [(spec, parse_spec(spec)) for spec in args.policies.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"median ms per decode step of one layer (H_q={heads}, H_kv={kv_heads}, D={head_dim}, fp32, "
          f"{args.threads} thread{'s' if args.threads > 1 else ''})")
    print(f"{'policy':<44}" + "".join(f"{c:>10}" for c in contexts))
    for spec, policy in specs:
        try:
            import kvpress

            kvpress.make_cache(model, policy)
        except (ValueError, FileNotFoundError) as exc:
            print(f"{spec:<44}  skipped: {exc}", flush=True)
            continue
        row = [time_layer(model, policy, c, args.steps, heads, kv_heads, head_dim, layer_idx=layer_idx,
                          profile=args.profile) for c in contexts]
        print(f"{spec:<44}" + "".join(f"{t:>10.3f}" for t in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
