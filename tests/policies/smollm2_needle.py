"""SmolLM2 drivers shared by the policy regression tests (a needle sample; a short prompt beside full)."""

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


def beside_full(policy, *, prompt_tokens: int = 512, new_tokens: int = 4):
    """Greedy decode of ``prompt_tokens`` of prose under ``full`` and under ``policy``.

    Returns ``(ref, res)``, the two :class:`~kvpress.generation.GenerationResult` results
    (tokens and cache stats), for the "few tokens dropped, same answer" regressions.
    """
    from kvpress.evals.tasks import get_task
    from kvpress.generation import timed_generate

    model, tokenizer = kvpress.load_model("smollm2")
    ids = torch.tensor([get_task("ppl").token_ids(tokenizer, prompt_tokens)])
    ref = timed_generate(model, ids, kvpress.get_policy("full"), max_new_tokens=new_tokens, eos_token_id=[])
    res = timed_generate(model, ids, policy, max_new_tokens=new_tokens, eos_token_id=[])
    return ref, res
