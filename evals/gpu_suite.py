"""Every GPU test and benchmark of the project, in stages that each fit in a few minutes of GPU time.

    pip install --no-deps --no-build-isolation -e .      # offline: uses the image's torch / triton / transformers
    python -m kvpress.evals.gpu_suite --out $OUT --stages env,tests,kernels            # ~10 minutes at most
    python -m kvpress.evals.gpu_suite --out $OUT --stages quant,sparse,bench           # the second call
    python -m kvpress.evals.gpu_suite --out $OUT --stages shadowkv                     # ~8 minutes
    python -m kvpress.evals.gpu_suite --out $OUT --stages prefill                      # ~5 minutes
    python -m kvpress.evals.gpu_suite --out $OUT --stages tests,compiled8 --limit tests=180 --budget-s 480
    python -m kvpress.evals.gpu_suite --out $OUT --stages compiled128,compiled         # ~9 minutes

Stages (each a subprocess with its own time limit; ``--budget-s`` caps the whole call, and a stage
that would start too late is skipped and says so):

``env``       versions, the GPU, and the two ceilings measured on it (a device-to-device copy,
              bytes read + written; a bf16 8192^3 matrix product) -- the yardsticks for the rest
``tests``     ``pytest -m gpu`` over tests/kernels, tests/policies, the registry contract, crop and static
              decode (Triton kernels against torch references; every policy on CUDA against its CPU run;
              every policy's compiled decode captured in a CUDA graph)
``kernels``   ``bench_kernels``: block-sparse decode vs dense SDPA, 8k-128k, budgets 256-4096; then
              ``bench_rows``: `attend_rows` (one launch) against 3 ``sparse_decode`` + 2 merges, host included
``quant``     ``bench_quant kernel``: fused 4/2-bit dequantize-attention vs bf16 dense, 8k-128k
``sparse``    Double Sparsity calibrated on the random Llama-3-8B shape, then ``bench_sparse_decode``
              at 32k, budget 1024: decode attention-only and end-to-end ms/token of quest,
              double_sparsity and tidal against full
``shadowkv``  ``bench_shadowkv speed`` at 32k: batches 1 and 8 of full and of the configurations
              that keep SmolLM2's needles (a 2-bit key residual; ``fetch_keys``) beside their plain
              selection; then the default's largest batch that fits, tokens/s, fetch bytes and reuse
              (~8 minutes on an H200: a call of its own)
``bench``     ``kvpress bench`` at 32k: end-to-end decode ms/token and resident bytes of the
              quantizers, the sparse policies, ``duo`` (a random 50% split: no gates for random
              weights; speed does not depend on which heads) and the eviction baselines against full
``compiled``  ``bench_compiled`` at 32k, batch 1: ``full``'s compiled decode under ``apply`` (transformers'
              default on CUDA: inductor + CUDA graphs) against its eager decode and transformers'
              ``StaticCache`` + ``torch.compile``; kernels per layer-step from a profile
``compiled8`` the same at 32k, batch 8 (the KV cache dominates), budget 1024: each policy's compiled
              decode against compiled ``full``, most wanted policies first, until its time limit
``compiled128`` the same at 128k, batch 1
``prefill``   ``bench_prefill``: the sliding-window layers' prefill (SDPA over query chunks against
              the streaming route) at 8k / 32k, windows 1024 / 4096, bf16 -- picks the CUDA chunk;
              then ``bench_chunked_prefill`` at 32k: peak memory of generate with the prompt in one
              forward or in 4096-token chunks, per policy; then ``bench_turn`` at 8k: a 256-token
              new turn's forward per policy against ``full``'s

Everything lands in ``--out``: ``suite.log`` (all output), ``summary.txt`` (each stage's status
and the tail of its table, also printed last) and ``results.tar.gz`` (the stages' JSON / CSV).
Three files, so the device tool's limits on returned files hold.

``--smoke`` runs the same stages on the CPU with the tiny random model and small sizes; the test
suite uses it to keep this script working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

STAGES = ("env", "tests", "kernels", "quant", "sparse", "shadowkv", "bench", "prefill", "compiled", "compiled8",
          "compiled128")
# per-stage wall-clock limits in seconds (a stage is also cut to what is left of --budget-s)
LIMITS = {"env": 90, "tests": 360, "kernels": 240, "quant": 150, "sparse": 300, "shadowkv": 540, "bench": 300,
          "prefill": 300, "compiled": 200, "compiled8": 330, "compiled128": 330}
REPO = Path(__file__).resolve().parent.parent  # the checkout, for an editable install
GPU_MODEL = "random-llama3-8b-32l"  # Llama-3-8B shapes, 32 layers, random weights (kvpress.evals.models)
# compiled8's and compiled128's policies, most wanted first (they start none after their --time-limit)
COMPILED8_POLICIES = ("full,quest,kivi:bits=4,duo:random_heads_seed=0,streaming,tidal,zipcache,double_sparsity,"
                      "shadowkv,exact_topk,gear,snapkv,window")


def _calibrate_ds(model: str, artifact: Path, dev: str, smoke: bool) -> list[str]:
    """Double Sparsity's channel calibration for the benchmark model (it ships none)."""
    tokens = ["--tokens", "1024", "--seq-len", "512"] if smoke else ["--tokens", "8192", "--seq-len", "4096"]
    return [sys.executable, "-m", "kvpress", "calibrate", "double_sparsity", "--model", model,
            "--out", str(artifact), "--device", dev, *tokens]


