"""Where does a decode step go on the CPU? torch.profiler's self CPU time of each policy's steps.

    OMP_NUM_THREADS=1 python benchmarks/profile_decode_cpu.py CONTEXT SPEC [SPEC ...]

Loads SmolLM2 (kvpress.evals.models), prefills a random CONTEXT-token prompt under each policy
spec, times 6 greedy decode steps, then prints the profiler table (top 25 ops by self CPU time)
of 3 more. The compiled CPU kernels (`kvpress.kernels.native`, called through ctypes) are not
torch ops: their time is in the timed steps, not in the table. The CUDA twin is
benchmarks/gpu/profile_decode.py.
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import kvpress
from kvpress.compat import cache_kwargs, output_cache
from kvpress.evals.models import load_eval_model

if len(sys.argv) < 3:
    sys.exit(__doc__)
T = int(sys.argv[1])
model, _ = load_eval_model("smollm2")
ids = torch.randint(10, 1000, (1, T))


def run(spec: str) -> None:
    """Prefill under ``spec``, time 6 steps, profile 3."""
    name, fields = kvpress.parse_policy_spec(spec)[:2]
    with torch.no_grad(), kvpress.apply(model, kvpress.get_policy(name, **fields)):
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, nxt = output_cache(out), out.logits[:, -1:].argmax(-1)

        def step(i, nxt):
            return model(nxt, **cache_kwargs(model, cache), use_cache=True,
                         position_ids=torch.tensor([[T + i]])).logits[:, -1:].argmax(-1)

        times = []
        for i in range(6):
            t = time.perf_counter()
            nxt = step(i, nxt)
            times.append((time.perf_counter() - t) * 1e3)
        print(f"## {spec}: decode ms/step {[round(x, 1) for x in times]}", flush=True)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for i in range(3):
                nxt = step(6 + i, nxt)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50), flush=True)


for spec in sys.argv[2:]:
    run(spec)
