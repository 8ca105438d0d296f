"""Subcommands ``kvpress eval``, ``kvpress bench``, ``kvpress report`` and ``kvpress lm-eval`` (added to
``kvpress.cli``).

Imports stay inside the command functions so ``kvpress --help`` does not pull in torch, lm-eval or
matplotlib. Every option is checked before a model loads; a bad value is one line on stderr (exit 2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvpress.cli import SUBCOMMANDS, check_device, check_lengths, device_name, dtype_name, int_at_least


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive.__name__ = "int >= 1"


def _csv(text: str | None, cast=str, option: str = "list", what: str | None = None) -> tuple:
    """``"a,b"`` -> ``("a", "b")`` (``cast`` each); None -> (); an empty entry is a ValueError."""
    if text is None:
        return ()
    what = what or cast.__name__
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"{option} {text!r} has an empty entry; expected a comma-separated list of {what}")
    try:
        return tuple(cast(item) for item in items)
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected a comma-separated list of {what}") from None


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
    """Policy specs of ``--policies``; () (every policy) only when the option is left out."""
    specs = _csv(text, option="--policies", what="policy names (see `kvpress policies`), or no --policies "
                 "for every policy")
    for spec in specs:
        if "=" in spec and ":" not in spec:  # "duo:a=1,b=2": the comma split one entry in two
            raise ValueError(f"policy entry {spec!r} is a field without a policy: fields of one entry are "
                             "separated by ':' (duo:sink_tokens=8:window_size=64), entries by ','")
    return specs


def _tasks(text: str) -> tuple:
    # Task specs may carry their own commas ("vt:haystack=prose,num_hops=2"); split on ';' then.
    if ";" in text:
        specs = tuple(t.strip() for t in text.split(";"))
        if not all(specs):
            raise ValueError(f"--tasks {text!r} has an empty entry; expected task specs separated by ';'")
        return specs
    return _csv(text, option="--tasks", what="task specs")


def check_out_folder(out: str, option: str = "--out") -> None:
    """Create ``out`` (a new folder or an earlier run's) and check a file can be written in it."""
    import tempfile

    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {out}: is a file; expected a folder (new, or an earlier run's to resume)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {out}: cannot write there ({exc.strerror or exc}); expected a writable folder") \
            from None


def check_reuse_folders(folders) -> None:
    """Raise ValueError for a ``--reuse`` folder that does not exist."""
    for folder in folders:
        if not os.path.isdir(os.path.expanduser(folder)):
            raise ValueError(f"--reuse {folder}: no such folder; expected output folders of earlier kvpress eval runs")


def cmd_eval(args) -> int:
    from .runner import EvalGrid, run_eval

    grid = EvalGrid(  # every name and field is checked here, before the model loads
        model=args.model, policies=_policies(args.policies), budgets=_csv(args.budgets, _positive, "--budgets"),
        bits=_csv(args.bits, _positive, "--bits"), tasks=_tasks(args.tasks),
        lengths=_csv(args.lengths, _positive, "--lengths"), samples=args.samples,
        sample_ids=_csv(args.sample_ids, int, "--sample-ids"), seed=args.seed,
        options=parse_options(args.option), share_prefill=not args.no_share_prefill, chunk_size=args.chunk_size,
        dtype=args.dtype, device=args.device, max_new_tokens=args.max_new_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
    )
    reuse = _csv(args.reuse, option="--reuse", what="folders")
    check_reuse_folders(reuse)
    check_lengths(grid.model, grid.lengths)
    check_device(grid.device)
    check_out_folder(args.out)
    run_eval(grid, args.out, max_cells=args.max_cells, progress=not args.no_progress, plots=not args.no_plots,
             reuse=reuse)
    return 0


_MODELS_HELP = ("smollm2, a local folder, a hub id, random-llama3-8b[-Nl], random-smollm2, random-tiny, "
                "random-gemma3-270m")


def _add_model_args(p) -> None:
    p.add_argument("--model", default="smollm2", help=_MODELS_HELP)
    p.add_argument("--dtype", type=dtype_name, default=None,
                   help="float32 / float16 / bfloat16 (default: the model's; random models: bfloat16 on CUDA)")
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu / cuda / cuda:N / mps (default: cuda when available)")


def configure_eval(p) -> None:
    _add_model_args(p)
    p.add_argument("--policies", default=None,
                   help="comma-separated registered names, each optionally with ':'-separated fields: "
                        "duo:sink_tokens=8:window_size=64 (default: all)")
    p.add_argument("--budgets", default=None, help="comma-separated token budgets, e.g. 128,256,512,1024")
    p.add_argument("--bits", default=None, help="comma-separated bit widths for policies with a `bits` field")
    p.add_argument("--tasks", default="niah_single,niah_multikey,vt",
                   help="task specs, comma-separated (use ';' when specs carry options: 'vt:num_hops=2;cwe')")
    p.add_argument("--lengths", default="4096",
                   help="comma-separated input lengths in tokens (at most the model's max_position_embeddings)")
    p.add_argument("--samples", type=int_at_least(1), default=5, help="samples per task and length")
    p.add_argument("--sample-ids", default=None,
                   help="run only these comma-separated indices of the --samples sweep (same samples and keys)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--option", action="append", metavar="POLICY.FIELD=VALUE", help="policy field (repeatable)")
    p.add_argument("--out", default="results", help="output folder (JSONL, CSVs, PNG plots); reruns resume")
    p.add_argument("--max-cells", type=int_at_least(1), default=None,
                   help="stop after this many cells (resume later)")
    p.add_argument("--reuse", default=None, metavar="DIR[,DIR]",
                   help="output folders of earlier runs: cells with the same key (model, policy fields, task, length, "
                        "sample, seed) are copied from there, marked reused_from, instead of computed (e.g. full's)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help="cap each answer's token budget")
    p.add_argument("--prefill-chunk-size", type=int_at_least(1), default=None, metavar="N",
                   help="generation prompts in forwards of N tokens; policies whose pieces do not end as one "
                        "forward (the quantizers) run as their own '~prefillN' variants")
    p.add_argument("--chunk-size", type=int_at_least(1), default=512, help="prefill chunk of the ppl task")
    p.add_argument("--no-share-prefill", action="store_true", help="prefill every policy separately")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=cmd_eval)


def cmd_bench(args) -> int:
    from .bench import run_bench

    lengths = _csv(args.lengths, _positive, "--lengths")
    policies = _policies(args.policies)
    check_lengths(args.model, lengths)
    check_device(args.device)
    if args.out is not None:
        check_out_folder(args.out)
    return run_bench(
        model=args.model, policies=policies, budget=args.budget, lengths=lengths,
        new_tokens=args.new_tokens, options=parse_options(args.option), out=args.out, dtype=args.dtype,
        device=args.device, repeats=args.repeats, interleave=args.interleave,
    )


def configure_bench(p) -> None:
    _add_model_args(p)
    p.add_argument("--policies", default=None, help="comma-separated names (default: all registered)")
    p.add_argument("--budget", type=int_at_least(1), default=256, help="budget given to policies that take one")
    p.add_argument("--lengths", default="2048,4096",
                   help="comma-separated prompt lengths (at most the model's max_position_embeddings)")
    p.add_argument("--new-tokens", type=int_at_least(2), default=16,
                   help="decode steps timed per run (--interleave: at least 4)")
    p.add_argument("--repeats", type=int_at_least(1), default=1, help="runs per cell (the fastest is reported)")
    p.add_argument("--interleave", action="store_true",
                   help="decode all policies in turn from one shared dense prefill; medians per step "
                        "(robust to load on a shared machine)")
    p.add_argument("-o", "--option", action="append", metavar="POLICY.FIELD=VALUE")
    p.add_argument("--out", default=None, help="folder for bench.jsonl / bench.csv")
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
    p.add_argument("--min-full", type=float, default=0.5,
                   help="tasks count where full scores at least this (default 0.5)")
    p.add_argument("--bootstrap", type=int_at_least(0), default=BOOTSTRAP_RESAMPLES, metavar="N",
                   help="paired bootstrap resamples behind each retention cell's 95%% interval "
                        f"(default {BOOTSTRAP_RESAMPLES}; 0: no intervals)")
    p.add_argument("--out", default=None,
                   help="folder for report.md and the PNG plots (default: the first folder)")
    p.add_argument("--no-plots", action="store_true", help="write report.md without the plots")
    p.set_defaults(func=cmd_report)


SUBCOMMANDS["eval"] = ("grid of policies x budgets x lengths x tasks (resumable; tables and plots)", configure_eval)
SUBCOMMANDS["bench"] = ("decode ms/token, prefill time and KV bytes per policy across lengths", configure_bench)
SUBCOMMANDS["report"] = ("markdown tables of eval results: score relative to full per policy and budget",
                          configure_report)
SUBCOMMANDS["lm-eval"] = ("lm-eval's own CLI with the `kvpress` model type and the kvpress tasks", configure_lm_eval)
