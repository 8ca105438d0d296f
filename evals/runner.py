"""``kvpress eval``: a grid of policies x budgets (or bits) x lengths x tasks on one model.

>>> from kvpress.evals.runner import EvalGrid, run_eval
>>> grid = EvalGrid(model="smollm2", policies=("full", "streaming"), budgets=(128, 512),
...                 tasks=("niah_single", "vt"), lengths=(2048, 4096), samples=5)
>>> records = run_eval(grid, "results/")          # resumable; writes JSONL, CSVs and plots

A *cell* is one policy config x length x task x sample; each finished cell is appended to
``results.jsonl`` (with the grid, package versions and git SHA) before the next starts, and a
rerun skips cells already there. Every grid point is validated (tasks, policies, fields,
model name) before the model loads.

Budgets reach policies through ``policy.with_budget(b)``; a policy without a budget (it raises
ValueError) runs once, and so does one whose ``with_budget`` returns an equal config (``full``).
``bits`` sweeps the ``bits`` field of policies that have one. Policies whose class sets
dense prefill (``Policy.prefills_densely``) share one dense prefill per prompt (:mod:`kvpress.evals.decode`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import kvpress
from kvpress.registry import parse_policy_spec

from . import results as res
from .decode import DEFAULT_CHUNK_SIZE, chunked_nll, generate_sample, shared_prefill
from .models import check_model_name, default_device, load_eval_model
from .tasks import build_input_ids, get_task

@dataclass(frozen=True)
class PolicyVariant:
    """One policy config of the grid with the knob values that made it."""

    label: str
    policy: object
    budget: int | None = None
    bits: int | None = None
    spec: str = ""
    prefill_chunk: int | None = None  # its prompts in forwards of this many tokens (`EvalGrid.prefill_chunk_size`)

    @property
    def config(self) -> dict:
        config = self.policy.to_dict()
        return config if self.prefill_chunk is None else {**config, "prefill_chunk_size": self.prefill_chunk}


@dataclass(frozen=True)
class EvalGrid:
    """What ``kvpress eval`` runs (validated on construction, before any model loads).

    Parameters
    ----------
    model : str
        ``smollm2``, a local folder, a hub id, or a ``random-*`` shape (:mod:`kvpress.evals.models`).
    policies : tuple of str
        Registered names; default: every registered policy.
    budgets, bits : tuple of int
        Swept through ``with_budget`` / the ``bits`` field where the policy has them.
    tasks : tuple of str
        Task specs (``niah_single``, ``vt:haystack=prose``, ``ppl`` ...).
    lengths : tuple of int
        Input lengths in tokens.
    samples : int
        Samples per (task, length).
    sample_ids : tuple of int
        Run only these indices of the ``samples`` sweep (empty: all): the same samples, needle
        depths and result keys as in the whole run, e.g. to re-run the ones two policies disagree on.
    options : dict
        ``{"policy.field": "value"}`` overrides applied before budgets/bits.
    share_prefill : bool
        Prefill each prompt once for all policies whose prefill is dense attention.
    chunk_size : int
        Chunk of the ``ppl`` task's prefill through the policy cache.
    max_new_tokens : int, optional
        Cap on each sample's answer budget (quick runs; default: the task's own).
    prefill_chunk_size : int, optional
        Generation tasks feed each prompt in forwards of this many tokens
        (``generate(prefill_chunk_size=...)``). Policies whose pieces end as one forward
        (``chunked_prompt_exact``) give the same cells either way and keep their keys, labels and
        the shared prefill; the others (the quantizers, whose later pieces read the earlier ones
        quantized) become variants of their own, labelled ``~prefillN``, that never share a
        prefill. The ``ppl`` task is chunked by ``chunk_size`` regardless.
    """

    model: str = "smollm2"
    policies: tuple = ()
    budgets: tuple = ()
    bits: tuple = ()
    tasks: tuple = ("niah_single",)
    lengths: tuple = (4096,)
    samples: int = 5
    sample_ids: tuple = ()
    seed: int = 0
    options: dict = field(default_factory=dict)
    share_prefill: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE
    dtype: str | None = None
    device: str | None = None
    max_new_tokens: int | None = None
    prefill_chunk_size: int | None = None

    def __post_init__(self):
        for name in ("policies", "budgets", "bits", "tasks", "lengths", "sample_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "sample_ids", tuple(dict.fromkeys(self.sample_ids)))  # each index once
        if not self.policies:
            object.__setattr__(self, "policies", tuple(kvpress.list_policies()))
        check_model_name(self.model)
        for name in ("budgets", "bits", "lengths"):
            for value in getattr(self, name):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{name} must be positive ints, got {value!r}")
        if not self.tasks or not self.lengths:
            raise ValueError("the grid needs at least one task and one length")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples must be an int >= 1, got {self.samples!r}")
        for index in self.sample_ids:
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.samples:
                raise ValueError(f"sample_ids must be ints in 0 .. samples - 1 = {self.samples - 1}, got {index!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.prefill_chunk_size is not None and (not isinstance(self.prefill_chunk_size, int)
                                                    or self.prefill_chunk_size < 1):
            raise ValueError(f"prefill_chunk_size must be an int >= 1 (or None: one forward), got {self.prefill_chunk_size!r}")
        for spec in self.tasks:
            get_task(spec)
        self.variants()  # unknown policies / fields / out-of-range values fail here

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def task_objects(self) -> list:
        return [get_task(spec) for spec in self.tasks]

    def variants(self) -> list[PolicyVariant]:
        """Every distinct policy config of the grid, in the order given."""
        variants = expand_policies(self.policies, self.budgets, self.bits, self.options)
        n = self.prefill_chunk_size
        if n is None:
            return variants
        return [v if v.policy.chunked_prompt_exact else
                dataclasses.replace(v, label=f"{v.label}~prefill{n}", spec=f"{v.spec}~prefill{n}", prefill_chunk=n)
                for v in variants]


def _policy_options(names, options: dict) -> dict[str, dict]:
    bases = {parse_policy_spec(name)[0] for name in names}
    per_policy: dict[str, dict] = {name: {} for name in bases}
    for key, value in options.items():
        name, dot, fld = key.partition(".")
        if not dot or name not in per_policy:
            raise ValueError(f"policy option {key!r} must be <policy>.<field> with a policy of the grid: {sorted(bases)}")
        per_policy[name][fld] = value
    return per_policy


def expand_policies(names, budgets=(), bits=(), options=None) -> list[PolicyVariant]:
    """Policy configs for ``names`` x ``budgets`` x ``bits``, deduplicated.

    Raises
    ------
    ValueError
        Unknown policy or field, or a value out of range (from the policy's own validation).
    """
    per_policy = _policy_options(names, options or {})
    variants, seen, told = [], {}, set()
    for name in names:
        registered, spec_fields = parse_policy_spec(name)
        base = kvpress.get_policy(registered, **{**per_policy[registered], **spec_fields})
        candidates = []
        budget_list = list(budgets) or [None]
        for budget in budget_list:
            try:
                policy = base if budget is None else base.with_budget(budget)
            except ValueError:
                policy, budget = base, None  # no budget knob: one run
            if policy.to_dict() == base.to_dict() and budget is not None and policy is base:
                budget = None  # with_budget returned the same config (the reference)
            candidates.append((policy, budget))
        has_bits = "bits" in {f.name for f in dataclasses.fields(base)}
        for policy, budget in candidates:
            for b in (list(bits) if has_bits and bits else [None]):
                variant = policy if b is None else policy.replace(bits=b)
                key = json.dumps(variant.to_dict(), sort_keys=True)
                if key in seen:
                    if seen[key] != name and name not in told:  # another name for the same config: say so
                        told.add(name)
                        print(f"kvpress: {name!r} is the same configuration as {seen[key]!r} (its defaults); "
                              f"it runs once, as {seen[key]!r}", file=sys.stderr)
                    continue
                seen[key] = name
                label = name + (f"@{budget}" if budget is not None else "") + (f"/b{b}" if b is not None else "")
                variants.append(PolicyVariant(label, variant, budget, b, spec=name))
    return variants


def _samples_for(task, tokenizer, length: int, count: int, seed: int):
    if task.kind == "perplexity":
        return None
    return task.generate(tokenizer, length, num_samples=count, seed=seed)


def _eos(tokenizer, model):
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = model.generation_config.eos_token_id
    ids |= set(gen if isinstance(gen, (list, tuple)) else [] if gen is None else [gen])
    return sorted(ids) or None


@torch.no_grad()
def _ppl_cell(model, tokenizer, variant, length: int, chunk_size: int) -> dict:
    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, length)])
    start = time.perf_counter()
    nll, cache = chunked_nll(model, variant.policy, ids, chunk_size=chunk_size)
    seconds = time.perf_counter() - start
    nll = nll.mean()
    stats = kvpress.cache_stats(cache)
    return {"metric": "perplexity", "score": math.exp(float(nll)), "num_tokens": length, "prefill_s": seconds,
            "decode_ms_per_token": float("nan"), "new_tokens": 0, "prediction": "", "answers": [],
            "shared_prefill": False, **_stats(stats)}


def _stats(stats) -> dict:
    return {"resident_bytes": stats.resident_bytes, "offloaded_bytes": stats.offloaded_bytes, "dense_bytes": stats.dense_bytes}


def run_eval(grid: EvalGrid, out_dir, *, model=None, tokenizer=None, max_cells: int | None = None,
             progress: bool = True, plots: bool = True, quiet: bool = False, reuse=()) -> list[dict]:
    """Run ``grid``, appending each finished cell to ``out_dir/results.jsonl``; return all records.

    Parameters
    ----------
    model, tokenizer : optional
        An already loaded model (then ``grid.model`` is only its name in the records).
    max_cells : int, optional
        Stop after computing this many cells (the rest stays pending for the next run).
    progress : bool
        Show a tqdm bar with ETA on stderr.
    plots : bool
        Write the PNG plots (needs matplotlib).
    reuse : sequence of folders
        Output folders of earlier runs: a cell of this grid whose key (model, every policy field,
        task, length, sample, seed) is finished there is copied into ``out_dir`` with a
        ``reused_from`` field instead of being computed (e.g. ``full``'s cells for a new policy).

    Raises
    ------
    kvpress.evals.results.OutDirLockedError
        Another run is writing to ``out_dir`` (a ValueError; the run stops before any cell).
    """
    out_dir = Path(out_dir)
    variants = grid.variants()
    tasks = grid.task_objects()
    reusable = _reusable_cells(reuse, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with res.lock_out_dir(out_dir):
        return _run_locked(grid, out_dir, variants, tasks, reusable, model, tokenizer, max_cells, progress, plots,
                           quiet, reuse)


def _run_locked(grid: EvalGrid, out_dir: Path, variants, tasks, reusable: dict, model, tokenizer,
                max_cells: int | None, progress: bool, plots: bool, quiet: bool, reuse) -> list[dict]:
    """`run_eval` once it holds ``out_dir``'s lock."""
    done = {r["key"] for r in res.read_records(out_dir)}
    if model is None:
        model, tokenizer = load_eval_model(grid.model, dtype=grid.dtype, device=grid.device or default_device())
    elif tokenizer is None:
        raise ValueError("pass the tokenizer together with the model")
    adapter = kvpress.get_adapter(model)
    problems = []
    for variant in variants:  # model-dependent checks (head counts, artifacts) before any cell runs
        try:
            variant.policy.check_model(adapter)
        except (ValueError, OSError) as exc:  # OSError: a missing calibration artifact
            problems.append(f"{variant.label}: {exc}")
    if problems:
        raise ValueError("policies that cannot run on this model:\n  " + "\n  ".join(problems))
    env = res.environment()
    eos = _eos(tokenizer, model)

    plan = []  # (length, task, sample index, pending variants)
    reused = 0
    for length in grid.lengths:
        for task in tasks:
            for index in range(1) if task.kind == "perplexity" else (grid.sample_ids or range(grid.samples)):
                pending = []
                for v in variants:
                    key = res.cell_key(grid.model, v.config, task.spec, length, index, grid.seed)
                    if key in done:
                        continue
                    if key in reusable:
                        record, folder = reusable[key]
                        res.append_record(out_dir, {**record, "reused_from": str(folder)})
                        done.add(key)
                        reused += 1
                        continue
                    pending.append(v)
                if pending:
                    plan.append((length, task, index, pending))
    if reused and not quiet:
        print(f"reused {reused} finished cell(s) from {', '.join(map(str, reuse))}", file=sys.stdout)
    total = sum(len(p[3]) for p in plan)
    if max_cells is not None:
        total = min(total, max_cells)
    bar = _progress(total, progress)
    computed = 0
    samples_cache: dict = {}
    try:
        for length, task, index, pending in plan:
            if max_cells is not None and computed >= max_cells:
                break
            sample = ids = prefill = None
            if task.kind != "perplexity":
                key = (task.spec, length)
                if key not in samples_cache:
                    samples_cache = {key: _samples_for(task, tokenizer, length, grid.samples, grid.seed)}
                sample = samples_cache[key][index]
                ids = torch.tensor([build_input_ids(tokenizer, sample)])
                sharers = [v for v in pending if v.policy.prefills_densely() and v.prefill_chunk is None]
                if grid.share_prefill and len(sharers) >= 2:
                    prefill = shared_prefill(model, ids)
            for variant in pending:
                if max_cells is not None and computed >= max_cells:
                    break
                bar.set_description(f"{variant.label} {task.name} {length} #{index}")
                if task.kind == "perplexity":
                    cell = _ppl_cell(model, tokenizer, variant, length, grid.chunk_size)
                else:
                    use = prefill if variant.policy.prefills_densely() and variant.prefill_chunk is None else None
                    out = generate_sample(model, variant.policy, ids, max_new_tokens=min(sample.max_new_tokens, grid.max_new_tokens or sample.max_new_tokens),
                                          eos_token_id=eos, prefill=use, prefill_chunk_size=variant.prefill_chunk)
                    text = tokenizer.decode(out.tokens, skip_special_tokens=True)
                    cell = {"metric": "score", "score": task.score(text, sample), "num_tokens": ids.shape[1],
                            "prefill_s": out.prefill_s, "decode_ms_per_token": out.decode_ms_per_token,
                            "new_tokens": len(out.tokens), "prediction": text.strip(), "answers": sample.answers,
                            "shared_prefill": out.shared_prefill, **_stats(out.stats)}
                record = {
                    "key": res.cell_key(grid.model, variant.config, task.spec, length, index, grid.seed),
                    "model": grid.model, "policy_label": variant.label, "policy_name": variant.policy.name,
                    "policy_spec": variant.spec or variant.policy.name,
                    "policy": variant.config, "budget": variant.budget, "bits": variant.bits,
                    "task": task.name, "task_spec": task.spec, "length": length, "sample": index,
                    "seed": grid.seed, "device": str(model.device), "dtype": str(model.dtype),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "grid": grid.to_dict(), **env, **cell,
                }
                res.append_record(out_dir, record)
                computed += 1
                bar.update(1)
    finally:
        bar.close()
    records = [r for r in res.read_records(out_dir) if r.get("model") == grid.model]
    res.write_csvs(out_dir, records)
    if plots and records:
        from .plots import write_plots

        write_plots(records, out_dir)
    if not quiet:
        remaining = sum(len(p[3]) for p in plan) - computed
        print(res.format_table(res.summarize(records)), file=sys.stdout)
        if remaining:
            print(f"\n{remaining} cell(s) pending; rerun the same command to resume.", file=sys.stdout)
    return records


def _reusable_cells(folders, out_dir: Path) -> dict:
    """key -> (record, folder) of the finished cells in ``folders`` (the first folder naming a key wins)."""
    cells: dict = {}
    for folder in folders:
        folder = Path(folder)
        if not (folder / res.RESULTS_FILE).is_file():
            raise FileNotFoundError(f"reuse: {folder} holds no {res.RESULTS_FILE} (give output folders of kvpress eval)")
        if folder.resolve() == out_dir.resolve():
            continue  # its cells are already this run's
        for record in res.read_records(folder):
            if "key" in record:
                cells.setdefault(record["key"], (record, folder))
    return cells


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="cell", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def add_policy_bench_args(parser, *, policies: str, length: int) -> None:
    """The arguments the per-policy benchmark scripts share: ``--model``, ``--policies``,
    ``--budget``, ``--length``, ``--threads`` and ``--out`` (see `policy_bench_setup`)."""
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--policies", default=policies, help="comma list of policy specs (name:field=value)")
    parser.add_argument("--budget", type=int, default=256, help="token budget of the policies that take one (0: none)")
    parser.add_argument("--length", type=int, default=length, help="prompt tokens (about)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the rows as JSON lines here")


def policy_bench_setup(args) -> dict:
    """Apply ``--threads``; the keyword arguments of the scripts' ``run`` from the shared ones."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return {"policies": [s for s in args.policies.split(",") if s], "budget": args.budget or None,
            "length": args.length, "out": args.out}