def _commands(stage: str, work: Path, smoke: bool, limit: float = 240.0) -> list[list[str]]:
    """The subprocess command lines of one stage (``env`` runs in-process); ``limit``: its seconds."""
    py = [sys.executable, "-m"]
    dev = "cpu" if smoke else "cuda"
    model = "random-tiny" if smoke else GPU_MODEL
    length = "1024" if smoke else "32768"
    if stage == "tests":
        if not (REPO / "tests").is_dir():
            return []
        try:  # Triton compiles on the host's cores: spread the GPU tests over a few workers
            import xdist  # noqa: F401
            workers = [] if smoke else ["-n", "4"]
        except ImportError:
            workers = []
        return [py + ["pytest", "-q", "-m", "gpu", *workers, "tests/kernels", "tests/policies",
                      "tests/test_contract.py", "tests/test_crop.py", "tests/test_static_decode.py",
                      "-p", "no:cacheprovider"]]
    if stage == "kernels":
        sizes = ["--contexts", "1k", "--budgets", "256", "--warmup", "0", "--iters", "1"] if smoke else \
            ["--contexts", "8k,32k,128k", "--budgets", "256,1024,4096", "--batches", "1,8"]
        rows = ["--batches", "1", "--selected", "64", "--iters", "2", "--warmup", "1"] if smoke else []
        return [py + ["kvpress.evals.bench_kernels", "--device", dev, *sizes, "--out", str(work / "kernels")],
                # one decode step's attention over split stores: one launch against 3 + 2
                py + ["kvpress.evals.bench_rows", "--device", dev, *rows, "--json", str(work / "kernels" / "rows.json")]]
    if stage == "quant":
        sizes = ["--contexts", "1k", "--warmup", "0", "--iters", "1"] if smoke else ["--contexts", "8k,32k,128k"]
        return [py + ["kvpress.evals.bench_quant", "kernel", "--device", dev, *sizes, "--out", str(work / "quant")]]
    if stage == "sparse":
        artifact = work / "sparse" / f"ds-{model}.safetensors"
        budget = "96" if smoke else "1024"
        return [
            _calibrate_ds(model, artifact, dev, smoke),
            py + ["kvpress.evals.bench_sparse_decode", "--model", model, "--device", dev, "--length", length,
                  "--budgets", budget, "--policies", "full,quest,double_sparsity,tidal", "--new-tokens",
                  "4" if smoke else "32", "-o", f"double_sparsity.artifact={artifact}",
                  "--json", str(work / "sparse" / "bench_sparse_decode.json")],
        ]
    if stage == "shadowkv":
        # first the configurations that keep SmolLM2's needles, beside full and the same selection
        # without its key correction, at two batches in one process (so the residual's cost is
        # compared within one process): the rebuilt keys with a 2-bit residual fetched beside the
        # values, and exact keys fetched with rank-24 keys in the queries' metric selecting; then
        # the default's largest batch (doubling until out of memory: ~290 s on an H200)
        fk = ["--length", "512", "--batches", "1", "--new-tokens", "3"] if smoke else \
            ["--length", length, "--batches", "1,8", "--new-tokens", "16"]
        tokens = "rerank=32:tail_chunk=64:select=tokens"
        sweep = ["--length", "512", "--batches", "1", "--new-tokens", "3"] if smoke else \
            ["--length", length, "--new-tokens", "16"]
        return [py + ["kvpress.evals.bench_shadowkv", "speed", "--model", model, *fk, "--skip", "shadowkv",
                      "--variants", f"{tokens},{tokens}:residual_bits=2,{tokens}:fetch_keys=True:svd=query:rank="
                      f"{'4' if smoke else '24'}",
                      "--json", str(work / "shadowkv" / "speed_configs.json")],
                py + ["kvpress.evals.bench_shadowkv", "speed", "--model", model, *sweep,
                      "--json", str(work / "shadowkv" / "speed.json")]]
    if stage == "bench":
        artifact = work / "sparse" / f"ds-{model}.safetensors"
        # the sparse stage makes the artifact when it ran first in this call
        calibrate = [] if artifact.exists() else [_calibrate_ds(model, artifact, dev, smoke)]
        return calibrate + [py + ["kvpress", "bench", "--model", model, "--device", dev, "--lengths", length,
                      "--policies", "full,kivi,zipcache,gear,quest,double_sparsity,duo:random_heads_seed=0,streaming,snapkv",
                      "--budget", "96" if smoke else "1024", "--new-tokens", "4" if smoke else "32",
                      "-o", f"double_sparsity.artifact={work / 'sparse' / f'ds-{model}.safetensors'}",
                      "--out", str(work / "bench")]]
    if stage in ("compiled", "compiled8", "compiled128"):
        # generate's compiled decode (transformers' default on CUDA: inductor, CUDA graphs) under apply:
        # batch 1 against its eager decode and transformers' StaticCache + torch.compile; then where the
        # KV cache dominates (32k batch 8, 128k batch 1), each policy against compiled `full`, in
        # priority order until --time-limit (one shared dense prefill for the policies whose prefill
        # is plain attention)
        many = stage != "compiled"
        batch = "8" if stage == "compiled8" else "1"
        if smoke:
            sizes = ["--length", "256", "--new-tokens", "8", "--backend", "eager", "--batch", "2" if many else "1"]
        else:
            tokens = "130944" if stage == "compiled128" else length  # (128k positions: room for the new tokens)
            sizes = ["--length", tokens, "--new-tokens", "32" if many else "40", "--profile-steps", "2",
                     "--batch", batch]
        policies = COMPILED8_POLICIES if many else "full"
        # (a policy's eager and compiled calls take up to ~100 s: none starts in the stage's last 100)
        extra = ["--budget", "96" if smoke else "1024", "--no-static-baseline",
                 "--time-limit", "20" if smoke else f"{max(30, limit - 100):.0f}"] if many else \
            ["--no-share-prefill"]  # batch 1: generate as users call it
        context = "128k" if stage == "compiled128" else "32k"
        title = (f"Compiled decode under `apply` at {context}, batch {batch} (random Llama-3-8B-shaped weights, "
                 "32 layers, bf16)")
        return [py + ["kvpress.evals.bench_compiled", "--model", model, "--device", dev, *sizes, "--policies", policies,
                      *extra, "--out", str(work / f"{stage}.json"), "--result", str(work / f"result_{stage}.json"),
                      "--title", title]]
    if stage == "prefill":  # the sliding-window layers' prefill routes (Gemma 3 / hybrid Qwen)
        sizes = ["--lengths", "512", "--windows", "64", "--chunks", "64,256", "--warmup", "0", "--iters", "1"] \
            if smoke else ["--lengths", "8192,32768", "--windows", "1024,4096", "--chunks", "128,512,1024,4096"]
        chunked = ["--length", "1024", "--chunks", "0,256", "--budget", "96"] if smoke else \
            ["--length", length, "--chunks", "0,4096", "--budget", "1024"]
        return [py + ["kvpress.evals.bench_prefill", "--device", dev, *sizes,
                      "--json", str(work / "prefill" / "bench_prefill.json")],
                # peak memory of generate with the prompt in one forward or in chunks (prefill_chunk_size)
                py + ["kvpress.evals.bench_chunked_prefill", "--model", model, *chunked, "--new-tokens", "4",
                      "--policies", "full,kivi,streaming,snapkv,shadowkv", "--time",
                      "--out", str(work / "prefill" / "chunked_prefill.jsonl")],
                # a new turn's forward (snapkv: dense over kept + turn, selected again; shadowkv dense)
                py + ["kvpress.evals.bench_turn", "--model", model, "--length", "1024" if smoke else "8192",
                      "--turn", "40" if smoke else "256", "--budget", "96" if smoke else "1024",
                      "--policies", "full,snapkv,shadowkv,quest,kivi", "--out", str(work / "prefill" / "turn.jsonl")]]
    raise ValueError(f"unknown stage {stage!r}; allowed: {', '.join(STAGES)}")


