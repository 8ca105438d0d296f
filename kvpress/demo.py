"""The README's main job: every registered policy side by side on one long retrieval prompt."""

from __future__ import annotations

import sys
import time


def run_demo(model: str = "smollm2", length: int = 4096, budget: int = 256, policies: str | None = None, seed: int = 0,
             prefill_chunk_size: int | None = None) -> int:
    """Print policy | answer correct | resident KV MiB | decode ms/token for a needle prompt.

    The prompt is a single-needle retrieval task (a number hidden at 50% depth of ~``length``
    tokens of noise text, from :mod:`kvpress.evals.tasks`); each policy gets ``budget`` where it
    takes one. Prefill and decode are timed separately; ``prefill_chunk_size`` feeds the prompt in
    forwards of that many tokens.
    """
    import kvpress
    from kvpress.cli import build_policy
    from kvpress.evals.tasks import build_input_ids, get_task
    from kvpress.generation import timed_generate

    names = [n.strip() for n in policies.split(",")] if policies else kvpress.list_policies()
    names.sort(key=lambda n: n != "full")  # the reference first, so the others compare with it
    built = []
    for name in names:
        try:
            built.append(build_policy(name, budget))
        except ValueError:
            built.append(build_policy(name))  # no budget knob (e.g. quantization)
    t0 = time.perf_counter()
    model_obj, tokenizer = kvpress.load_model(model)
    print(f"loaded {model} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    task = get_task("niah_single", haystack="noise", value_type="numbers", depth=0.5)
    sample = task.generate(tokenizer, length=length, num_samples=1, seed=seed)[0]
    import torch

    ids = torch.tensor([build_input_ids(tokenizer, sample)])
    chunked = f", prefill in chunks of {prefill_chunk_size}" if prefill_chunk_size else ""
    print(f"prompt: {ids.shape[1]} tokens, needle answer {sample.answers}, budget {budget}{chunked}\n")
    header = f"{'policy':<18} {'correct':>7} {'resident KV MiB':>16} {'vs full':>8} {'prefill s':>10} {'decode ms/tok':>14}  answer"
    print(header)
    print("-" * len(header))
    full_bytes = None
    for policy in built:
        res = timed_generate(model_obj, ids, policy, max_new_tokens=sample.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             prefill_chunk_size=prefill_chunk_size)
        text = tokenizer.decode(res.tokens[0], skip_special_tokens=True).strip().replace("\n", " ")
        correct = task.score(text, sample) >= 1.0
        mib = res.stats.resident_bytes / 2**20
        if policy.name == "full":
            full_bytes = res.stats.resident_bytes
        ratio = f"{res.stats.resident_bytes / full_bytes:.2f}x" if full_bytes else "-"
        print(
            f"{policy.name:<18} {'yes' if correct else 'no':>7} {mib:>16.2f} {ratio:>8} {res.prefill_s:>10.2f} "
            f"{res.decode_ms_per_token:>14.1f}  {text[:40]!r}",
            flush=True,
        )
    return 0
