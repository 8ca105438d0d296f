"""``tidal``: TidalDecode — a few full-attention layers select tokens that every other layer reuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.calibration import register_calibrator
from kvpress.kernels import SparseIndex, exact_scores
from kvpress.layers import DenseLayer
from kvpress.policies._sparse import (SelectiveLayer, check_budget, check_selection, static_token_split,
                                      token_topk_index, topk_mask)
from kvpress.policies._tidal_artifact import (ARTIFACT_VERSION, artifact_name, measured_layers,  # noqa: F401
                                              check_layers, selection_layers)  # (re-exported: the artifact's names)
from kvpress.registry import Policy, check_tokens, register_policy


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
    Attention", arXiv 2410.05076. Layers before the selection layer attend densely. At each decode
    step the selection layer runs full attention and keeps the top tokens per KV head by its own
    probabilities (GQA group reduced by ``score_reduction``, default softmax-then-max); the later
    layers attend only those (``sparse_decode``; a static step as masks over the capacity), except the
    re-selection layer, which selects again for the layers after it. The whole cache stays resident.

    ``budget`` (256): tokens per KV head in the sparse layers: ``sink_tokens`` (0) first tokens,
    ``recent_tokens`` (1, the current token at least) latest and the top rest in between.
    ``selection_layer`` / ``reselection_layer`` (None: the pair ``kvpress calibrate tidal`` measured
    and shipped for the model, the one whose selections best keep the sparse layers' attention mass,
    geometric mean over heads: layers 3 and 15 on SmolLM2-135M; unmeasured, the paper's layer 2 and the
    middle layer, with a warning; ``reselection_layer=-1``: none; an explicit ``selection_layer`` takes
    the measured re-selection layer only if measured for it). ``shared_selection`` (False: the paper's
    per-head reuse) gives every KV head the tokens any head ranks highest. ``tail_chunk`` (0) adds the
    chunk-mean estimate of the tokens left out (see ``exact_topk``).

    Measured on SmolLM2-135M (BENCHMARKS.md "Selection and eviction at budgets 128-1024" and
    "Query-aware decode on CPU"), whose layers share their needs less than the paper's 8B models:
    at 4k (32 niah_single samples) it keeps 19 / 34 / 53 / 75% of ``full``'s needles at budgets
    128 / 256 / 512 / 1024 where ``exact_topk`` keeps 97 / 100 / 100 / 100% (the loss is the reuse),
    ``shared_selection`` 62 / 72 / 84 / 97%. At 8k (24 samples) it answers 1 of ``full``'s 13, shared
    or not, with or without ``tail_chunk`` (the first digits right, then the number breaks off). CPU
    decode (8k, budget 256): ~1.6x ``full``'s speed, attention ~3x. On an H100 (random Llama-3-8B
    shape, 32k, budget 1024) the kernel reads the budget 7.8x / 22x faster than SDPA at batch 1 / 8,
    but a step is host-bound (~75 µs a Triton launch): 97.3 vs 79.4 ms/token for ``full``. On Gemma
    3 270M (its 3 global layers: 5 selects, 11 selects again, 17 reuses) it answers all 63 of
    ``full``'s answers at 16k tokens at budgets 512, 1024 and 2048 (32 samples each of niah_single
    and its UUID variant), as ``exact_topk`` does (BENCHMARKS.md "Gemma 3 270M at 16k tokens" and
    "... the selecting policies at budgets 512, 1024 and 2048").
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
    """A sparse layer: selects (full attention + top-k) or reuses the step's selection (``cache.step_shared``:
    an index per sequence length eagerly, a verification running as steps; a mask in a static step)."""

    def __init__(self, cache, layer_idx: int, policy: TidalPolicy, selects: bool):
        super().__init__(cache, layer_idx, policy.budget, policy.tail_chunk)
        self.policy = policy
        self.selects = selects

    def select(self, q, scaling):
        return self._shared(self.cache.step_shared.get("tidal_index", {}).get(self.seen))

    def static_select(self, q, scaling):
        return self._shared(self.cache.step_shared.get("tidal_static"))

    def _shared(self, selection):
        if selection is None:
            raise RuntimeError(f"tidal layer {self.layer_idx} has no selection for this step: the selection "
                               "layer must run first in the same forward")
        return selection

    def decode_step(self, q, scaling):
        if not self.selects:
            return super().decode_step(q, scaling)
        out, index = self._attend_and_select(q[:, :, 0], scaling)
        if self.seen - 1 == self.forward_start or "tidal_index" not in self.cache.step_shared:
            self.cache.step_shared["tidal_index"] = {}  # a new forward: the earlier ones' steps are done
        self.cache.step_shared["tidal_index"][self.seen] = index
        return out[:, :, None]

    def static_attend_step(self, q, scaling):
        """The selection layer over the whole capacity: full attention, and its choice as a mask
        (B, H_kv, C); a row the budget covers chooses every candidate, as the eager step attends densely."""
        if not self.selects:
            return super().static_attend_step(q, scaling)
        p, keys = self.policy, self.buffer.k  # (B, H_kv, C, D)
        real, always, candidates = static_token_split(keys.shape[2], self.cache.plan.end, self.row_start, q.shape[0],
                                                      q.device, sinks=p.sink_tokens, recent=p.recent_tokens)
        out, probs = full_attention(q[:, :, 0], keys, self.buffer.v, scaling, ~real)
        scores = self._scores(probs, candidates, q[:, :, 0], keys, scaling)
        chosen = topk_mask(scores, p.budget - p.sink_tokens - p.recent_tokens, candidates)
        self.cache.step_shared["tidal_static"] = always[:, None, :] | chosen
        return out[:, :, None]

    def _attend_and_select(self, q: torch.Tensor, scaling: float) -> tuple[torch.Tensor, SparseIndex]:
        """Full attention of q [B, H_q, D] -> [B, H_q, D], and the top tokens per KV head (unpadded:
        scored over the one candidate range every row shares, `token_topk_index`'s hot path)."""
        p, keys, row_start = self.policy, self.buffer.keys, self.row_start  # keys (B, H_kv, T, D)
        hidden = None if row_start is None else torch.arange(self.seen, device=q.device)[None, :] < row_start[:, None]
        out, probs = full_attention(q, keys, self.buffer.values, scaling, hidden)

        def scores_for(lo, hi, mask):
            return self._scores(probs[..., lo:hi], mask, q, keys[:, :, lo:hi], scaling)

        return out, token_topk_index(scores_for, q.shape[0], self.seen, row_start, q.device,
                                     keep=p.budget - p.sink_tokens - p.recent_tokens, sinks=p.sink_tokens,
                                     window=p.recent_tokens)

    def _scores(self, probs: torch.Tensor, candidates: torch.Tensor | None, q: torch.Tensor, keys: torch.Tensor,
                scaling: float) -> torch.Tensor:
        """Selection scores (B, H_kv, T) of keys (B, H_kv, T, D) whose attention ``probs`` (B, H_kv, G, T)
        just ran, ``-inf`` off the ``candidates`` (bool (B, T); None: all). ``softmax_max`` renormalises
        these probabilities over the candidates, max over the GQA group (``q . k`` runs once a step); other
        reductions score through `exact_scores`. ``shared_selection``: each token's best over the KV heads."""
        p = self.policy
        if p.score_reduction != "softmax_max":
            scores = exact_scores(q, keys, scale=scaling, reduction=p.score_reduction, mask=candidates)
        else:
            cand = None if candidates is None else candidates[:, None, None, :]
            mass = (probs if cand is None else probs * cand).sum(-1, keepdim=True)
            scores = probs / mass.clamp(min=torch.finfo(torch.float32).tiny)
            scores = (scores if cand is None else scores.masked_fill(~cand, float("-inf"))).amax(dim=2)
        return scores.amax(dim=1, keepdim=True).expand_as(scores) if p.shared_selection else scores


register_calibrator("tidal", "measure TidalDecode's re-selection layer for a model (selection overlap)",
                    "kvpress.evals.tidal_layers:configure", "kvpress.evals.tidal_layers:run")
