"""Where Quest's page bound puts a task's needle, against exact attention, per layer (CPU).

    python benchmarks/quest_page_bounds.py --model gemma3-270m --task niah_single --length 16384 --samples 8 \\
        --sample-ids 0,2,6 --budget 1024 --page-sizes 16,8

The prompt is built as ``kvpress eval`` builds it (``kvpress.evals.tasks`` + ``build_input_ids``), prefilled
once under ``full`` and decoded greedily under ``full`` until the first token of the answer. For two queries --
the prompt's last one and the one that generates the answer's first token -- and in each layer ``quest`` selects
in (past its ``dense_layers``, not slid by the model) and each KV head, it reports:

* ``top``: the page holding the most exact attention mass (per query head, then the max over the KV head's group,
  as Quest reduces a group) and that mass; ``*`` when it holds a needle token;
* ``needle``: the needle's pages (the answer's token ids located in the prompt) with their exact mass and their
  rank among the candidate pages by Quest's bound ``sum_d max(q_d min_d, q_d max_d)`` and by the exact
  ``max_t q . k_t`` over the page (1 = first; both reduced over the group by softmax then max, as the policy does);
* ``sel``: the pages Quest selects at ``--budget`` (its budget rule: sinks, pages, dense tail);
* ``quest`` / ``topk``: the attention mass (mean over the group's query heads) on the tokens Quest attends and on
  the ``--budget`` tokens ``exact_topk`` attends.

The bound is computed with the policy's own pieces (``PageStats`` for the page min / max, ``kernels.quest_scores``
for the bound), so it is what the policy ranks; tests/evals/test_quest_page_bounds.py checks the selection equals
``QuestLayer.select`` on a tiny random model. Queries are recorded as the cache receives them
(``PolicyCache.attend``), i.e. post-RoPE, as the policy sees them.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

import torch

from kvpress.evals.decode import decode_from_cache
from kvpress.evals.models import load_eval_model
from kvpress.evals.tasks import build_input_ids, get_task
from kvpress.kernels import exact_scores, quest_scores
from kvpress.kernels.scores import reduce_over_group
from kvpress.policies._quest_pages import PageStats
from kvpress.policy_cache import PolicyCache
from kvpress.prefill import dense_prefill
from kvpress.registry import get_policy
from kvpress.window_layers import SlidingWindowLayer


@contextmanager
def recording_queries(record: dict):
    """Append each forward's last query ``(q [B, H_q, D], scaling)`` per layer to ``record[layer_idx]``
    (layers the model slides are left out)."""
    original = PolicyCache.attend

    def attend(self, layer, q, k_new, v_new, scaling):
        if not isinstance(layer, SlidingWindowLayer):
            record.setdefault(layer.layer_idx, []).append((q[:, :, -1].detach().clone(), scaling))
        return original(self, layer, q, k_new, v_new, scaling)

    PolicyCache.attend = attend
    try:
        yield record
    finally:
        PolicyCache.attend = original


def quest_selection(q: torch.Tensor, keys: torch.Tensor, scaling: float, policy) -> tuple[torch.Tensor, int, int]:
    """Quest's decode-step choice for one unpadded row of ``keys`` [1, H_kv, n, D] (the current token's key
    last) and query ``q`` [1, H_q, D]: ``(bound (H_kv, hi - lo), lo, hi)`` over candidate pages ``[lo, hi)``.

    The policy's budget rule: pages inside ``[sink_tokens, n - dense_tail)``, of which it attends the top
    ``policy.selected_pages``; the page min / max come from `PageStats`, the bound from `quest_scores`."""
    size, n = policy.page_size, keys.shape[2]
    stats = PageStats(size)
    stats.append(keys, None, 0, None)
    lo, hi = policy.sink_tokens // size, (n - policy.dense_tail) // size
    bound = quest_scores(q, stats.page_min[:, :, lo:hi], stats.page_max[:, :, lo:hi], scale=scaling,
                         reduction=policy.score_reduction)
    return bound[0], lo, hi


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry of ``scores`` (H, P) along its row, 1 = highest."""
    order = scores.argsort(dim=-1, descending=True)
    out = torch.empty_like(order)
    out.scatter_(-1, order, torch.arange(1, scores.shape[-1] + 1).expand_as(order).contiguous())
    return out


