"""``quest``: query-aware page selection from per-page key bounds (Quest)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.kernels import ALLOWED_BLOCK_SIZES, SparseIndex, quest_scores
from kvpress.layers import DenseLayer
from kvpress.policies._quest_pages import PageStats
from kvpress.policies._sparse import (SelectiveLayer, check_budget, check_selection, page_index, range_topk_index,
                                      select_pages, static_slots, topk_mask)
from kvpress.registry import MAX_LAYERS, Policy, check_choice, check_int, register_policy


@register_policy
@dataclass(frozen=True)
class QuestPolicy(Policy):
    """Quest: attend only the pages whose key bounds promise the largest scores.

    Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
    arXiv 2406.10774. The cache is split into pages of ``page_size`` tokens; each page keeps the
    element-wise min and max of its post-RoPE keys (updated incrementally as tokens arrive).
    At each decode step, ``sum_d max(q_d * min_d, q_d * max_d)`` upper-bounds ``q . k`` over the
    page; the top pages per KV head (GQA group reduced by softmax-then-max) are attended
    exactly through ``kvpress.kernels.sparse_decode`` (a static decode step: the same choice as masks over
    the capacity, `kvpress.plan`). The whole cache stays resident.

    Budget (tokens attended per KV head, all counted): ``sink_tokens`` first tokens, a dense
    tail of the most recent ``budget - sink_tokens - pages * page_size`` tokens (at least one
    page, so the current, partial page is always attended, as in the paper) and ``pages``
    selected pages in between. The first ``dense_layers`` layers attend densely (the paper
    leaves its first two layers dense). Prefill is plain causal attention.

    Measured limit (SmolLM2-135M, 4k needles): the bound is loose for this model's retrieval
    heads -- their queries weigh channels whose keys vary widely from token to token, so a page's
    per-channel min/max bound barely depends on whether it holds the needle. One layer-18 head
    putting 91% of its attention on a needle token ranks that page 135th of 255 by its bound.
    Ranking the same pages by their exact ``max q . k`` instead (same budget, index and kernel)
    answers 4 of 4 niah_single samples at budget 256, the bound 1 of 4: the page bookkeeping is
    exact, the loss is the bound's (see tests/policies/test_quest.py for the planted-page checks).
    Over 32 niah_single samples at 4k it keeps 3 / 9 / 34 / 72% of ``full``'s needles at budgets
    128 / 256 / 512 / 1024, where ``exact_topk`` (the same budgets filled by exact token scores)
    keeps 97 / 100 / 100 / 100%. With 8-token pages (``page_size=8``, a tighter bound) 13 of 32
    at budget 256 (41%; BENCHMARKS.md "Selection and eviction at budgets 128-1024").
    At 8192 tokens (24 niah_single samples) it answers 1 needle to full's 13. On Gemma 3 270M (16k,
    its global layers 5, 11, 17) it answers 27 / 40 / 53 of ``full``'s 63 needles at budget 512 /
    1024 / 2048 on 32 samples per task, where ``exact_topk`` answers all 63 at each: again the
    bound. At the answer's first token the needle's page ranks 3rd-4th by exact ``max q . k`` in the
    retrieving layer 11 but 124th and 201st of ~1020 by the bound (63 pages fit), and 8-token pages
    do not fix it (``benchmarks/quest_page_bounds.py``; BENCHMARKS.md "Why `quest` loses needles on
    Gemma 3 270M at 16k").

    Decode speed (SmolLM2, 8k, budget 256, CPU): ~1.6x ``full`` end to end, the attention part
    ~3x (``kvpress bench --interleave``; BENCHMARKS.md "Query-aware decode on CPU" has the current run).
    On a GPU (H100, random-weight Llama-3-8B shape, 32k, budget 1024): the
    decode kernel reads the budget 7.8x (batch 1) / 22x (batch 8) faster than dense SDPA, but a
    whole decode step there is host-bound (Python and ~75 µs per Triton launch per layer), so
    end to end it is not faster than ``full`` yet (sync-timed attention 39.6 vs 44.5 ms/token
    for quest; unsynchronised steps 85-90 vs 44-45 ms).

    ``tail_chunk`` (off by default) adds the chunk-mean estimate of the pages left out (see
    ``exact_topk``); it does not bring back what the bound misses: it keeps 1 of ``full``'s 13 needles
    at 8k / 256, since a needle diluted in a chunk mean is not retrieved.
    """

    budget: int = 256
    page_size: int = 16
    dense_layers: int = 2
    sink_tokens: int = 0
    score_reduction: str = "softmax_max"
    tail_chunk: int = 0

    name = "quest"
    description = "query-aware page selection by per-page key min/max bounds (Quest)"
    paper = "arXiv 2406.10774"
    full_prefill = True
    keeps_full_cache = True
    croppable = True

    def validate(self):
        check_selection(self, "score_reduction")
        check_choice("page_size", self.page_size, ALLOWED_BLOCK_SIZES)
        check_int("dense_layers", self.dense_layers, 0, MAX_LAYERS)
        if self.sink_tokens % self.page_size:
            raise ValueError(f"sink_tokens={self.sink_tokens} must be a multiple of page_size={self.page_size} "
                             "(so selected pages never straddle the sinks and the budget is exact)")
        check_budget(self.budget, self.sink_tokens + self.page_size,
                     f"sink_tokens={self.sink_tokens} + the current page of {self.page_size}")

    def check_model(self, adapter):
        check_int("dense_layers", self.dense_layers, 0, adapter.num_layers)

    @property
    def selected_pages(self) -> int:
        """Pages chosen per step between the sinks and the dense tail."""
        return (self.budget - self.sink_tokens - self.page_size) // self.page_size

    @property
    def dense_tail(self) -> int:
        """Most recent tokens always attended (the current page plus the budget's remainder)."""
        return self.budget - self.sink_tokens - self.selected_pages * self.page_size

    def make_layer(self, cache, layer_idx):
        if layer_idx < self.dense_layers:
            return DenseLayer(cache, layer_idx)
        return QuestLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(budget=24, page_size=8, dense_layers=1)


class QuestLayer(SelectiveLayer):
    """Dense K/V plus incrementally maintained page bounds; decode attends the top pages."""

    def __init__(self, cache, layer_idx: int, policy: QuestPolicy):
        super().__init__(cache, layer_idx, policy.budget, policy.tail_chunk)
        self.policy = policy
        self.pages = PageStats(policy.page_size)
        self.metadata.append(self.pages)

    def select(self, q, scaling):
        p = self.policy
        size = p.page_size
        if self.row_start is None and p.selected_pages > 0:
            lo, hi = p.sink_tokens // size, (self.seen - p.dense_tail) // size  # whole pages in [sinks, tail)
            if hi - lo >= p.selected_pages:  # no padding, every row longer than the budget
                return self._select_unpadded(q, scaling, lo, hi)
        return self._select_masked(q, scaling)

    def _page_scores(self, q: torch.Tensor, scaling: float, lengths: torch.Tensor, num_pages: int):
        """``(scores, candidates, covered, k)`` of the first ``num_pages`` pages, for rows of
        ``lengths`` [B] real tokens: bounds (B, H_kv, P), candidate pages (B, P), rows the budget
        covers (B,) and the pages a covered row selects.

        A row longer than the budget selects whole pages inside [sinks, tail_start), so each
        selected page adds exactly page_size tokens; a row the budget covers (in a batch with
        longer rows) selects every page that reaches into that range, i.e. everything."""
        p = self.policy
        size = p.page_size
        j = torch.arange(num_pages, device=q.device)[None, :]  # (1, P) relative page ids
        tail_start = (lengths - p.dense_tail)[:, None]  # (B, 1) relative
        inside = (j * size >= p.sink_tokens) & ((j + 1) * size <= tail_start)
        touching = ((j + 1) * size > p.sink_tokens) & (j * size < tail_start)
        covered = lengths <= self.budget  # (B,)
        candidates = torch.where(covered[:, None], touching, inside)  # (B, P)
        scores = quest_scores(q, self.pages.page_min[:, :, :num_pages], self.pages.page_max[:, :, :num_pages],
                              scale=scaling, reduction=p.score_reduction, mask=candidates)  # (B, H_kv, P)
        return scores, candidates, covered, max(p.selected_pages, -(-self.budget // size))

    def static_select(self, q, scaling):
        """`_select_masked` over every page of the capacity: the candidates, the covered rows' larger
        page count and the visible tokens come from the plan's device end."""
        p = self.policy
        size, end = p.page_size, self.cache.plan.end
        B, C = q.shape[0], self.buffer.capacity
        num_pages = -(-C // size)
        slot, rel, real = static_slots(C, end, self.row_start, q.device)
        lengths = (end - (0 if self.row_start is None else self.row_start)).expand(B)  # (B,)
        scores, candidates, covered, k = self._page_scores(q, scaling, lengths, num_pages)
        chosen = topk_mask(scores, k, candidates, torch.where(covered, k, p.selected_pages))  # (B, H_kv, P)
        page = (rel.clamp(min=0) // size).clamp(max=num_pages - 1).expand(B, C)  # (B, C) each slot's page
        in_chosen = torch.gather(chosen, 2, page[:, None, :].expand(chosen.shape[0], chosen.shape[1], C))
        always = (rel < p.sink_tokens) | (slot[None, :] >= end - p.dense_tail)
        return real[:, None, :] & (always[:, None, :] | in_chosen)  # (B, H_kv, C)

    def _select_masked(self, q: torch.Tensor, scaling: float) -> SparseIndex:
        """General path: per-row candidate pages as a mask (left padding, rows the budget covers)."""
        p = self.policy
        num_pages = -(-(self.seen - self.min_row_start()) // p.page_size)
        scores, candidates, covered, k = self._page_scores(q, scaling, self.lengths(), num_pages)
        if bool(covered.any()):
            ids, count = select_pages(scores, k, candidates, torch.where(covered, k, p.selected_pages))
        else:
            ids, count = select_pages(scores, p.selected_pages, candidates)
        return page_index(ids, count, p.page_size, self.seen, self.row_start, sinks=p.sink_tokens,
                          dense_tail=p.dense_tail)

    def _select_unpadded(self, q: torch.Tensor, scaling: float, lo: int, hi: int) -> SparseIndex:
        """The decode hot path: every row's candidates are pages ``[lo, hi)``, so only those are scored.

        Same selection as the general path (tests compare them) in ~10 torch calls instead of
        ~40, which matters on CPU where each costs microseconds once the model's MLP has evicted
        the caches: the bound is two batched matmuls over views of the page min / max (scale
        folded into the softmax), top-k without masks, page ids straight to int32 and a trusted
        ``id_range`` so the kernel does not read them.
        """
        p = self.policy
        B, H_q, D = q.shape
        H, n = self.pages.page_min.shape[1], hi - lo
        mn, mx = self.pages.page_min[:, :, lo:hi], self.pages.page_max[:, :, lo:hi]  # (B, H, n, D) views
        if p.score_reduction == "softmax_max" and q.dtype == mn.dtype == torch.float32:
            qg = q.reshape(B * H, H_q // H, D)
            s = torch.bmm(qg.clamp(min=0), mx.reshape(B * H, n, D).transpose(1, 2))  # (B * H, G, n)
            s = torch.baddbmm(s, qg.clamp(max=0), mn.reshape(B * H, n, D).transpose(1, 2))
            scores = torch.softmax(s.mul_(scaling), dim=-1).amax(1).view(B, H, n)
        else:
            scores = quest_scores(q, mn, mx, scale=scaling, reduction=p.score_reduction)
        return range_topk_index(scores, p.selected_pages, lo, self.seen, block_size=p.page_size,
                                sinks=p.sink_tokens, dense_tail=p.dense_tail)
