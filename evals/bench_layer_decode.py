"""Per-layer decode cost of a policy's cache layer, isolated from the rest of the model.

    python -m kvpress.evals.bench_layer_decode --contexts 1024,4096,8192 --policies full,window:256,streaming:1024

Drives one cache layer directly with random SmolLM2-shaped q/k/v (9 query heads, 3 KV heads,
head_dim 64, fp32, batch 1): a prefill of ``context`` tokens, then ``steps`` one-token decode
steps, and prints the median time of ``attend`` per step. Layers that need a real model's
calibration artifacts are skipped. One thread; compare rows of one run (machines are noisy).
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


def time_layer(model, policy, context: int, steps: int, heads: int, kv_heads: int, head_dim: int) -> float:
    import kvpress

    cache = kvpress.make_cache(model, policy)
    cache._session = type("ActiveSession", (), {"active": True})()  # drive the layer without a forward
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, kv_heads, context, head_dim, generator=gen)
    q = torch.randn(1, heads, context, head_dim, generator=gen)
    layer.update(k, k.clone())
    layer.attend(q, *layer.take_pending(), head_dim**-0.5)
    times = []
    for _ in range(steps):
        k1 = torch.randn(1, kv_heads, 1, head_dim, generator=gen)
        q1 = torch.randn(1, heads, 1, head_dim, generator=gen)
        layer.update(k1, k1.clone())
        start = time.perf_counter()
        layer.attend(q1, *layer.take_pending(), head_dim**-0.5)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--policies", default="full,window:256,streaming:1024")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import kvpress

    heads, kv_heads, head_dim = 9, 3, 64
    model = _tiny_model(heads, kv_heads, head_dim)
    specs = []
    for spec in args.policies.split(","):
        name, _, budget = spec.partition(":")
        policy = kvpress.get_policy(name)
        specs.append((spec, policy.with_budget(int(budget)) if budget else policy))
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"median ms per decode step of one layer (H_q={heads}, H_kv={kv_heads}, D={head_dim}, fp32, 1 thread)")
    print(f"{'policy':<18}" + "".join(f"{c:>10}" for c in contexts))
    for spec, policy in specs:
        row = [time_layer(model, policy, c, args.steps, heads, kv_heads, head_dim) for c in contexts]
        print(f"{spec:<18}" + "".join(f"{t:>10.3f}" for t in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
