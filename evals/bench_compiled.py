"""Decode speed of ``model.generate`` with the policies' static decode step compiled, against eager
decode under the same policy, against ``full`` and against transformers' own ``StaticCache``.

    python -m kvpress.evals.bench_compiled --model smollm2 --length 2048 --new-tokens 32
    python -m kvpress.evals.bench_compiled --model random-llama3-8b-8l --device cuda --length 32768 \\
        --batch 8 --policies full,quest,duo:random_heads_seed=0,kivi --profile-steps 2   # a GPU

Each policy runs ``generate`` once eagerly (``disable_compile=True``) and once through transformers'
compiled decode. On CUDA that is what ``generate`` under ``kvpress.apply`` does by default
(transformers' default ``CompileConfig``: inductor, ``reduce-overhead``, i.e. CUDA graphs); on a CPU,
or with ``--backend`` / ``--mode``, an explicit config is passed (on a CPU forced with
``CompileConfig._compile_all_devices``).

Timing: a logits processor synchronizes the device and reads the clock at every generated token, so
one ``generate`` call gives every decode step's wall time, generate's own host work included.
Decode ms/token is the median over the steps after the first ``--skip-steps`` (compilation, CUDA-graph
warm-up and recording happen there) and before the profiled ones; ``compile_s`` is the time of the
skipped steps beyond that median. One prefill per policy and mode, so long contexts stay affordable.
Dynamo is not reset between policies (``--reset`` does): a later policy then starts with the
integers dynamo saw change as symbols and compiles one graph where a fresh process compiles two, so
its ``compile_s`` is less than a user's first call pays.

``--result FILE`` also writes the table as a BENCHMARKS result file (``kvpress.evals.benchmarks_md``), with
the command as run, the machine and the date; ``gpu_suite``'s compiled stages leave one in their archive.

``--profile-steps N`` runs the last N decode steps of each call under ``torch.profiler`` and reports
device kernels per step and per layer-step (kernels inside CUDA-graph replays included). The table
gives eager and compiled ms/token, their ratio, ``full``'s compiled ms over the policy's (when
``full`` is listed), the ``StaticCache`` baseline's over the policy's, resident KV MiB, peak device
memory, and whether compiled tokens equal eager ones (greedy). ``--out`` writes the rows as JSON,
rewritten after every policy so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback

import torch

DEFAULT_POLICIES = "full,window,streaming"
MIB = 2**20


class _StepClock:
    """A logits processor: synchronizes and reads the clock at every generated token; optionally
    profiles the last ``profile`` decode steps."""

    def __init__(self, device: torch.device, new_tokens: int, profile: int = 0):
        self.device, self.new_tokens, self.profile = device, new_tokens, profile
        self.times: list[float] = []
        self.prof = None

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        n = len(self.times)
        if self.profile and n == self.new_tokens - self.profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        elif self.prof is not None and n == self.new_tokens:
            self.prof.stop()
        return scores

    def kernels_per_step(self) -> float | None:
        """Device kernels launched per profiled decode step (None without a CUDA profile)."""
        if self.prof is None or self.device.type != "cuda":
            return None
        from torch.autograd import DeviceType

        kernels = sum(1 for e in self.prof.events() if e.device_type == DeviceType.CUDA)
        return kernels / self.profile


def _steps(clock: _StepClock, skip: int) -> tuple[float, float]:
    """(median decode ms/token over the timed steps, seconds the skipped steps took beyond it)."""
    gaps = [1000 * (b - a) for a, b in zip(clock.times, clock.times[1:])]
    timed = gaps[skip:len(gaps) - clock.profile] if clock.profile else gaps[skip:]
    if not timed:
        raise ValueError(f"no decode step left to time: raise --new-tokens above {skip + clock.profile + 1}")
    median = statistics.median(timed)
    return median, max(0.0, sum(gaps[:skip]) - skip * median) / 1000


def _compile_config(device: torch.device, backend: str | None, mode: str | None):
    """None on CUDA without --backend/--mode (transformers' default, as users get it)."""
    from transformers import CompileConfig

    if device.type == "cuda" and backend is None and mode is None:
        return None
    config = CompileConfig(fullgraph=True, backend=backend or "inductor", mode=mode)
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    return config


def _counters() -> tuple[int, int]:
    """(graphs dynamo has compiled, CUDA-graph skips inductor reported) so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(counters["inductor"]["cudagraph_skips"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _policy(model, spec: str, budget: int | None):
    """The policy of ``spec``, at ``budget`` where it takes one; a random model's missing calibration
    artifact made on random ids (speed does not depend on which channels or heads)."""
    import kvpress

    policy = kvpress.get_policy(spec)
    if budget is not None and "budget" in {f.name for f in dataclasses.fields(policy)} and "budget=" not in spec:
        policy = policy.with_budget(budget)
    random_weights = str(getattr(model.config, "_name_or_path", "")).startswith("random-")
    if policy.name == "double_sparsity" and policy.artifact is None and random_weights:
        from kvpress.adapters import get_adapter
        from kvpress.policies.double_sparsity import synthetic_artifact

        policy = policy.replace(artifact=str(synthetic_artifact(get_adapter(model))))
    return policy


def _generate(model, input_ids, new_tokens: int, *, skip: int, profile: int, **kw) -> dict:
    from transformers import LogitsProcessorList

    import kvpress

    device = input_ids.device
    clock = _StepClock(device, new_tokens, profile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                         return_dict_in_generate=True, **kw)
    ms, compile_s = _steps(clock, skip)
    row = {"ms": ms, "compile_s": compile_s, "prefill_s": clock.times[0] - t0, "tokens": out.sequences,
           "kernels_per_step": clock.kernels_per_step(),
           "peak_mib": torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None}
    try:
        row["resident_mib"] = kvpress.cache_stats(out).resident_bytes / MIB
    except TypeError:  # transformers' own cache (the StaticCache baseline)
        from kvpress.compat import output_cache
        from kvpress.stats import tensor_bytes

        layers = getattr(output_cache(out), "layers", [])
        row["resident_mib"] = tensor_bytes(t for layer in layers for t in (getattr(layer, "keys", None),
                                                                          getattr(layer, "values", None))) / MIB
    return row


def run(model, input_ids: torch.Tensor, policies: list[str], *, new_tokens: int, skip: int = 3, profile: int = 0,
        backend: str | None = None, mode: str | None = None, eager: bool = True, static_baseline: bool = True,
        share_prefill: bool = True, budget: int | None = None, time_limit: float | None = None, reset: bool = False,
        on_row=None) -> list[dict]:
    """One row per policy (and one for the ``StaticCache`` baseline); see the module docstring."""
    import kvpress
    from kvpress.compat import cache_kwargs
    from kvpress.prefill import cache_from_dense, dense_prefill

    device = input_ids.device
    config = _compile_config(device, backend, mode)
    # one process compiles many policies' steps of the same model code: without a reset between
    # them, dynamo starts a later policy with the integers it found changing as symbols (one graph,
    # not a specialised one first); it needs room for every policy's graphs
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * (len(policies) + 1))
    compiled_kw = {} if config is None else {"compile_config": config}
    layers = model.config.num_hidden_layers
    start = time.monotonic()
    rows: list[dict] = []

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(rows)

    def per_layer(k):
        return None if k is None else round(k / layers, 1)

    base_ms = None
    if static_baseline:
        torch._dynamo.reset()
        try:
            base = _generate(model, input_ids, new_tokens, skip=skip, profile=profile, cache_implementation="static",
                             **compiled_kw)
            base_ms = base["ms"]
            emit({"policy": "transformers StaticCache", "eager_ms": None, "compiled_ms": round(base_ms, 3),
                  "compile_s": round(base["compile_s"], 1),
                  "kernels_per_layer_step": per_layer(base["kernels_per_step"]),
                  "resident_mib": round(base["resident_mib"], 1),
                  "peak_mib": base["peak_mib"] and round(base["peak_mib"])})
        except Exception as exc:  # noqa: BLE001 - reported in the row; the policies still run
            traceback.print_exc()
            emit({"policy": "transformers StaticCache", "error": f"{type(exc).__name__}: {exc}"[:300]})
    specs = {spec: _policy(model, spec, budget) for spec in policies}
    dense = None
    if share_prefill and sum(p.prefills_densely() for p in specs.values()) >= 1:
        t0 = time.perf_counter()
        first_logits, dense = dense_prefill(model, input_ids)
        # the prompt and its first generated token: generate feeds only the token the cache lacks
        shared_ids = torch.cat([input_ids, first_logits.argmax(-1)[:, None]], dim=1)
        _sync(device)
        print(f"shared dense prefill: {time.perf_counter() - t0:.1f} s", flush=True)
    full_ms = None
    for spec, policy in specs.items():
        if time_limit is not None and time.monotonic() - start > time_limit:
            emit({"policy": spec, "error": f"not run: --time-limit {time_limit:.0f} s reached"})
            continue
        row = {"policy": spec}
        if device.type == "cuda":  # the graphs recorded for the policy before: their pools and inputs
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
            gc.collect()
            torch.cuda.empty_cache()
            row["allocated_mib_before"] = round(torch.cuda.memory_allocated(device) / MIB)
        try:
            shares = dense is not None and policy.prefills_densely()
            row["shared_prefill"] = shares

            def call(**kw):
                if not shares:
                    return _generate(model, input_ids, new_tokens, **kw)
                capacity = shared_ids.shape[1] + new_tokens
                cache = cache_from_dense(model, policy, dense, capacity=capacity)
                return _generate(model, shared_ids, new_tokens, **cache_kwargs(model, cache), **kw)

            with kvpress.apply(model, policy):
                compileable = kvpress.make_cache(model, policy).is_compileable
                eager_out = None
                if eager:
                    e = call(skip=1, profile=profile, disable_compile=True)
                    eager_out = e["tokens"]
                    row.update(eager_ms=round(e["ms"], 3),
                               eager_kernels_per_layer_step=per_layer(e["kernels_per_step"]),
                               resident_mib=round(e["resident_mib"], 1))
                if compileable:
                    if reset:
                        torch._dynamo.reset()
                    graphs0, skips0 = _counters()
                    c = call(skip=skip, profile=profile, **compiled_kw)
                    graphs1, skips1 = _counters()
                    row.update(compiled_ms=round(c["ms"], 3), compile_s=round(c["compile_s"], 1),
                               kernels_per_layer_step=per_layer(c["kernels_per_step"]),
                               resident_mib=round(c["resident_mib"], 1),
                               peak_mib=c["peak_mib"] and round(c["peak_mib"]),
                               graphs=graphs1 - graphs0, cudagraph_skips=skips1 - skips0)
                    if eager_out is not None:
                        row["compiled_vs_eager"] = round(row["eager_ms"] / c["ms"], 3)
                        row["tokens_equal"] = bool(torch.equal(eager_out, c["tokens"]))
                        if not row["tokens_equal"]:  # the first generated token where they part
                            differ = (eager_out != c["tokens"]).any(0).nonzero()
                            row["first_diff"] = int(differ[0]) - (eager_out.shape[1] - new_tokens)
                    if base_ms is not None:
                        row["compiled_vs_static"] = round(base_ms / c["ms"], 3)
                    if spec == "full":
                        full_ms = c["ms"]
                    if full_ms is not None:
                        row["vs_full"] = round(full_ms / c["ms"], 3)
        except torch.cuda.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0][:200]}"
        except Exception as exc:  # noqa: BLE001 - one policy failing must not lose the others' rows
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        emit(row)
    return rows


def _table(rows: list[dict]) -> str:
    cols = [("policy", 30), ("eager_ms", 9), ("compiled_ms", 11), ("compiled_vs_eager", 9), ("vs_full", 7),
            ("compiled_vs_static", 9), ("compile_s", 9), ("kernels_per_layer_step", 8), ("resident_mib", 9),
            ("peak_mib", 8), ("tokens_equal", 6)]
    names = {"eager_ms": "eager ms", "compiled_ms": "compiled ms", "compiled_vs_eager": "x eager", "vs_full": "x full",
             "compiled_vs_static": "x static", "compile_s": "compile s", "kernels_per_layer_step": "kern/L",
             "resident_mib": "KV MiB", "peak_mib": "peak MiB", "tokens_equal": "equal"}
    head = " ".join(f"{names.get(c, c):<{w}}" if c == "policy" else f"{names.get(c, c):>{w}}" for c, w in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['policy']:<30} {r['error']}")
            continue
        cells = [f"{r['policy']:<30}"]
        for c, w in cols[1:]:
            v = r.get(c)
            cells.append(f"{'-' if v is None else str(v):>{w}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def result_file(rows: list[dict], meta: dict, *, title: str, order: int, command: str, machine: str) -> dict:
    """A BENCHMARKS result file (``kvpress.evals.benchmarks_md``'s format) of ``rows``: one table row
    per policy (errors as a note), its ratios as measured in this run."""
    columns = ["decode", "ms/token", "x `full`", "x eager", "x StaticCache", "compile s", "kernels per layer-step",
               "KV MiB", "peak MiB", "tokens equal eager"]
    table, notes = [], []
    for r in rows:
        if "error" in r:
            notes.append(f"`{r['policy']}`: {r['error']}")
            continue
        cell = lambda key: "" if r.get(key) is None else str(r[key])  # noqa: E731
        compiled = r.get("compiled_ms") is not None
        table.append([f"`{r['policy']}`" + ("" if compiled else " (eager)"),
                      cell("compiled_ms" if compiled else "eager_ms"),
                      cell("vs_full"), cell("compiled_vs_eager"), cell("compiled_vs_static"), cell("compile_s"),
                      cell("kernels_per_layer_step"), cell("resident_mib"), cell("peak_mib"), cell("tokens_equal")])
        if r.get("cudagraph_skips"):
            notes.append(f"`{r['policy']}`: inductor skipped {r['cudagraph_skips']} CUDA graph(s)")
    machine = machine or meta.get("gpu") or meta["device"]
    return {"title": title, "section": "gpu" if meta["device"].startswith("cuda") else "cpu", "order": order,
            "command": command, "machine": f"{machine}, torch {torch.__version__}",
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "columns": columns, "rows": table,
            "notes": [f"{meta['model']}, {meta['dtype']}, prompt {meta['length']} x batch {meta['batch']}, "
                      f"{meta['new_tokens']} new tokens, budget {meta['budget']}; ms/token: the median decode step "
                      f"after the first {meta['skip_steps']} of one generate call", *notes]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress.evals.bench_compiled", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                        help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--length", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--skip-steps", type=int, default=3, help="first compiled steps left out of the median")
    parser.add_argument("--profile-steps", type=int, default=0, help="last steps run under torch.profiler")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated specs (default {DEFAULT_POLICIES})")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: transformers' own)")
    parser.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--budget", type=int, default=None, help="tokens attended per step, for policies that take one")
    parser.add_argument("--no-share-prefill", dest="share_prefill", action="store_false",
                        help="each policy prefills itself (default: one dense prefill for the policies whose "
                        "prefill is plain attention)")
    parser.add_argument("--reset", action="store_true",
                        help="reset dynamo before each policy (compile_s as a fresh process pays it)")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager run of each policy")
    parser.add_argument("--no-static-baseline", dest="static_baseline", action="store_false")
    parser.add_argument("--time-limit", type=float, default=None, help="start no policy after this many seconds")
    parser.add_argument("--out", default=None, help="write the rows as JSON here (after every policy)")
    parser.add_argument("--result", default=None,
                        help="also write a BENCHMARKS result file here (benchmarks/results/NAME.json) at the end")
    parser.add_argument("--title", default="Compiled decode under `apply`", help="the result file's table title")
    parser.add_argument("--order", type=int, default=9, help="the result file's place in its section")
    parser.add_argument("--machine", default="", help="the result file's machine (default: the GPU's name)")
    args = parser.parse_args(argv)
    for name in ("length", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.skip_steps < 1 or args.profile_steps < 0:
        parser.error("--skip-steps must be >= 1 and --profile-steps >= 0")
    if args.new_tokens < args.skip_steps + args.profile_steps + 2:
        parser.error(f"--new-tokens must be >= --skip-steps + --profile-steps + 2 "
                     f"({args.skip_steps + args.profile_steps + 2}): at least one decode step must be timed")

    import kvpress
    from kvpress.evals.models import load_eval_model

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for spec in policies:  # refused before the model loads
        try:
            kvpress.get_policy(spec)
        except ValueError as exc:
            parser.error(f"--policies {spec!r}: {exc}")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model, _ = load_eval_model(args.model, dtype=dtype, device=args.device)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, min(model.config.vocab_size, 32000) - 1, (args.batch, args.length),
                              generator=gen).to(args.device)
    meta = {k: getattr(args, k) for k in ("model", "device", "length", "batch", "new_tokens", "skip_steps",
                                          "profile_steps", "backend", "mode", "budget", "share_prefill", "reset")}
    meta["dtype"] = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    header = (f"model {args.model}, {args.device} {meta['dtype']}, prompt {args.length} x batch {args.batch}, "
              f"{args.new_tokens} new tokens, compile: " + ("transformers' default (inductor, reduce-overhead)"
              if args.backend is None and args.mode is None and device.type == "cuda"
              else f"{args.backend or 'inductor'}, mode {args.mode}"))

    def write(rows):
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"config": meta, "torch": torch.__version__, "rows": rows}, f, indent=1)

    print(header, flush=True)
    with torch.no_grad():
        rows = run(model, input_ids, policies, new_tokens=args.new_tokens, skip=args.skip_steps,
                   profile=args.profile_steps, backend=args.backend, mode=args.mode, eager=args.eager,
                   static_baseline=args.static_baseline, share_prefill=args.share_prefill, budget=args.budget,
                   reset=args.reset,
                   time_limit=args.time_limit, on_row=write)
    print(header)
    print(_table(rows))
    if args.result:
        given = list(argv if argv is not None else sys.argv[1:])
        kept = [a for i, a in enumerate(given)  # the command as run, less where its files went
                if a not in ("--out", "--result") and (i == 0 or given[i - 1] not in ("--out", "--result"))]
        command = "python -m kvpress.evals.bench_compiled " + " ".join(kept)
        with open(args.result, "w") as f:
            json.dump(result_file(rows, meta, title=args.title, order=args.order, command=command,
                                  machine=args.machine), f, indent=1)
            f.write("\n")
    return 1 if any("error" in r and not r["error"].startswith("not run") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