def find_span(ids: list[int], tokenizer, answer: str) -> tuple[int, int]:
    """``[start, end)`` token span of ``answer`` in ``ids``: its token ids (alone or after a space, the first
    one dropped when the context merges it) found in the prompt. Raises ValueError when absent."""
    for text in (answer, " " + answer):
        enc = tokenizer.encode(text, add_special_tokens=False)
        for cut in (0, 1):
            core = enc[cut:]
            if len(core) < 2 and cut:
                continue
            for i in range(len(ids) - len(core) + 1):
                if ids[i:i + len(core)] == core:
                    return i - cut, i + len(core)
    raise ValueError(f"the answer {answer!r} was not found among the prompt's token ids")


def answer_step(tokenizer, tokens: list[int]) -> int:
    """Index of the first generated token that emits more than spaces and punctuation (the last one if none)."""
    for j in range(len(tokens)):
        if tokenizer.decode(tokens[:j + 1]).lstrip(" :\n\"'*"):
            return j
    return len(tokens) - 1


@torch.no_grad()
def page_report(q: torch.Tensor, keys: torch.Tensor, scaling: float, quest, topk, needle: tuple[int, int]) -> list:
    """One dict per KV head for query ``q`` [1, H_q, D] over ``keys`` [1, H_kv, n, D]."""
    H, n = keys.shape[1], keys.shape[2]
    G, size = q.shape[1] // H, quest.page_size
    qk = torch.einsum("hd,htd->ht", q[0].float(), keys[0].float().repeat_interleave(G, 0)) * scaling  # (H_q, n)
    probs = torch.softmax(qk, dim=-1)
    P = -(-n // size)
    pad = P * size - n
    page_mass = torch.nn.functional.pad(probs, (0, pad)).view(-1, P, size).sum(-1)  # (H_q, P)
    group_mass = page_mass.view(H, G, P).amax(1)  # (H, P)
    bound, lo, hi = quest_selection(q, keys, scaling, quest)
    page_max = torch.nn.functional.pad(qk, (0, pad), value=float("-inf")).view(-1, P, size).amax(-1)  # (H_q, P)
    exact = reduce_over_group(page_max[None, :, lo:hi], H, reduction=quest.score_reduction)[0]  # (H, hi - lo)
    bound_rank, exact_rank = ranks(bound), ranks(exact)
    chosen = bound.topk(quest.selected_pages, dim=-1).indices + lo  # (H, pages)
    # exact_topk's tokens: sinks, window, the best by exact score in between
    s, w = topk.sink_tokens, topk.window_size
    tok = exact_scores(q, keys[:, :, s:n - w], scale=scaling, reduction=topk.group_reduction)[0]  # (H, n - s - w)
    best = tok.topk(min(topk.budget - s - w, tok.shape[-1]), dim=-1).indices + s
    first, last = needle[0] // size, (needle[1] - 1) // size
    rows = []
    for h in range(H):
        quest_mask = torch.zeros(n, dtype=torch.bool)
        quest_mask[:quest.sink_tokens] = True
        quest_mask[n - quest.dense_tail:] = True
        for page in chosen[h].tolist():
            quest_mask[page * size:(page + 1) * size] = True
        topk_mask = torch.zeros(n, dtype=torch.bool)
        topk_mask[:s] = True
        topk_mask[n - w:] = True
        topk_mask[best[h]] = True
        heads = probs[h * G:(h + 1) * G]
        top = int(group_mass[h].argmax())
        needle_pages = []
        for page in range(first, last + 1):
            inside = lo <= page < hi
            needle_pages.append({
                "page": page, "mass": float(group_mass[h, page]),
                "bound_rank": int(bound_rank[h, page - lo]) if inside else None,
                "exact_rank": int(exact_rank[h, page - lo]) if inside else None,
                "selected": bool((chosen[h] == page).any())})
        rows.append({"head": h, "top_page": top, "top_mass": float(group_mass[h, top]),
                     "top_is_needle": first <= top <= last, "needle": needle_pages, "candidates": hi - lo,
                     "selected": quest.selected_pages,
                     "quest_mass": float((heads * quest_mask).sum(-1).mean()),
                     "topk_mass": float((heads * topk_mask).sum(-1).mean())})
    return rows


def run_full(model, tokenizer, sample, max_new_tokens: int = 12) -> dict:
    """Prefill ``sample`` under ``full`` and decode it greedily: its ids, the needle span, the generated tokens,
    the recorded queries ``{layer: [(q, scaling) per forward]}`` and each recorded layer's keys [1, H_kv, n, D]."""
    ids = build_input_ids(tokenizer, sample)
    span = find_span(ids, tokenizer, sample.answers[0])
    record: dict = {}
    with recording_queries(record):
        logits, cache = dense_prefill(model, torch.tensor([ids], device=model.device))
        tokens, _ = decode_from_cache(model, cache.policy, cache, logits, len(ids), max_new_tokens=max_new_tokens)
    keys = {i: cache.layers[i].buffer.keys.cpu() for i in record}
    record = {i: [(q.cpu(), s) for q, s in qs] for i, qs in record.items()}
    return {"ids": ids, "span": span, "tokens": tokens, "record": record, "keys": keys}


def diagnose(run: dict, tokenizer, budget: int, page_sizes: list[int]) -> list[dict]:
    """Rows for one `run_full` result: the prompt's last query and the answer's first token's, every Quest
    layer and KV head, each of ``page_sizes``."""
    ids, span, record = run["ids"], run["span"], run["record"]
    step = answer_step(tokenizer, run["tokens"])
    topk = get_policy("exact_topk", budget=budget)
    out = []
    for size in page_sizes:
        quest = get_policy("quest", budget=budget, page_size=size)
        for layer_idx in sorted(record):
            if layer_idx < quest.dense_layers:
                continue
            keys_all = run["keys"][layer_idx]
            for label, j in (("prompt", 0), ("answer", step)):
                q, scaling = record[layer_idx][j]
                n = len(ids) + j
                for row in page_report(q, keys_all[:, :, :n], scaling, quest, topk, span):
                    out.append({"page_size": size, "layer": layer_idx, "query": label, "step": j, **row})
    return out


def _needle_cell(pages: list[dict], key: str) -> str:
    return "/".join("-" if p[key] is None else (f"{p[key]:.2f}" if isinstance(p[key], float) else str(p[key]))
                    for p in pages)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=8, help="samples the task generates (as `kvpress eval --samples`)")
    ap.add_argument("--sample-ids", default="0", help="which of them, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--page-sizes", default="16", help="Quest page sizes to compare on the same prefill")
    ap.add_argument("--keep", default=None, help="folder keeping each sample's prefill (queries, keys) for reruns")
    args = ap.parse_args(argv)
    sample_ids = [int(s) for s in args.sample_ids.split(",")]
    page_sizes = [int(s) for s in args.page_sizes.split(",")]
    if any(not 0 <= s < args.samples for s in sample_ids):
        raise SystemExit(f"--sample-ids must lie in [0, {args.samples}) (--samples {args.samples})")
    model, tokenizer = load_eval_model(args.model)
    samples = get_task(args.task).generate(tokenizer, args.length, args.samples, args.seed)
    everything = []
    for sid in sample_ids:
        path = None if args.keep is None else Path(args.keep) / f"{args.model}-{args.task}-{args.length}-{sid}.pt"
        if path is not None and path.exists():
            run = torch.load(path)
        else:
            run = run_full(model, tokenizer, samples[sid])
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(run, path)
        rows = diagnose(run, tokenizer, args.budget, page_sizes)
        span, text = run["span"], tokenizer.decode(run["tokens"])
        print(f"\n{args.task} sample {sid}, {args.length} tokens, answer {samples[sid].answers[0]!r} at tokens "
              f"[{span[0]}, {span[1]}); full generates {text[:40]!r}; budget {args.budget}")
        print("| page | layer | query | head | top page (mass) | needle pages | needle mass | bound rank "
              "| exact rank | selected | sel/cand | quest mass | topk mass |")
        print("|---:|---:|---|---:|---|---|---|---|---|---|---|---:|---:|")
        for r in rows:
            pages = r["needle"]
            print(f"| {r['page_size']} | {r['layer']} | {r['query']}@{r['step']} | {r['head']} | "
                  f"{r['top_page']}{'*' if r['top_is_needle'] else ''} ({r['top_mass']:.2f}) | "
                  f"{'/'.join(str(p['page']) for p in pages)} | {_needle_cell(pages, 'mass')} | "
                  f"{_needle_cell(pages, 'bound_rank')} | {_needle_cell(pages, 'exact_rank')} | "
                  f"{'/'.join('y' if p['selected'] else 'n' for p in pages)} | {r['selected']}/{r['candidates']} | "
                  f"{r['quest_mass']:.3f} | {r['topk_mass']:.3f} |")
        everything += [{"sample": sid, **r} for r in rows]
    return everything


if __name__ == "__main__":
    main()
