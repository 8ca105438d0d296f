"""Decode speed of ``model.generate`` with the policies' static decode step compiled, against eager
decode under the same policy and against transformers' own ``StaticCache`` + ``torch.compile``.

    python -m kvpress.evals.bench_compiled --model smollm2 --length 2048 --new-tokens 32
    python -m kvpress.evals.bench_compiled --model random-llama3-8b --device cuda --dtype bfloat16 \\
        --length 32768 --new-tokens 64 --mode reduce-overhead          # a GPU: the compiled path's point

For each policy whose cache is compileable (``PolicyCache.is_compileable``), ``generate`` runs twice
under ``kvpress.apply``: eagerly (``disable_compile=True``) and through transformers' compiled decode
(``compile_config``; on a CPU it is forced with ``CompileConfig._compile_all_devices``). The first
call of each compiles (untimed); decode ms/token is the time of ``new_tokens`` tokens less the time of
one (the prefill), divided by ``new_tokens - 1``, taken over ``--iters`` calls (median). The table
gives both, their ratio, the ratio to the ``StaticCache`` baseline, and whether the compiled
tokens equal the eager ones (greedy). ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

DEFAULT_POLICIES = "full,window,streaming"


def _clock(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _compile_config(backend: str, mode: str | None):
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=backend, mode=mode)
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    return config


def _decode_ms(generate, new_tokens: int, iters: int, device) -> tuple[float, torch.Tensor]:
    """Median decode ms/token of ``generate(n)`` over ``iters`` calls, after one untimed call of each
    length; the tokens of the last long call."""
    generate(new_tokens)
    generate(1)
    per_token = []
    for _ in range(iters):
        t0 = _clock(device)
        out = generate(new_tokens)
        t1 = _clock(device)
        generate(1)
        t2 = _clock(device)
        per_token.append(1000 * ((t1 - t0) - (t2 - t1)) / (new_tokens - 1))
    return statistics.median(per_token), out


def run(model, input_ids: torch.Tensor, policies: list[str], *, new_tokens: int, iters: int, backend: str,
        mode: str | None) -> list[dict]:
    import kvpress

    device = input_ids.device
    mask = torch.ones_like(input_ids)
    config = _compile_config(backend, mode)
    common = dict(attention_mask=mask, do_sample=False, min_new_tokens=0)

    def static_generate(n, **kw):
        return model.generate(input_ids, max_new_tokens=n, cache_implementation="static", **common, **kw)

    torch._dynamo.reset()
    base_ms, base_out = _decode_ms(lambda n: static_generate(n, compile_config=config), new_tokens, iters, device)
    rows = [{"policy": "transformers StaticCache", "eager_ms": None, "compiled_ms": round(base_ms, 3),
             "compiled_vs_eager": None, "compiled_vs_static": 1.0, "tokens_equal": None}]
    for spec in policies:
        policy = kvpress.get_policy(spec)
        with kvpress.apply(model, policy):
            compileable = kvpress.make_cache(model, policy).is_compileable
            eager_ms, eager_out = _decode_ms(
                lambda n: model.generate(input_ids, max_new_tokens=n, disable_compile=True, **common),
                new_tokens, iters, device)
            row = {"policy": spec, "eager_ms": round(eager_ms, 3), "compiled_ms": None, "compiled_vs_eager": None,
                   "compiled_vs_static": None, "tokens_equal": None}
            if compileable:
                torch._dynamo.reset()
                comp_ms, comp_out = _decode_ms(
                    lambda n: model.generate(input_ids, max_new_tokens=n, compile_config=config, **common),
                    new_tokens, iters, device)
                row.update(compiled_ms=round(comp_ms, 3), compiled_vs_eager=round(eager_ms / comp_ms, 3),
                           compiled_vs_static=round(base_ms / comp_ms, 3),
                           tokens_equal=bool(torch.equal(eager_out, comp_out)))
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    head = f"{'policy':<26} {'eager ms/tok':>12} {'compiled':>10} {'eager/comp':>10} {'static/comp':>11}  tokens equal"
    lines = [head, "-" * len(head)]
    fmt = lambda x, w: f"{'-' if x is None else x:>{w}}"  # noqa: E731
    for r in rows:
        lines.append(f"{r['policy']:<26} {fmt(r['eager_ms'], 12)} {fmt(r['compiled_ms'], 10)} "
                     f"{fmt(r['compiled_vs_eager'], 10)} {fmt(r['compiled_vs_static'], 11)}  "
                     f"{'-' if r['tokens_equal'] is None else r['tokens_equal']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress.evals.bench_compiled", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--length", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated specs (default {DEFAULT_POLICIES})")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, eager, ...)")
    parser.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    for name in ("length", "batch", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode time is the time of n tokens less the time of one)")

    from kvpress.evals.models import load_eval_model

    model, _ = load_eval_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, min(model.config.vocab_size, 32000) - 1, (args.batch, args.length),
                              generator=gen).to(args.device)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    with torch.no_grad():
        rows = run(model, input_ids, policies, new_tokens=args.new_tokens, iters=args.iters, backend=args.backend,
                   mode=args.mode)
    print(f"model {args.model}, {args.device} {args.dtype}, prompt {args.length} x batch {args.batch}, "
          f"{args.new_tokens} new tokens, backend {args.backend}, mode {args.mode}")
    print(_table(rows))
    if args.out:
        meta = {k: getattr(args, k) for k in ("model", "device", "dtype", "length", "batch", "new_tokens", "backend",
                                              "mode")}
        with open(args.out, "w") as f:
            json.dump({"config": meta, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