def _env(work: Path, smoke: bool, log) -> dict:
    """Versions, the device, and (on a GPU) the copy-bandwidth and bf16-matmul ceilings."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for name in ("triton", "transformers", "kvpress"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info[name] = f"unavailable ({type(exc).__name__})"
    if not smoke and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30)
        from kvpress.evals.bench_kernels import copy_bandwidth, timeit

        cuda = torch.device("cuda")
        info["copy_GBps"] = copy_bandwidth(cuda, 2**30, warmup=3, iters=20)  # bytes read + written
        a = torch.randn(8192, 8192, device=cuda, dtype=torch.bfloat16)  # random, never zeros
        b = torch.randn(8192, 8192, device=cuda, dtype=torch.bfloat16)
        (mm_ms,) = timeit([lambda: a @ b], cuda, warmup=3, iters=20)
        info["bf16_matmul_TFLOPs"] = 2 * 8192**3 / mm_ms / 1e9
        del a, b
        torch.cuda.empty_cache()
    (work / "env.json").write_text(json.dumps(info, indent=1))
    for k, v in info.items():
        print(f"{k:<20} {v}", file=log, flush=True)
    return info


def _run_stage(stage: str, work: Path, smoke: bool, limit: float, log) -> tuple[str, list[str]]:
    """Run one stage; returns (status, last output lines)."""
    if stage == "env":
        try:
            info = _env(work, smoke, log)
        except Exception as exc:  # noqa: BLE001 - one stage failing must not stop the others
            return f"failed ({type(exc).__name__}: {exc})", []
        return "ok", [f"{k}: {v}" for k, v in info.items()]
    (work / stage).mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    deadline = time.monotonic() + limit
    commands = _commands(stage, work, smoke, limit)
    if not commands:
        return "skipped (no tests/ beside the package: not an editable install)", lines
    for cmd in commands:
        left = deadline - time.monotonic()
        if left < 5:
            return f"timed out before: {' '.join(cmd[2:4])}", lines
        print(f"$ {' '.join(cmd)}", file=log, flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=left, env=env, cwd=REPO if stage == "tests" else None)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            log.write(out)
            return f"timed out after {limit:.0f} s", out.splitlines()[-15:]
        log.write(proc.stdout)
        log.flush()
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()][-15:]
        if stage == "tests" and proc.returncode == 5:
            return "no GPU tests selected", lines
        if proc.returncode != 0:
            return f"failed (exit {proc.returncode})", lines
    return "ok", lines


def run(stages, out: Path, smoke: bool = False, budget_s: float = 540.0,
        limits: dict[str, float] | None = None) -> list[tuple[str, str, float]]:
    """Run ``stages`` in order; write suite.log, summary.txt and results.tar.gz into ``out``;
    ``limits`` overrides stages' time limits (seconds)."""
    limits = {**LIMITS, **(limits or {})}
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; allowed: {', '.join(STAGES)}")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvpress-gpu-suite-"))
    start = time.monotonic()
    results, summary = [], []
    with open(out / "suite.log", "w") as log:
        for stage in stages:
            left = budget_s - (time.monotonic() - start)
            if left < 30:
                results.append((stage, f"skipped ({left:.0f} s of --budget-s left)", 0.0))
                continue
            t0 = time.monotonic()
            print(f"\n===== {stage} =====", file=log, flush=True)
            status, tail = _run_stage(stage, work, smoke, min(limits[stage], left - 10), log)
            results.append((stage, status, time.monotonic() - t0))
            summary += [f"===== {stage}: {status} ({results[-1][2]:.0f} s)", *tail, ""]
    header = [f"kvpress gpu_suite {'(smoke, cpu)' if smoke else ''} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              *(f"{s:<9} {st:<40} {sec:>6.0f} s" for s, st, sec in results), ""]
    (out / "summary.txt").write_text("\n".join(header + summary) + "\n")
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="results")
    shutil.rmtree(work, ignore_errors=True)
    print("\n".join(header + summary))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for suite.log, summary.txt, results.tar.gz")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {', '.join(STAGES)}")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock cap of the whole call")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and sizes (a check of the plumbing)")
    parser.add_argument("--limit", action="append", default=[], metavar="STAGE=SECONDS",
                        help="a stage's time limit (repeatable; defaults: "
                        + ", ".join(f"{k}={v}" for k, v in LIMITS.items()) + ")")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    limits = {}
    for item in args.limit:
        stage, _, seconds = item.partition("=")
        try:
            limits[stage] = float(seconds)
        except ValueError:
            parser.error(f"--limit {item!r}: expected STAGE=SECONDS")
        if stage not in STAGES:
            parser.error(f"--limit {item!r}: unknown stage; allowed: {', '.join(STAGES)}")
    results = run(stages, Path(args.out), smoke=args.smoke, budget_s=args.budget_s, limits=limits)
    return 0 if all(st == "ok" or st.startswith("no GPU") for _, st, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
