"""``kvpress demo``: recommended policy configurations side by side on one needle-in-a-haystack prompt.

Each configuration answers the same prompt greedily; the table gives whether it found the needle,
the resident KV bytes (and their ratio to ``full``'s), its decode speed as a ratio to ``full``'s
measured in the same run, and its prefill time. Policies whose prefill is plain dense attention
(``policy.prefills_densely()``) start from one shared prefill (:mod:`kvpress.prefill`), so the
prompt runs through the model once for all of them. The decode speed comes from a separate
phase in which every policy's cache takes one decode step in turn, several rounds, so that a
change in machine load hits every policy alike; the column is ``full``'s median step time over
the policy's.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field

import torch

# Configurations measured to keep needles at 4k-8k with budget 256 (BENCHMARKS.md, README "At a
# glance"), plus `streaming`, the cheap window that cannot see a needle outside it.
DEFAULT_POLICIES = (
    "full",
    "streaming",
    "kivi-4bit",
    "zipcache-4bit",
    "double-sparsity-256",
    "duo",
    "snapkv-256",
    "shadowkv-offload",
)
TIMING_ROUNDS = 8  # decode steps per policy in the timing phase; the first is left out of the median


@dataclass(eq=False)
class DemoRow:
    """One policy's result: its answer, cache bytes and timings (filled as the demo runs)."""

    spec: str
    policy: object
    tokens: list = field(default_factory=list)
    text: str = ""
    correct: bool = False
    resident_bytes: int = 0
    prefill_s: float = float("nan")
    shared_prefill: bool = False
    step_ms: list = field(default_factory=list)
    cache: object = None
    position: int = 0

    @property
    def decode_ms(self) -> float:
        """Median decode step time of the timing phase (its first step left out)."""
        steps = self.step_ms[1:] or self.step_ms
        return statistics.median(steps) if steps else float("nan")


