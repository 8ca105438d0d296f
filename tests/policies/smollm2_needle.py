"""One SmolLM2 needle-in-a-haystack sample through a policy: the slow regression tests' driver."""

from __future__ import annotations

import torch

import kvpress


def needle_run(policy, *, length: int = 4096, sample: int = 0, of: int = 4, task: str = "niah_single"):
    """Greedy answer of the embedded SmolLM2 to sample ``sample`` of ``of`` generated ones under ``policy``.

    ``of`` matters: the generator spreads needle depths over the samples it makes (sample 0 of 4 =
    depth 0), exactly as ``kvpress eval --samples 4`` does.

    Returns ``(score, stats)``: the task's score in [0, 1] and the cache's
    :class:`~kvpress.stats.CacheStats` after generation.
    """
    from kvpress.evals.tasks import build_input_ids, get_task
    from kvpress.generation import timed_generate

    torch.set_num_threads(1)
    model, tokenizer = kvpress.load_model("smollm2")
    spec = get_task(task)
    item = spec.generate(tokenizer, length, of, 0)[sample]
    ids = torch.tensor([build_input_ids(tokenizer, item)])
    res = timed_generate(model, ids, policy, max_new_tokens=item.max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    return spec.score(tokenizer.decode(res.tokens[0], skip_special_tokens=True), item), res.stats
