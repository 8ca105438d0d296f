"""What one ``shadowkv`` fold costs: decode steps that fold against those that do not (CPU).

    HF_HUB_OFFLINE=1 python benchmarks/shadowkv_fold_cost.py [LENGTH=4096] [STEPS=300]

SmolLM2, a random-token prompt, ``shadowkv`` at budget 256 (folds of 64 tokens), greedy steps
timed one by one on two threads; a step folds when the first layer's chunk count grows.
"""
import sys
import time, statistics, torch, kvpress
from kvpress.evals.models import load_eval_model
from kvpress.compat import cache_kwargs
torch.set_num_threads(2)
model, tok = load_eval_model("smollm2")
DEFAULTS = ["4096", "300"]
LENGTH, STEPS = (int(a) for a in (sys.argv[1:] + DEFAULTS[len(sys.argv[1:]):])[:2])
ids = torch.randint(100, 40000, (1, LENGTH), generator=torch.Generator().manual_seed(0))
pol = kvpress.get_policy("shadowkv", budget=256)
cache = kvpress.make_cache(model, pol)
fold, plain = [], []
with torch.no_grad(), kvpress.apply(model, pol):
    out = model(ids, use_cache=True, **cache_kwargs(model, cache))
    nxt = out.logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        before = cache.layers[0].n_chunks
        t0 = time.perf_counter()
        out = model(nxt, use_cache=True, **cache_kwargs(model, cache))
        dt = 1000 * (time.perf_counter() - t0)
        (fold if cache.layers[0].n_chunks != before else plain).append(dt)
        nxt = out.logits[:, -1:].argmax(-1)
print(f"steps with a fold: {len(fold)}, median {statistics.median(fold):.1f} ms; others: {len(plain)}, median {statistics.median(plain):.1f} ms")
