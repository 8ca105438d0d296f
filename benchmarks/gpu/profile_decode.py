"""Where does a decode step of random-llama3-8b (32 layers) go on a GPU? plain HF vs kvpress. (CUDA only)

    [BATCH=8] python benchmarks/gpu/profile_decode.py [CONTEXT=32768] [SPEC ...]

Prefills a random prompt, times 5 greedy decode steps (synchronised), then prints torch.profiler
tables (self CPU time, self device time) of 2 more steps for each SPEC: ``plain`` (the unpatched
model with its DynamicCache) or a policy spec (``full``, ``quest:budget=1024``, ``shadowkv:...``).
Default: plain, full, quest:budget=1024.
``BATCH`` (environment, default 1): prompts per batch.
"""
import contextlib, os, sys, time, torch, kvpress
from torch.profiler import profile, ProfilerActivity
from kvpress.compat import cache_kwargs, output_cache
from kvpress.evals.models import load_eval_model
T = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
model, tok = load_eval_model("random-llama3-8b-32l", device="cuda")
B = int(os.environ.get("BATCH", "1"))
ids = torch.randint(10, 1000, (B, T), device="cuda")
def loop(label, policy, steps=5):
    ctx = kvpress.apply(model, policy) if policy is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache = output_cache(out); nxt = out.logits[:, -1:].argmax(-1)
        def step(i):
            return model(nxt, **cache_kwargs(model, cache), use_cache=True,
                         position_ids=torch.full((B, 1), T + i, device="cuda")).logits[:, -1:].argmax(-1)
        times = []
        for i in range(steps):
            torch.cuda.synchronize(); t = time.perf_counter(); nxt = step(i); torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        print(f"## {label}: decode ms/step {[round(x, 1) for x in times]}", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for i in range(2):
                nxt = step(steps + i)
            torch.cuda.synchronize()
        ka = p.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60), flush=True)
        print(ka.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60), flush=True)
    del cache, out
    torch.cuda.empty_cache()
for spec in sys.argv[2:] or ["plain", "full", "quest:budget=1024"]:
    if spec == "plain":
        loop("plain HF", None)
    else:
        name, overrides = kvpress.parse_policy_spec(spec)
        loop(spec, kvpress.get_policy(name, **overrides))
