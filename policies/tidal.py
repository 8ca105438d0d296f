"""``tidal``: TidalDecode — a few full-attention layers select tokens that every other layer reuses."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from kvpress.calibration import load_artifact, register_calibrator, shipped_artifact
from kvpress.kernels import REDUCTIONS, SparseIndex, exact_scores
from kvpress.layers import DenseLayer
from kvpress.policies._sparse import (SelectiveLayer, check_budget, range_topk_index, select_pages, static_slots,
                                      topk_mask)
from kvpress.policies._tidal_artifact import ARTIFACT_VERSION, artifact_name  # noqa: F401  (re-exported)
from kvpress.registry import MAX_LAYERS, Policy, check_choice, check_int, check_tokens, register_policy

CALIBRATE_COMMAND = "kvpress calibrate tidal --model MODEL"
DEFAULT_SELECTION_LAYER = 2  # the paper's choice, used for a model without a measurement


@functools.lru_cache(maxsize=16)
def measured_layers(model_id: str, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, int] | None:
    """``(selection, reselection)`` measured by ``kvpress calibrate tidal`` for this model, or None.

    ``reselection`` is -1 when the measurement found no re-selection layer worth its cost.
    """
    path = shipped_artifact(artifact_name(model_id))
    if not path.is_file():
        return None
    tensors, meta = load_artifact(path, policy="tidal", version=ARTIFACT_VERSION, required=("layers",))
    if (meta.get("num_layers"), meta.get("num_kv_heads"), meta.get("head_dim")) != (
            str(num_layers), str(num_kv_heads), str(head_dim)):
        return None  # same name, another model shape
    selection, reselection = (int(x) for x in tensors["layers"].tolist())
    if not (0 <= selection < num_layers - 1 and (reselection == -1 or selection < reselection < num_layers)):
        return None
    return selection, reselection


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

    ``shared_selection=True`` gives every KV head of the sparse layers the same tokens: those
    that any head of the selection layer ranks highest (its per-KV-head scores, maxed over the
    heads). The default (False) is the paper's per-head reuse: KV head ``h`` of a later layer
    attends what KV head ``h`` of the selection layer chose, although the two heads share only
    an index. On SmolLM2 (3 KV heads), 32 niah_single samples at 4k, sharing keeps 62 / 72 /
    84 / 97% of ``full``'s needles at budgets 128 / 256 / 512 / 1024 against the default's
    19 / 34 / 53 / 75%, but at 8k and budget 256 it answers 1 of
    ``full``'s 13 needles, as the default does.

    The decode step is static (one ``torch.compile`` graph, `kvpress.plan`): the selection layer
    attends and selects over the preallocated capacity and hands the reusing layers its choice as
    a mask (``cache.step_shared``).

    Budget (tokens attended per KV head in the sparse layers, all counted): ``sink_tokens`` first
    tokens, ``recent_tokens`` most recent (the current token at least) and the top
    ``budget - sink_tokens - recent_tokens`` tokens in between. The whole cache stays resident;
    prefill is plain causal attention.

    Measured limit (SmolLM2-135M, 4k needles, budget 256): the layers' needs persist less across
    layers than in the paper's 8B models. With the measured layers 1 of 4 niah_single samples is
    answered (3 of 4 at budget 1024); letting every layer select its own top tokens instead (same
    budget, GQA reduction, index and kernel) answers 4 of 4, so the loss is the reuse itself.
    Over 32 niah_single samples at 4k: 19 / 34 / 53 / 75% of ``full``'s needles at budgets
    128 / 256 / 512 / 1024, against ``exact_topk``'s 97 / 100 / 100 / 100% (every layer
    selecting by exact scores; ``tidal``'s row in BENCHMARKS.md "Selection and eviction at budgets
    128-1024").
    At 8192 tokens (24 niah_single samples) it answers 1 needle to full's 13: the
    first digits come out right and the number then breaks off or goes astray.

    Decode speed (SmolLM2, 8k, budget 256, CPU): ~1.6x ``full`` end to end, the attention part
    ~3x (``kvpress bench --interleave``; BENCHMARKS.md "Query-aware decode on CPU" has the current run).
    On a GPU (H100, random-weight Llama-3-8B shape, 32k, budget 1024): the
    decode kernel reads the budget 7.8x (batch 1) / 22x (batch 8) faster than dense SDPA, but a
    whole decode step there is host-bound (Python and ~75 µs per Triton launch per layer), so
    end to end it is slower than ``full`` (97.3 vs 79.4 ms/token with the per-layer attention
    timer, attention 60.1 vs 44.5 ms).

    ``tail_chunk`` (off by default) adds the chunk-mean estimate of the tokens left out in the
    reusing layers (see ``exact_topk``); at 8k / 256 it answers 1 of ``full``'s 13 needles:
    the reused selection, not the tail, loses them.
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
        check_tokens("budget", self.budget, 1)
        if self.selection_layer is not None:
            check_int("selection_layer", self.selection_layer, 0, MAX_LAYERS)
        if self.reselection_layer not in (None, -1):
            check_int("reselection_layer", self.reselection_layer,
                      1 if self.selection_layer is None else self.selection_layer + 1, MAX_LAYERS)
        check_tokens("sink_tokens", self.sink_tokens, 0)
        check_tokens("recent_tokens", self.recent_tokens, 1)
        check_choice("score_reduction", self.score_reduction, REDUCTIONS)
        check_tokens("tail_chunk", self.tail_chunk, 0)
        check_budget(self.budget, self.sink_tokens + self.recent_tokens,
                     f"sink_tokens={self.sink_tokens} + recent_tokens={self.recent_tokens}")

    def check_model(self, adapter):
        if self.selection_layer is not None:
            check_int("selection_layer", self.selection_layer, 0, adapter.num_layers - 1)
        selection, reselection = self.layers_for(adapter, warn=False)
        if reselection is not None:
            check_int("reselection_layer", reselection, selection + 1, adapter.num_layers - 1)
        for name, layer in (("selection_layer", selection), ("reselection_layer", reselection)):
            if layer is not None and adapter.sliding_window(layer) is not None:
                raise ValueError(f"{name}={layer} is a sliding-window layer of this model (kept as the model runs "
                                 f"it); a selection layer must be a full-attention layer: {list(adapter.policy_layers)}")

    def layers_for(self, adapter, warn: bool = True) -> tuple[int, int | None]:
        """``(selection_layer, reselection_layer)`` for ``adapter``'s model (None: no re-selection)."""
        measured = measured_layers(adapter.model_id, adapter.num_layers, adapter.num_kv_heads, adapter.head_dim)
        selection = self.selection_layer
        if selection is None:
            selection = measured[0] if measured is not None else DEFAULT_SELECTION_LAYER
            selection = min(selection, adapter.num_layers - 2)  # a tiny model still gets a sparse layer
            selection = _full_layer_from(adapter, selection, fallback=selection)
        if self.reselection_layer is not None:
            return selection, None if self.reselection_layer == -1 else self.reselection_layer
        if measured is not None and measured[0] == selection:
            return selection, None if measured[1] == -1 else measured[1]
        middle = _full_layer_from(adapter, adapter.num_layers // 2, fallback=selection)
        if middle <= selection:
            return selection, None
        if warn:
            warnings.warn(f"tidal: no measured layers for {adapter.model_id!r} with selection layer {selection}; "
                          f"re-selecting at the middle layer {middle} (measure with `{CALIBRATE_COMMAND}`)",
                          stacklevel=3)
        return selection, middle

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


def _full_layer_from(adapter, layer: int, *, fallback: int) -> int:
    """The first full-attention layer at or after ``layer`` (sliding-window layers keep the model's
    own attention and cannot select), else ``fallback``."""
    return next((i for i in adapter.policy_layers if i >= layer), fallback)


class TidalLayer(SelectiveLayer):
    """A sparse layer: selects (full attention + top-k) or reuses the latest selection."""

    def __init__(self, cache, layer_idx: int, policy: TidalPolicy, selects: bool):
        super().__init__(cache, layer_idx, policy.budget, policy.tail_chunk)
        self.policy = policy
        self.selects = selects

    def decode_step(self, q, scaling, lengths):
        # the selection layer's index per step (sequence length) of the current forward: one, or
        # several in a verification the core runs as steps (`PolicyCache.attend`)
        if not self.selects:
            index = self.cache.step_shared.get("tidal_index", {}).get(self.seen)
            if index is None:
                raise RuntimeError(f"tidal layer {self.layer_idx} has no selection for this step: the selection "
                                   "layer must run first in the same forward")
            return self.sparse_attend(q, index, scaling)
        out, index = self._attend_and_select(q[:, :, 0], scaling)
        if self.seen - 1 == self.forward_start or "tidal_index" not in self.cache.step_shared:
            self.cache.step_shared["tidal_index"] = {}  # a new forward: the earlier ones' steps are done
        self.cache.step_shared["tidal_index"][self.seen] = index
        return out[:, :, None]

    def static_select(self, q, scaling):
        """The reusing layers attend what this step's selection layer chose (``cache.step_shared``)."""
        visible = self.cache.step_shared.get("tidal_static")
        if visible is None:
            raise RuntimeError(f"tidal layer {self.layer_idx} has no selection for this step: the selection "
                               "layer must run first in the same forward")
        return visible

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
        B, H_q, D = q.shape
        keys, values = self.buffer.k, self.buffer.v  # (B, H_kv, C, D)
        H_kv, C = keys.shape[1], keys.shape[2]
        end = self.cache.plan.end
        slot, rel, real = static_slots(C, end, self.row_start, q.device)
        logits = (q.reshape(B, H_kv, H_q // H_kv, D).to(keys.dtype) @ keys.transpose(-1, -2)).float() * scaling
        probs = torch.softmax(logits.masked_fill(~real[:, None, None, :], float("-inf")), dim=-1)  # (B, H_kv, G, C)
        out = (probs.to(values.dtype) @ values).reshape(B, H_q, D).to(q.dtype)
        sink, recent = rel < p.sink_tokens, slot[None, :] >= end - p.recent_tokens
        candidates = (real & ~sink & ~recent).expand(B, C)  # (B, C)
        scores = selection_scores(probs, candidates, q, keys, scaling, p.score_reduction)
        chosen = topk_mask(self._share(scores), p.budget - p.sink_tokens - p.recent_tokens, candidates)
        return out, (real & (sink | recent))[:, None, :] | chosen

    def _candidates(self, batch: int, device) -> torch.Tensor:
        """bool (B, T): selectable tokens ``[row_start + sinks, seen - recent)`` of each row."""
        p = self.policy
        pos = torch.arange(self.seen, device=device)[None, :]  # (1, T)
        first = p.sink_tokens if self.row_start is None else self.row_start[:, None] + p.sink_tokens
        return ((pos >= first) & (pos < self.seen - p.recent_tokens)).expand(batch, -1)

    def _attend_and_select(self, q: torch.Tensor, scaling: float, *, hot_path: bool = True
                           ) -> tuple[torch.Tensor, SparseIndex]:
        """Full attention of q [B, H_q, D] -> [B, H_q, D], and the top tokens per KV head.

        With the default ``softmax_max`` reduction the selection scores are this attention's own
        probabilities (renormalised over the candidates, max over the GQA group), so ``q . k`` is
        computed once per step instead of twice (attention, then `exact_scores`): the selection
        layer costs about one dense layer. Other reductions score through `exact_scores`.
        """
        p = self.policy
        B, H_q, D = q.shape
        keys, values = self.buffer.keys, self.buffer.values  # (B, H_kv, T, D)
        H_kv, T = keys.shape[1], keys.shape[2]
        G = H_q // H_kv
        logits = (q.reshape(B, H_kv, G, D).to(keys.dtype) @ keys.transpose(-1, -2)).float() * scaling  # (B, H_kv, G, T)
        if self.row_start is not None:
            logits = logits.masked_fill((torch.arange(T, device=q.device) < self.row_start[:, None])[:, None, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (B, H_kv, G, T)
        out = (probs.to(values.dtype) @ values).reshape(B, H_q, D).to(q.dtype)
        keep = p.budget - p.sink_tokens - p.recent_tokens
        lo, hi = p.sink_tokens, self.seen - p.recent_tokens
        if hot_path and self.row_start is None and p.score_reduction == "softmax_max" and 0 < keep <= hi - lo:
            # hot path (no padding): every row's candidates are [lo, hi), so no masks; same
            # selection as below (tests compare), and a trusted id_range spares the kernel of
            # every reusing layer a read of the ids
            cand = probs[..., lo:hi]
            scores = (cand / cand.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)).amax(dim=2)
            scores = self._share(scores)
            return out, range_topk_index(scores, keep, lo, self.seen, block_size=1, sinks=p.sink_tokens,
                                         dense_tail=p.recent_tokens)
        candidates = self._candidates(B, q.device)  # (B, T)
        scores = selection_scores(probs, candidates, q, keys, scaling, p.score_reduction)
        ids, count = select_pages(self._share(scores), keep, candidates)
        lens = torch.full((B,), self.seen, dtype=torch.int32, device=q.device)
        starts = None if self.row_start is None else self.row_start.to(torch.int32)
        index = SparseIndex(1, ids.to(torch.int32), count.to(torch.int32), lens, starts, p.sink_tokens, p.recent_tokens)
        return out, index

    def _share(self, scores: torch.Tensor) -> torch.Tensor:
        """``shared_selection``: every KV head gets the best score any head gave a token ``(B, H_kv, T)``."""
        return scores.amax(dim=1, keepdim=True).expand_as(scores) if self.policy.shared_selection else scores


def _configure(parser) -> None:
    from kvpress.evals.tidal_layers import configure

    configure(parser)


def _run(args) -> int:
    from kvpress.evals.tidal_layers import run

    return run(args)


register_calibrator("tidal", "measure TidalDecode's re-selection layer for a model (selection overlap)",
                    _configure, _run)
