"""Subcommands ``kvpress eval``, ``kvpress bench`` and ``kvpress lm-eval`` (added to ``kvpress.cli``).

Imports stay inside the command functions so ``kvpress --help`` does not pull in lm-eval or
matplotlib.
"""

from __future__ import annotations

import sys

from kvpress.cli import SUBCOMMANDS


def _csv(text: str | None, cast=str) -> tuple:
    if not text:
        return ()
    try:
        return tuple(cast(item.strip()) for item in text.split(",") if item.strip())
    except ValueError as exc:
        raise ValueError(f"expected a comma-separated list of {cast.__name__}, got {text!r}") from exc


def parse_options(items) -> dict:
    """``["duo.sink_tokens=8", ...]`` (repeated ``-o POLICY.FIELD=VALUE``) -> ``{"duo.sink_tokens": "8"}``."""
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--option expects <policy>.<field>=<value>, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _policies(text: str | None) -> tuple:
    specs = _csv(text)
    for spec in specs:
        if "=" in spec and ":" not in spec:  # "duo:a=1,b=2": the comma split one entry in two
            raise ValueError(f"policy entry {spec!r} is a field without a policy: fields of one entry are "
                             "separated by ':' (duo:sink_tokens=8:window_size=64), entries by ','")
    return specs


def _tasks(text: str) -> tuple:
    # Task specs may carry their own commas ("vt:haystack=prose,num_hops=2"); split on ';' then.
    if ";" in text:
        return tuple(t.strip() for t in text.split(";") if t.strip())
    return _csv(text)


def cmd_eval(args) -> int:
    from .runner import EvalGrid, run_eval

    grid = EvalGrid(  # every name and field is checked here, before the model loads
        model=args.model, policies=_policies(args.policies), budgets=_csv(args.budgets, int), bits=_csv(args.bits, int),
        tasks=_tasks(args.tasks), lengths=_csv(args.lengths, int), samples=args.samples,
        sample_ids=_csv(args.sample_ids, int), seed=args.seed,
        options=parse_options(args.option), share_prefill=not args.no_share_prefill, chunk_size=args.chunk_size,
        dtype=args.dtype, device=args.device, max_new_tokens=args.max_new_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
    )
    run_eval(grid, args.out, max_cells=args.max_cells, progress=not args.no_progress, plots=not args.no_plots,
             reuse=_csv(args.reuse))
    return 0


