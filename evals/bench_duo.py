"""DuoAttention on SmolLM2: calibrated vs random head choice vs full, score and resident KV.

Checks DuoAttention's targets: with 50% retrieval heads, resident KV <= 55% of ``full`` and score
>= 95% of full's on tasks where full scores >= 0.5; the same number of *random* heads
(``random_heads_seed``) should score clearly worse.

    python -m kvpress.evals.bench_duo --lengths 4096,8192 --tasks niah_single --samples 3 \\
        --out results/duo.json

Prints one fixed-width table (per length, task and policy: mean score, resident MiB, resident /
full, prefill s, decode ms/token) and writes every sample's row as JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--tasks", default="niah_single")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--sparsity", type=float, default=0.5, help="fraction of streaming KV heads")
    parser.add_argument("--random-seeds", default="0", help="seeds of the random-heads ablation (comma-separated)")
    parser.add_argument("--artifact", default=None, help="duo artifact (default: the shipped one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--policies", default=None, help="subset of full,duo,duo_random<seed> to run (default: all)")
    parser.add_argument("--out", default=None, help="JSON file for per-sample rows")
    parser.add_argument("--table", nargs="+", default=None, help="only print the table of these JSON files (merged)")
    args = parser.parse_args(argv)
    if args.table:
        rows = [r for f in args.table for r in json.loads(pathlib.Path(f).read_text())["rows"]]
        _table(rows, list(dict.fromkeys(r["policy"] for r in rows)))
        return 0
    torch.set_num_threads(args.threads)

    import kvpress
    from kvpress.evals.tasks import build_input_ids, get_task
    from kvpress.generation import timed_generate

    model, tokenizer = kvpress.load_model(args.model)
    duo = kvpress.get_policy("duo", artifact=args.artifact, sparsity=args.sparsity)
    policies = {"full": kvpress.get_policy("full"), "duo": duo}
    for seed in [int(s) for s in args.random_seeds.split(",") if s.strip()]:
        policies[f"duo_random{seed}"] = duo.replace(random_heads_seed=seed)
    if args.policies:
        policies = {k: v for k, v in policies.items() if k in args.policies.split(",")}

    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for spec in args.tasks.split(","):
            task = get_task(spec)
            for sample in task.generate(tokenizer, length=length, num_samples=args.samples, seed=0):
                ids = torch.tensor([build_input_ids(tokenizer, sample)])
                for name, policy in policies.items():
                    t0 = time.perf_counter()
                    result = timed_generate(
                        model, ids, policy, max_new_tokens=sample.max_new_tokens, eos_token_id=tokenizer.eos_token_id
                    )
                    text = tokenizer.decode(result.tokens[0], skip_special_tokens=True)
                    row = {
                        "length": length, "task": task.spec, "sample": sample.index, "policy": name,
                        "score": task.score(text, sample), "resident_bytes": result.stats.resident_bytes,
                        "dense_bytes": result.stats.dense_bytes, "prefill_s": result.prefill_s,
                        "decode_ms_per_token": result.decode_ms_per_token, "prediction": text,
                    }
                    rows.append(row)
                    print(f"  {length:>5} {task.name:<14} #{sample.index} {name:<12} score {row['score']:.2f}  "
                          f"{row['resident_bytes'] / 2**20:7.2f} MiB  {time.perf_counter() - t0:6.1f} s  {text[:40]!r}", flush=True)
                if args.out:
                    _write(args.out, args, rows)

    if args.out:
        _write(args.out, args, rows)
    _table(rows, list(policies))
    return 0


def _table(rows, names) -> None:
    print(f"\n{'length':>6}  {'task':<16}  {'policy':<12}  {'score':>5}  {'% full':>6}  {'MiB':>7}  {'/full':>5}  {'prefill s':>9}  {'ms/tok':>6}")
    keys = sorted({(r["length"], r["task"]) for r in rows})
    for length, spec in keys:
        group = [r for r in rows if r["length"] == length and r["task"] == spec]
        full = _mean(group, "full")
        for name in names:
            m = _mean(group, name)
            pct = 100 * m["score"] / full["score"] if full["score"] else float("nan")
            print(f"{length:>6}  {spec[:16]:<16}  {name:<12}  {m['score']:5.2f}  {pct:6.1f}  {m['resident_bytes'] / 2**20:7.2f}  "
                  f"{m['resident_bytes'] / full['resident_bytes']:5.3f}  {m['prefill_s']:9.2f}  {m['decode_ms_per_token']:6.1f}")


def _mean(group, name):
    rows = [r for r in group if r["policy"] == name]
    if not rows:
        return {k: float("nan") for k in ("score", "resident_bytes", "prefill_s", "decode_ms_per_token")}
    return {k: sum(r[k] for r in rows) / len(rows) for k in ("score", "resident_bytes", "prefill_s", "decode_ms_per_token")}


def _write(path, args, rows) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