def demo_policies(specs=None, budget: int | None = 256) -> list[tuple[str, object]]:
    """``(spec, policy)`` for each policy spec, ``full`` first; ``budget`` through ``with_budget``.

    ``budget`` reaches every policy that takes one (``Policy.with_budget``) unless its spec sets
    ``budget`` itself; policies without one run as the spec says. ``specs`` defaults to
    :data:`DEFAULT_POLICIES`; ``full`` is added when missing (the ratios are to it).

    Raises
    ------
    ValueError
        An unknown policy or field, a value out of range, or ``budget < 1``.
    """
    import kvpress
    from kvpress.registry import parse_policy_spec

    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be an int >= 1 (or None: each policy's own), got {budget!r}")
    specs = list(dict.fromkeys(s.strip() for s in (specs or DEFAULT_POLICIES) if s.strip()))
    if "full" not in specs:
        specs.insert(0, "full")
    specs.sort(key=lambda s: s != "full")  # the reference first
    out = []
    for spec in specs:
        policy = kvpress.get_policy(spec)
        if budget is not None and "budget" not in parse_policy_spec(spec)[1] and _takes_budget(policy):
            try:
                policy = policy.with_budget(budget)
            except ValueError as exc:
                raise ValueError(f"{spec} with budget {budget}: {exc}") from None
        out.append((spec, policy))
    return out


def _takes_budget(policy) -> bool:
    from kvpress.registry import Policy

    fields = {f.name for f in dataclasses.fields(policy)}
    return "budget" in fields or type(policy).with_budget is not Policy.with_budget


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _Progress:
    """One line per policy on stderr: which policy, how long it took, time since the demo began."""

    def __init__(self, total: int, stream=None):
        self.total, self.start = total, time.perf_counter()
        self.stream = sys.stderr if stream is None else stream

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", file=self.stream, flush=True)


@torch.no_grad()
def answer_all(model, tokenizer, input_ids: torch.Tensor, policies, *, max_new_tokens: int, eos_token_id=None,
               score=None, prefill_chunk_size: int | None = None, share_prefill: bool = True,
               timing_rounds: int = TIMING_ROUNDS, progress: _Progress | None = None) -> list[DemoRow]:
    """Answer ``input_ids`` [1, T] greedily under each ``(spec, policy)``, then time decode steps in turn.

    Parameters
    ----------
    policies : list of (str, Policy)
        As :func:`demo_policies` returns them.
    score : callable, optional
        ``score(text) -> bool``: whether an answer is correct.
    prefill_chunk_size : int, optional
        Every policy runs its own prefill in forwards of this many tokens (no shared prefill).
    share_prefill : bool
        Start the policies whose prefill is dense attention from one shared prefill.
    timing_rounds : int
        Decode steps per policy in the timing phase (0: no timing; ``decode_ms`` is NaN).

    Returns
    -------
    list of DemoRow, in the order of ``policies``; ``cache`` is released.
    """
    from kvpress.evals.decode import decode_from_cache, shared_prefill
    from kvpress.generation import timed_generate
    from kvpress.prefill import cache_from_dense

    progress = progress or _Progress(len(policies))
    device = model.device
    ids = input_ids.to(device)
    rows = [DemoRow(spec, policy) for spec, policy in policies]
    sharers = [r for r in rows if share_prefill and prefill_chunk_size is None and r.policy.prefills_densely()]
    shared = None
    if len(sharers) >= 2:
        progress.say(f"prefill of {ids.shape[1]} tokens, shared by {', '.join(r.spec for r in sharers)}")
        shared = shared_prefill(model, ids)
    sharing = {id(r) for r in sharers} if shared is not None else set()
    for i, row in enumerate(rows, 1):
        start = time.perf_counter()
        if id(row) in sharing:
            _sync(device)
            copy_start = time.perf_counter()
            row.cache = cache_from_dense(model, row.policy, shared.cache)
            _sync(device)
            row.prefill_s, row.shared_prefill = shared.seconds + time.perf_counter() - copy_start, True
            row.tokens, _ = decode_from_cache(model, row.policy, row.cache, shared.first_logits, shared.length,
                                              max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        else:
            res = timed_generate(model, ids, row.policy, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                 keep_cache=True, prefill_chunk_size=prefill_chunk_size)
            row.tokens, row.cache, row.prefill_s = res.tokens[0].tolist(), res.cache, res.prefill_s
        # the cache holds the prompt and every answer token but the last, which the next step feeds
        row.position = ids.shape[1] + len(row.tokens) - 1
        row.resident_bytes = _resident_bytes(row.cache)
        row.text = tokenizer.decode(row.tokens, skip_special_tokens=True).strip()
        row.correct = bool(score(row.text)) if score is not None else False
        verdict = ("correct" if row.correct else "wrong") if score is not None else "answered"
        progress.say(f"[{i}/{len(rows)}] {row.spec}: {verdict} {row.text[:24]!r}, "
                     f"{time.perf_counter() - start:.1f} s")
    shared = None  # the dense prompt cache is no longer needed
    if timing_rounds > 0:
        progress.say(f"timing decode: {timing_rounds} steps of each policy, in turn")
        _time_steps(model, rows, timing_rounds)
    for row in rows:
        row.cache = None
    return rows


def _resident_bytes(cache) -> int:
    from kvpress.stats import cache_stats

    return cache_stats(cache).resident_bytes


def _time_steps(model, rows: list[DemoRow], rounds: int) -> None:
    """Every row's cache takes one greedy decode step in turn, ``rounds`` times; wall ms per step."""
    from kvpress.compat import cache_kwargs
    from kvpress.patching import apply

    device = model.device
    nexts = [torch.tensor([[row.tokens[-1]]], device=device) for row in rows]
    for _ in range(rounds):
        for i, row in enumerate(rows):
            mask = torch.ones(1, row.position + 1, dtype=torch.long, device=device)
            position = torch.tensor([[row.position]], device=device)
            with apply(model, row.policy):
                _sync(device)
                start = time.perf_counter()
                out = model(input_ids=nexts[i], attention_mask=mask, position_ids=position,
                            **cache_kwargs(model, row.cache), use_cache=True)
                nexts[i] = out.logits[:, -1:].argmax(-1)
                _sync(device)
                row.step_ms.append(1e3 * (time.perf_counter() - start))
            row.position += 1


def format_rows(rows: list[DemoRow]) -> str:
    """The demo's table: policy, correct, resident KV MiB, KV / full, decode speed / full, prefill s, answer."""
    full = next((r for r in rows if r.spec == "full"), rows[0])
    width = max([18] + [len(r.spec) for r in rows])
    header = (f"{'policy':<{width}} {'correct':>7} {'KV MiB':>8} {'KV/full':>8} {'speed/full':>10} "
              f"{'prefill s':>10}  answer")
    lines = [header, "-" * len(header)]
    for r in rows:
        kv_ratio = f"{r.resident_bytes / full.resident_bytes:.2f}x" if full.resident_bytes else "-"
        speed = full.decode_ms / r.decode_ms if r.decode_ms > 0 else float("nan")
        speed_text = "-" if math.isnan(speed) else f"{speed:.2f}x"
        prefill = f"{r.prefill_s:.2f}" + ("*" if r.shared_prefill else " ")
        lines.append(f"{r.spec:<{width}} {'yes' if r.correct else 'no':>7} {r.resident_bytes / 2**20:>8.2f} "
                     f"{kv_ratio:>8} {speed_text:>10} {prefill:>10}  {r.text[:40]!r}")
    return "\n".join(lines)


def _footnotes(rows: list[DemoRow], rounds: int) -> str:
    full = next((r for r in rows if r.spec == "full"), rows[0])
    notes = []
    if rounds > 0:
        notes.append(f"speed/full: full's median decode step ({full.decode_ms:.1f} ms here) over the policy's; "
                     f"{rounds} steps of each policy taken in turn, so machine load hits all alike (> 1: faster). "
                     "At a few thousand tokens the model's weights dominate a step; the gaps grow with the length "
                     "(`kvpress bench --interleave`).")
    if any(r.shared_prefill for r in rows):
        notes.append("prefill s*: the shared dense prefill plus the copy into this policy's cache.")
    return "\n".join(textwrap.fill(note, 100, subsequent_indent="  ") for note in notes)


def run_demo(model: str = "smollm2", length: int = 2048, budget: int | None = 256, policies=None,
             all_policies: bool = False, seed: int = 0, prefill_chunk_size: int | None = None,
             timing_rounds: int = TIMING_ROUNDS, loaded=None) -> int:
    """Print the demo table for a needle prompt of about ``length`` tokens; return 0.

    The prompt is a single-needle retrieval task (a number hidden at 50% depth in noise text,
    :mod:`kvpress.evals.tasks`). Progress goes to stderr, the table to stdout.

    Parameters
    ----------
    policies : str or sequence of str, optional
        Policy specs (``name:field=value``), comma-separated in a string; default
        :data:`DEFAULT_POLICIES`. Each must run on the model (else ValueError).
    all_policies : bool
        Every registered policy at its defaults, ``budget`` applied, instead (those that cannot
        run on the model are skipped with a note).
    prefill_chunk_size : int, optional
        Each policy runs its own prefill in forwards of this many tokens.
    loaded : (model, tokenizer), optional
        An already loaded model (``model`` is then only its name).
    """
    import kvpress
    from kvpress.evals.tasks import build_input_ids, get_task

    if all_policies and policies:
        raise ValueError("pass --policies or --all, not both")
    if not isinstance(length, int) or length < 64:
        raise ValueError(f"length must be an int >= 64 tokens, got {length!r}")
    if prefill_chunk_size is not None and prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1 (or None: one forward), got {prefill_chunk_size}")
    if isinstance(policies, str):
        policies = policies.split(",")
    specs = kvpress.list_policies() if all_policies else policies
    chosen = demo_policies(specs, budget)  # bad specs fail before the model loads
    progress = _Progress(len(chosen))
    if loaded is None:
        progress.say(f"loading {model}")
        loaded = kvpress.load_model(model)
    model_obj, tokenizer = loaded
    adapter = kvpress.get_adapter(model_obj)
    runnable, problems = [], []
    for spec, policy in chosen:
        try:
            policy.check_model(adapter)
            runnable.append((spec, policy))
        except (ValueError, OSError) as exc:  # OSError: no calibration artifact for this model
            problems.append(f"{spec}: {exc}")
    if problems and not all_policies and policies:
        raise ValueError("policies that cannot run on this model:\n  " + "\n  ".join(problems))
    for problem in problems:
        progress.say(f"skipped {problem}")
    task = get_task("niah_single", haystack="noise", value_type="numbers", depth=0.5)
    sample = task.generate(tokenizer, length=length, num_samples=1, seed=seed)[0]
    ids = torch.tensor([build_input_ids(tokenizer, sample)])
    rows = answer_all(model_obj, tokenizer, ids, runnable, max_new_tokens=sample.max_new_tokens,
                      eos_token_id=tokenizer.eos_token_id, score=lambda text: task.score(text, sample) >= 1.0,
                      prefill_chunk_size=prefill_chunk_size, timing_rounds=timing_rounds, progress=progress)
    chunked = f", prefill in chunks of {prefill_chunk_size}" if prefill_chunk_size else ""
    knob = f"budget {budget}" if budget is not None else "each policy's own budget"
    print(f"{model}: prompt of {ids.shape[1]} tokens, needle {sample.answers}, {knob}{chunked}, "
          f"{torch.get_num_threads()} threads on {model_obj.device}\n")
    print(format_rows(rows))
    notes = _footnotes(rows, timing_rounds)
    if notes:
        print("\n" + notes)
    progress.say("done")
    return 0
