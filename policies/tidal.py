"""``tidal``: TidalDecode — a few full-attention layers select tokens that every other layer reuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.calibration import register_calibrator
from kvpress.kernels import SparseIndex, exact_scores
from kvpress.layers import DenseLayer
from kvpress.policies._sparse import (SelectiveLayer, check_budget, check_selection, range_topk_index, select_pages,
                                      static_token_split, topk_mask)
from kvpress.policies._tidal_artifact import (ARTIFACT_VERSION, artifact_name, measured_layers,  # noqa: F401
                                              check_layers, selection_layers)  # (re-exported: the artifact's names)
from kvpress.registry import Policy, check_tokens, register_policy


def selection_scores(probs: torch.Tensor, candidates: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                     scaling: float, reduction: str) -> torch.Tensor:
    """Selection scores (B, H_kv, T) of a selection layer whose attention ``probs`` (B, H_kv, G, T)
    just ran: ``softmax_max`` renormalises the probabilities over the ``candidates`` (bool (B, T)) and
    takes the max over the GQA group; other reductions score through `exact_scores`. Non-candidates
    are ``-inf``."""
    if reduction == "softmax_max":
        cand = candidates[:, None, None, :]
        mass = (probs * cand).sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        return (probs / mass).masked_fill(~cand, float("-inf")).amax(dim=2)
    return exact_scores(q, keys, scale=scaling, reduction=reduction, mask=candidates)


def full_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                   hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection layer's exact attention of one query per head q [B, H_q, D] over keys / values
    [B, H_kv, T, D] but the slots ``hidden`` (bool (B or 1, T), or None): the output [B, H_q, D] and
    the probabilities (B, H_kv, G, T) fp32 that the selection reuses."""
    B, H_q, D = q.shape
    H_kv = keys.shape[1]
    logits = (q.reshape(B, H_kv, H_q // H_kv, D).to(keys.dtype) @ keys.transpose(-1, -2)).float() * scaling
    if hidden is not None:
        logits = logits.masked_fill(hidden[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, H_kv, G, T)
    return (probs.to(values.dtype) @ values).reshape(B, H_q, D).to(q.dtype), probs


@register_policy
@dataclass(frozen=True)
class TidalPolicy(Policy):
    """TidalDecode: position-persistent sparse attention.

    Yang et al., "TidalDecode: Fast and Accurate LLM Decoding with Position Persistent Sparse
    Attention", arXiv 2410.05076. Layers before the selection layer attend densely. At each
    decode step the selection layer runs full attention and takes the top tokens per KV head
    (exact ``q . k`` scores, GQA group reduced by ``score_reduction``, default softmax-then-max);
    the following layers attend only those tokens through ``kvpress.kernels.sparse_decode``,
    except the re-selection layer, which runs full attention again and refreshes the selection
    for the layers after it.

    Which layers select is measured, not hard-coded: ``selection_layer=None`` and
    ``reselection_layer=None`` (the defaults) take the pair that ``kvpress calibrate tidal``
    (``python -m kvpress.evals.tidal_layers``) measured for the model and shipped under
    ``policies/artifacts/`` -- the pair whose selections best keep the sparse layers' attention
    mass on calibration text, scored by the geometric mean over heads so that a retrieval head
    losing its few tokens counts (SmolLM2-135M: layers 3 and 15). A model without a measurement
    uses the paper's layer 2 and its middle layer, with a warning. ``reselection_layer=-1``
    disables re-selection; an explicit ``selection_layer`` uses the measured re-selection layer
    only if it was measured for that selection layer.

    ``shared_selection=True`` gives every KV head of the sparse layers the same tokens: those any
    head of the selection layer ranks highest. The default (False) is the paper's per-head reuse:
    KV head ``h`` of a later layer attends what KV head ``h`` of the selection layer chose, although
    the two share only an index. On SmolLM2 (3 KV heads, 32 niah_single samples at 4k) sharing keeps
    62 / 72 / 84 / 97% of ``full``'s needles at budgets 128 / 256 / 512 / 1024; at 8k and budget 256
    it answers 1 of ``full``'s 13 needles, as the default does.

    The decode step is static (one ``torch.compile`` graph, `kvpress.plan`): the selection layer
    attends and selects over the preallocated capacity and hands the reusing layers its choice as
    a mask (``cache.step_shared``).

    Budget (tokens attended per KV head in the sparse layers, all counted): ``sink_tokens`` first
    tokens, ``recent_tokens`` most recent (the current token at least) and the top
    ``budget - sink_tokens - recent_tokens`` tokens in between. The whole cache stays resident;
    prefill is plain causal attention.

    Measured on SmolLM2-135M (BENCHMARKS.md "Selection and eviction at budgets 128-1024" and
    "Query-aware decode on CPU"): this model's layers share their needs less than the paper's 8B
    models do. Over 32 niah_single samples at 4k it keeps 19 / 34 / 53 / 75% of ``full``'s needles
    at budgets 128 / 256 / 512 / 1024, where ``exact_topk`` (every layer selecting its own tokens
    by exact scores) keeps 97 / 100 / 100 / 100%: the loss is the reuse itself. At 8192 tokens (24
    samples) it answers 1 needle to ``full``'s 13, with or without ``tail_chunk``: the first digits
    come out right and the number then breaks off or goes astray. Decode on CPU (8k, budget 256)
    runs at ~1.6x ``full``'s speed end to end, the attention part ~3x. On a GPU (H100, random-weight
    Llama-3-8B shape, 32k, budget 1024) the kernel reads the budget 7.8x (batch 1) / 22x (batch 8)
    faster than dense SDPA, but a decode step is host-bound (Python and ~75 µs per Triton launch
    per layer): 97.3 vs 79.4 ms/token for ``full`` (per-layer attention timer).

    On Gemma 3 270M, whose 3 global layers are the only ones it acts on (layer 5 selects, 11
    selects again, 17 reuses), it answers 8 of ``full``'s 8 at 16k tokens and budget 1024 (samples
    0-3 of niah_single and its UUID variant), as ``exact_topk`` does: there the reuse costs no
    answer at that budget (BENCHMARKS.md "Gemma 3 270M at 16k tokens").

    ``tail_chunk`` (off by default) adds the chunk-mean estimate of the tokens left out in the
    reusing layers (see ``exact_topk``).
    """

    budget: int = 256
    selection_layer: int | None = None
    reselection_layer: int | None = None
    sink_tokens: int = 0
    recent_tokens: int = 1
    score_reduction: str = "softmax_max"
    shared_selection: bool = False
    tail_chunk: int = 0

    name = "tidal"
    description = "full-attention layers pick top tokens reused by the others (TidalDecode)"
    paper = "arXiv 2410.05076"
    full_prefill = True
    keeps_full_cache = True
    croppable = True

    def validate(self):
        check_selection(self, "score_reduction")
        check_layers(self.selection_layer, self.reselection_layer)
        check_tokens("recent_tokens", self.recent_tokens, 1)
        check_budget(self.budget, self.sink_tokens + self.recent_tokens,
                     f"sink_tokens={self.sink_tokens} + recent_tokens={self.recent_tokens}")

    def check_model(self, adapter):
        check_layers(self.selection_layer, self.reselection_layer, adapter)

    def layers_for(self, adapter, warn: bool = True) -> tuple[int, int | None]:
        """``(selection_layer, reselection_layer)`` for ``adapter``'s model (None: no re-selection)."""
        return selection_layers(self.selection_layer, self.reselection_layer, adapter, warn)

    def make_layer(self, cache, layer_idx):
        selection, reselection = cache.shared.setdefault("tidal_layers", self.layers_for(cache.adapter))
        if layer_idx < selection:
            return DenseLayer(cache, layer_idx)
        return TidalLayer(cache, layer_idx, self, selects=layer_idx in (selection, reselection))

    @classmethod
    def example(cls, adapter):
        # the first full-attention layer selects, the later ones reuse: the sparse path really runs
        return cls(budget=24, selection_layer=adapter.policy_layers[0], reselection_layer=-1, sink_tokens=2,
                   recent_tokens=4)


class TidalLayer(SelectiveLayer):
    """A sparse layer: selects (full attention + top-k) or reuses the selection of the step
    (``cache.step_shared``: per sequence length eagerly, the slots chosen in a static step)."""

    def __init__(self, cache, layer_idx: int, policy: TidalPolicy, selects: bool):
        super().__init__(cache, layer_idx, policy.budget, policy.tail_chunk)
        self.policy = policy
        self.selects = selects

    def decode_step(self, q, scaling):
        # the selection layer's index per step (sequence length) of the current forward: one, or
        # several in a verification the core runs as steps (`PolicyCache.attend`)
        if not self.selects:
            return self.sparse_attend(q, self._shared(self.cache.step_shared.get("tidal_index", {}).get(self.seen)),
                                      scaling)
        out, index = self._attend_and_select(q[:, :, 0], scaling)
        if self.seen - 1 == self.forward_start or "tidal_index" not in self.cache.step_shared:
            self.cache.step_shared["tidal_index"] = {}  # a new forward: the earlier ones' steps are done
        self.cache.step_shared["tidal_index"][self.seen] = index
        return out[:, :, None]

    def static_select(self, q, scaling):
        """The reusing layers attend what this step's selection layer chose."""
        return self._shared(self.cache.step_shared.get("tidal_static"))

    def _shared(self, selection):
        if selection is None:
            raise RuntimeError(f"tidal layer {self.layer_idx} has no selection for this step: the selection "
                               "layer must run first in the same forward")
        return selection

    def static_attend_step(self, q, scaling):
        if not self.selects:
            return super().static_attend_step(q, scaling)
        out, visible = self._static_attend_and_select(q[:, :, 0], scaling)
        self.cache.step_shared["tidal_static"] = visible
        return out[:, :, None]

    def _static_attend_and_select(self, q: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`_attend_and_select` over the whole capacity (a static decode step): full attention of
        q [B, H_q, D] -> [B, H_q, D] and the chosen slots, bool (B, H_kv, C). A row the budget covers
        chooses every candidate, i.e. its reusing layers attend densely, as the eager step does."""
        p = self.policy
        keys = self.buffer.k  # (B, H_kv, C, D)
        real, always, candidates = static_token_split(keys.shape[2], self.cache.plan.end, self.row_start, q.shape[0],
                                                      q.device, sinks=p.sink_tokens, recent=p.recent_tokens)
        out, probs = full_attention(q, keys, self.buffer.v, scaling, ~real)
        scores = selection_scores(probs, candidates, q, keys, scaling, p.score_reduction)
        chosen = topk_mask(self._share(scores), p.budget - p.sink_tokens - p.recent_tokens, candidates)
        return out, always[:, None, :] | chosen

    def _attend_and_select(self, q: torch.Tensor, scaling: float, *, hot_path: bool = True
                           ) -> tuple[torch.Tensor, SparseIndex]:
        """Full attention of q [B, H_q, D] -> [B, H_q, D], and the top tokens per KV head.

        With the default ``softmax_max`` reduction the selection scores are this attention's own
        probabilities (renormalised over the candidates, max over the GQA group), so ``q . k`` is
        computed once per step instead of twice (attention, then `exact_scores`): the selection
        layer costs about one dense layer. Other reductions score through `exact_scores`.
        """
        p = self.policy
        B, T = q.shape[0], self.seen
        keys, row_start = self.buffer.keys, self.row_start  # (B, H_kv, T, D)
        pos = torch.arange(T, device=q.device)[None, :]  # (1, T)
        out, probs = full_attention(q, keys, self.buffer.values, scaling,
                                    None if row_start is None else pos < row_start[:, None])
        keep = p.budget - p.sink_tokens - p.recent_tokens
        lo, hi = p.sink_tokens, T - p.recent_tokens
        if hot_path and row_start is None and p.score_reduction == "softmax_max" and 0 < keep <= hi - lo:
            # hot path (no padding): every row's candidates are [lo, hi), so no masks; same
            # selection as below (tests compare), and a trusted id_range spares the kernel of
            # every reusing layer a read of the ids
            cand = probs[..., lo:hi]
            scores = (cand / cand.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)).amax(dim=2)
            return out, range_topk_index(self._share(scores), keep, lo, T, block_size=1, sinks=p.sink_tokens,
                                         dense_tail=p.recent_tokens)
        first = lo if row_start is None else row_start[:, None] + lo
        candidates = ((pos >= first) & (pos < hi)).expand(B, -1)  # (B, T)
        scores = selection_scores(probs, candidates, q, keys, scaling, p.score_reduction)
        ids, count = select_pages(self._share(scores), keep, candidates)
        lens = torch.full((B,), T, dtype=torch.int32, device=q.device)
        starts = None if row_start is None else row_start.to(torch.int32)
        index = SparseIndex(1, ids.to(torch.int32), count.to(torch.int32), lens, starts, p.sink_tokens, p.recent_tokens)
        return out, index

    def _share(self, scores: torch.Tensor) -> torch.Tensor:
        """``shared_selection``: every KV head gets the best score any head gave a token ``(B, H_kv, T)``."""
        return scores.amax(dim=1, keepdim=True).expand_as(scores) if self.policy.shared_selection else scores


register_calibrator("tidal", "measure TidalDecode's re-selection layer for a model (selection overlap)",
                    "kvpress.evals.tidal_layers:configure", "kvpress.evals.tidal_layers:run")