def configure_eval(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, a local folder, a hub id, random-llama3-8b[-Nl], random-smollm2, random-tiny, random-gemma3-270m")
    p.add_argument("--policies", default=None, help="comma-separated registered names, each optionally with ':'-separated fields: duo:sink_tokens=8:window_size=64 (default: all)")
    p.add_argument("--budgets", default=None, help="comma-separated token budgets, e.g. 128,256,512,1024")
    p.add_argument("--bits", default=None, help="comma-separated bit widths for policies with a `bits` field")
    p.add_argument("--tasks", default="niah_single,niah_multikey,vt",
                   help="task specs, comma-separated (use ';' when specs carry options: 'vt:num_hops=2;cwe')")
    p.add_argument("--lengths", default="4096", help="comma-separated input lengths in tokens")
    p.add_argument("--samples", type=int, default=5, help="samples per task and length")
    p.add_argument("--sample-ids", default=None,
                   help="run only these comma-separated indices of the --samples sweep (same samples and keys)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--option", action="append", metavar="POLICY.FIELD=VALUE", help="policy field (repeatable)")
    p.add_argument("--out", default="results", help="output folder (JSONL, CSVs, PNG plots); reruns resume")
    p.add_argument("--max-cells", type=int, default=None, help="stop after this many cells (resume later)")
    p.add_argument("--reuse", default=None, metavar="DIR[,DIR]",
                   help="output folders of earlier runs: cells with the same key (model, policy fields, task, length, "
                        "sample, seed) are copied from there, marked reused_from, instead of computed (e.g. full's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap each answer's token budget")
    p.add_argument("--prefill-chunk-size", type=int, default=None, metavar="N",
                   help="generation prompts in forwards of N tokens; policies whose pieces do not end as one "
                        "forward (the quantizers) run as their own '~prefillN' variants")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk of the ppl task")
    p.add_argument("--no-share-prefill", action="store_true", help="prefill every policy separately")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: the model's)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.set_defaults(func=cmd_eval)


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(
        model=args.model, policies=_policies(args.policies), budget=args.budget, lengths=_csv(args.lengths, int),
        new_tokens=args.new_tokens, options=parse_options(args.option), out=args.out, dtype=args.dtype,
        device=args.device, repeats=args.repeats, interleave=args.interleave,
    )


def configure_bench(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, a folder, a hub id, random-llama3-8b[-Nl], random-smollm2, random-tiny, random-gemma3-270m")
    p.add_argument("--policies", default=None, help="comma-separated names (default: all registered)")
    p.add_argument("--budget", type=int, default=256, help="budget given to policies that take one")
    p.add_argument("--lengths", default="2048,4096", help="comma-separated prompt lengths")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (the fastest is reported)")
    p.add_argument("--interleave", action="store_true",
                   help="decode all policies in turn from one shared dense prefill; medians per step "
                        "(robust to load on a shared machine)")
    p.add_argument("-o", "--option", action="append", metavar="POLICY.FIELD=VALUE")
    p.add_argument("--out", default=None, help="folder for bench.jsonl / bench.csv")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_bench)


def cmd_lm_eval(args) -> int:
    try:
        from .lm_eval_model import lm_eval_main
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "lm_eval":
            raise ValueError("kvpress lm-eval needs lm-eval: pip install 'kvpress-toolkit[eval]'") from None
        raise
    return lm_eval_main(args.extra)


def configure_lm_eval(p) -> None:
    p.set_defaults(func=cmd_lm_eval, accepts_extra=True)


def cmd_report(args) -> int:
    from .report import format_report, load, write_report

    records = load(args.dirs)
    if not records:
        raise ValueError(f"no kvpress eval results (results.jsonl) in {args.dirs}")
    print(format_report(records, args.min_full, n_boot=args.bootstrap))
    import importlib.util

    plots = not args.no_plots
    if plots and importlib.util.find_spec("matplotlib") is None:
        print("kvpress: matplotlib is not installed: report.md without plots (pip install matplotlib)",
              file=sys.stderr)
        plots = False
    written = write_report(records, args.out or args.dirs[0], args.min_full, n_boot=args.bootstrap, plots=plots)
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def configure_report(p) -> None:
    from .report import BOOTSTRAP_RESAMPLES  # stdlib-only module: cheap for --help

    p.add_argument("dirs", nargs="+", help="output folders of kvpress eval (cells seen twice count once)")
    p.add_argument("--min-full", type=float, default=0.5, help="tasks count where full scores at least this (default 0.5)")
    p.add_argument("--bootstrap", type=int, default=BOOTSTRAP_RESAMPLES, metavar="N",
                   help="paired bootstrap resamples behind each retention cell's 95%% interval "
                        f"(default {BOOTSTRAP_RESAMPLES}; 0: no intervals)")
    p.add_argument("--out", default=None,
                   help="folder for report.md and the PNG plots (default: the first folder)")
    p.add_argument("--no-plots", action="store_true", help="write report.md without the plots")
    p.set_defaults(func=cmd_report)


SUBCOMMANDS["eval"] = ("grid of policies x budgets x lengths x tasks (resumable; tables and plots)", configure_eval)
SUBCOMMANDS["bench"] = ("decode ms/token, prefill time and KV bytes per policy across lengths", configure_bench)
SUBCOMMANDS["report"] = ("markdown tables of eval results: score relative to full per policy and budget", configure_report)
SUBCOMMANDS["lm-eval"] = ("lm-eval's own CLI with the `kvpress` model type and the kvpress tasks", configure_lm_eval)
