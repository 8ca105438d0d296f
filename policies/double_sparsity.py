"""``double_sparsity``: token selection from a small label cache of calibrated key channels."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, replace

import torch

from kvpress.calibration import register_calibrator
from kvpress.kernels.backend import label_select_backend
from kvpress.kernels import SparseIndex, label_scores, native, reduce_over_group, topk_ids
from kvpress.policies import _double_sparsity_calib as calib
from kvpress.policies._double_sparsity_calib import synthetic_artifact  # noqa: F401  (re-exported)
from kvpress.policies._double_sparsity_labels import (LabelCache, dequantize_labels,  # noqa: F401  (re-exported)
                                                      quantize_labels)
from kvpress.policies._sparse import (SelectiveLayer, check_budget, check_selection, range_index, static_token_split,
                                      token_topk_index, top_entries, topk_mask)
from kvpress.registry import MAX_CHANNELS, Policy, check_choice, check_int, check_tokens, register_policy

LABEL_BITS = (4, 16)


@register_policy
@dataclass(frozen=True)
class DoubleSparsityPolicy(Policy):
    """Double Sparsity: score every token on ``r`` calibrated key channels, attend the top ones exactly.

    Yang et al., "Post-Training Sparse Attention with Double Sparsity", arXiv 2408.07092. Offline
    calibration (``kvpress calibrate double_sparsity``) ranks each KV head's key channels by the variance
    their score term carries across keys (``mean q_c^2 * var k_c``, `_double_sparsity_calib`: ranking by
    magnitude lost needle digits on SmolLM2); a *label cache* keeps those top ``label_channels`` channels
    of every post-RoPE key ([B, H_kv, T, r], appended every step). A decode step scores all tokens by
    ``q[..., channels] . labels`` and attends exactly (``sparse_decode``) ``budget`` (256) tokens per KV
    head: ``sink_tokens`` (4) first, ``window_size`` (32) latest and the best-scoring rest. The dense
    cache stays resident; prefill is causal; ``budget`` covering every token is exactly ``full``. The
    decode step is static (one ``torch.compile`` graph, masks over the capacity, ties to the earlier token).

    ``group_reduction`` ("max": a token's best raw label score over the GQA group, nearest to the
    paper's per-head top-k; "softmax_max" normalises each head first, "mean" averages). ``label_bits``
    (16: the model dtype; 4: codes with a per-token fp16 scale and zero, the paper's 4-bit labels).
    ``artifact`` (None: the one shipped for the model; else a ``kvpress calibrate double_sparsity
    --model M --out F.safetensors`` file). ``label_channels`` (None: sized to the model from its artifact,
    the fewest channels carrying 3/4 of the calibrated importance of the full-attention layers,
    `_double_sparsity_calib.default_channels`: 16 of SmolLM2's head_dim 64, 64 of Gemma 3 270M's 256,
    whose few global layers spread their score variance wider; allowed ``head_dim // 16 .. head_dim //
    4``). ``rerank`` (8) shortlists ``rerank`` times the kept tokens by label score and chooses among
    them by exact ``q . k`` (the shortlist's keys are read from the resident cache; a shortlist of every
    candidate is ``exact_topk``'s selection); ``rerank=1`` lets the labels choose, as the paper does.
    ``tail_chunk`` (64) adds the chunk-mean estimate of the tokens left out (see ``exact_topk``; 0:
    none, as the paper): with label-chosen tokens alone it hurts as often as it helps, with a
    re-ranked shortlist it keeps the needles. On Gemma at 16k (32 samples per task) the default
    keeps 61 / 63 / 63 of ``full``'s 63 answers at budgets 512 / 1024 / 2048 (the same without the
    tail estimate) and ``rerank=1:tail_chunk=0`` 42 / 51 / 59. Its misses are UUIDs the label-only
    top tokens leave out (BENCHMARKS.md "Gemma 3 270M at 16k tokens" and "... the selecting policies
    at budgets 512, 1024 and 2048"). On SmolLM2 at 8k and budget 256 the tail estimate is what keeps
    the needles: ``tail_chunk=0`` keeps 24 of ``full``'s 29 ("`double_sparsity` at budget 256
    without its tail estimate"). ``backend`` ("auto": on fp32 CPU without padding, selection and
    attention as two compiled calls per layer, `kvpress.kernels.native`; "torch": the reference).

    Measured on SmolLM2-135M at budget 256 (BENCHMARKS.md "`double_sparsity` at budget 256 with its
    shortlist re-ranked on exact keys" and "Query-aware decode on CPU"): the defaults (the
    ``double-sparsity-256`` preset names them) keep all 29 of ``full``'s 8k niah_single needles, 100% of
    its 4k niah_single and 97.5% of its 4k niah_multivalue score, at 1.60x ``full``'s decode speed on
    one CPU thread; ``rerank=1:tail_chunk=0`` (1.88x) loses needles at 8k. On an H100 (random
    Llama-3-8B shape, 32k, budget 1024) the kernel reads the budget 7.8x / 22x faster than dense SDPA at
    batch 1 / 8, but a step is host-bound (scoring, top-k, launches), slower than ``full`` end to end.
    """

    budget: int = 256
    sink_tokens: int = 4
    window_size: int = 32
    label_channels: int | None = None
    label_bits: int = 16
    group_reduction: str = "max"
    artifact: str | None = None
    backend: str = "auto"
    tail_chunk: int = 64
    rerank: int = 8

    name = "double_sparsity"
    description = "label cache of calibrated key channels scores tokens; top tokens attended exactly"
    paper = "arXiv 2408.07092"
    full_prefill = True
    keeps_full_cache = True
    needs_artifact = True
    croppable = True

    def validate(self):
        check_selection(self, "group_reduction")
        check_tokens("window_size", self.window_size, 1)
        check_budget(self.budget, self.sink_tokens + self.window_size + 1,
                     f"sink_tokens={self.sink_tokens} + window_size={self.window_size} + 1")
        if self.label_channels is not None:
            check_int("label_channels", self.label_channels, 1, MAX_CHANNELS)
        check_choice("label_bits", self.label_bits, LABEL_BITS)
        check_choice("backend", self.backend, ("auto", "torch", "triton"))
        check_int("rerank", self.rerank, 1, 1024)

    def channels_for(self, adapter) -> int:
        """``r``, the label channels per key: ``label_channels``, else sized to the model from its
        artifact (`_double_sparsity_calib.default_channels`: the fewest channels carrying 3/4 of the
        calibrated importance of the full-attention layers; 16 for SmolLM2, 64 for Gemma 3 270M)."""
        if self.label_channels is not None:
            return self.label_channels
        return calib.default_channels(self.artifact_path(adapter), adapter)

    def check_model(self, adapter):
        d = adapter.head_dim
        low, high = max(1, d // 16), max(1, d // 4)
        calib.channel_rank(self.artifact_path(adapter), adapter)
        r = self.channels_for(adapter)
        if not low <= r <= high:
            raise ValueError(f"label_channels={r} is out of range for head_dim {d}; "
                             f"allowed: {low} <= label_channels <= {high}")

    def artifact_path(self, adapter) -> pathlib.Path:
        """The artifact to read: ``artifact``, else the one shipped for the model (SmolLM2, Gemma 3 270M)."""
        return calib.artifact_for(self.artifact, adapter)

    def make_layer(self, cache, layer_idx):
        adapter = cache.adapter
        rank = calib.channel_rank(self.artifact_path(adapter), adapter)  # (L, H_kv, D)
        channels = rank[layer_idx, :, : self.channels_for(adapter)].contiguous()  # (H_kv, r)
        return DoubleSparsityLayer(cache, layer_idx, self, channels)

    def with_budget(self, budget: int) -> "DoubleSparsityPolicy":
        return replace(self, budget=int(budget))

    @classmethod
    def example(cls, adapter) -> "DoubleSparsityPolicy":
        """A small instance with a synthetic artifact calibrated on random ids of the (tiny) model;
        the labels shortlist twice the kept tokens for exact re-scoring."""
        return cls(budget=24, sink_tokens=2, window_size=6, label_channels=max(1, adapter.head_dim // 8),
                   artifact=str(synthetic_artifact(adapter)), rerank=2)


class DoubleSparsityLayer(SelectiveLayer):
    """Dense K/V + a label cache (`LabelCache`: the post-RoPE keys' calibrated channels, as
    ``kvpress.kernels.build_labels`` makes them); decode attends ``budget`` tokens per KV head."""

    def __init__(self, cache, layer_idx, policy: DoubleSparsityPolicy, channels: torch.Tensor):
        super().__init__(cache, layer_idx, policy.budget, policy.tail_chunk, backend=policy.backend)
        self.policy = policy
        self.label_cache = LabelCache(channels, policy.label_bits)  # channels: (H_kv, r) long
        self.metadata.append(self.label_cache)
        self._consts: dict = {}  # small per-batch-size constants of the decode hot path

    def state_tensors(self):
        consts = {f"select_{name}": t for (name, _), t in self._consts.items()}  # small, but kept: counted
        return {**super().state_tensors(), **consts}

    def batch_select(self, indices):
        super().batch_select(indices)
        self._consts.clear()

    def static_select(self, q0: torch.Tensor, scaling: float) -> torch.Tensor:
        """`select` over the capacity, pure torch: bool (B, H_kv, C) of the attended slots (sinks,
        window, top tokens; labels, shortlist and top-k as masks)."""
        p, channels = self.policy, self.label_cache.channels
        B, H_q, D = q0.shape
        H, r = channels.shape
        C = self.buffer.capacity
        _, always, candidates = static_token_split(C, self.cache.plan.end, self.row_start, B, q0.device,
                                                   sinks=p.sink_tokens, recent=p.window_size)
        labels = self.label_cache.view(C)  # (B, H_kv, C, r)
        qg = q0.float().view(B, H, H_q // H, D) * scaling
        q_sel = qg.gather(-1, channels[None, :, None, :].expand(B, H, H_q // H, r))  # (B, H_kv, G, r)
        s = (q_sel @ labels.float().transpose(-1, -2)).reshape(B, H_q, C)
        s = reduce_over_group(s, H, reduction=p.group_reduction, mask=candidates)  # (B, H_kv, C)
        keep = p.budget - p.sink_tokens - p.window_size
        # equal scores rank the earlier token first, as the native selection does (a query without
        # signal in the label channels -- or at all -- ties every candidate)
        if p.rerank > 1:  # exact scores of the shortlist
            s = self._rerank(q0, scaling, s, 0, keep * p.rerank, lowest_first=True)
        return always[:, None, :] | topk_mask(s, keep, candidates, lowest_first=True)

    def select(self, q0: torch.Tensor, scaling: float) -> SparseIndex:
        """Token-level index of this decode step: sinks + window + top label scores.

        Parameters
        ----------
        q0 : Tensor [B, H_q, D]
            The decode query (post-RoPE); the new token is already stored.

        Returns
        -------
        SparseIndex with block_size 1 and ``budget - sink_tokens - window_size`` selected tokens
        per (row, KV head) wherever the row is long enough, so each attends exactly ``budget``.
        """
        p, labels, row_start = self.policy, self.label_cache, self.row_start
        keep = p.budget - p.sink_tokens - p.window_size
        lo, hi = p.sink_tokens, self.seen - p.window_size  # candidates: between the sinks and the window
        if row_start is None and hi - lo >= keep and self._native_ok(q0):
            # CPU fp32, no padding: the whole selection in one compiled call (kvpress.kernels.native)
            ids = native.label_select(q0.contiguous(), labels.channels, labels.labels, self.buffer.k, lo=lo, hi=hi,
                                      keep=keep, shortlist=min(keep * p.rerank, hi - lo), scale=scaling,
                                      reduction=p.group_reduction)
            B, H = ids.shape[:2]
            count = self._const("count", lambda: torch.full((B, H), keep, dtype=torch.int32))
            lens = torch.full((B,), self.seen, dtype=torch.int32)
            return SparseIndex(1, ids, count, lens, None, p.sink_tokens, p.window_size, id_range=(lo, hi - 1))
        if p.rerank > 1 and row_start is None and hi - lo >= keep:
            # Hot path of the re-ranking (no padding): the final ids are chosen inside the shortlist
            s = self._candidate_scores(q0, scaling, lo, hi)  # (B, H_kv, hi - lo)
            cand = topk_ids(s, min(keep * p.rerank, hi - lo))  # (B, H_kv, m)
            exact = self._shortlist_scores(q0, scaling, cand + lo, None)  # (B, H_kv, m)
            ids = torch.gather(cand, 2, topk_ids(exact, keep))
            return range_index(ids, lo, self.seen, hi - lo, block_size=1, sinks=p.sink_tokens, dense_tail=p.window_size)

        def scores_for(lo, hi, mask):
            if mask is None:
                # Hot path (no padding): score only the candidates, ~8 torch calls (each costs
                # tens of us on CPU once a layer's MLP has evicted the caches)
                s = self._candidate_scores(q0, scaling, lo, hi)  # (B, H_kv, hi - lo)
            else:
                s = label_scores(q0, labels.view(), labels.channels, scale=scaling,
                                 reduction=p.group_reduction, mask=mask)  # (B, H_kv, T)
                lo = 0
            return s if p.rerank == 1 else self._rerank(q0, scaling, s, lo, keep * p.rerank)

        return token_topk_index(scores_for, q0.shape[0], self.seen, row_start, q0.device,
                                keep=keep, sinks=p.sink_tokens, window=p.window_size)

    def _native_ok(self, q0: torch.Tensor) -> bool:
        """Whether `select`'s unpadded hot path runs natively (`kvpress.kernels.backend.label_select_backend`
        decides from the policy's backend; 16-bit labels only)."""
        return (self.policy.label_bits == 16 and label_select_backend(
            q0, self.label_cache.channels.shape[0], self.label_cache.labels, self.buffer.k,
            self.policy.backend) == "native")

    def _rerank(self, q0: torch.Tensor, scaling: float, s: torch.Tensor, lo: int, m: int,
                lowest_first: bool = False) -> torch.Tensor:
        """Exact scores of the ``m`` best label-scored candidates per KV head, ``-inf`` for the rest.

        ``s`` (B, H_kv, n) scores tokens ``lo .. lo + n - 1`` (``-inf`` for non-candidates);
        the shortlist is scored by `_shortlist_scores`; ``lowest_first``: ties as `top_entries` breaks them.
        """
        m = min(m, s.shape[-1])
        top, cand = top_entries(s, m, lowest_first=True) if lowest_first else torch.topk(s, m, dim=-1, sorted=False)
        exact = self._shortlist_scores(q0, scaling, cand + lo, ~torch.isfinite(top))
        return torch.full_like(s, float("-inf")).scatter_(2, cand, exact)

    def _shortlist_scores(self, q0: torch.Tensor, scaling: float, pos: torch.Tensor,
                          bad: torch.Tensor | None) -> torch.Tensor:
        """Exact ``q . k`` of the tokens ``pos`` (B, H_kv, m), reduced over the GQA group as the labels are.

        The keys are read from the cache (``m * head_dim`` elements per KV head); ``bad``
        (B, H_kv, m) marks slots that are no candidates (padding): ``-inf``, out of the softmax.
        """
        B, H, m = pos.shape
        G, D = q0.shape[1] // H, q0.shape[2]
        k_cache = self.buffer.k  # (B, H, T_cap, D), contiguous: rows of one flat view (index_select of
        # rows is ~14x faster on CPU than a gather with an expanded index)
        rows = torch.arange(B * H, device=pos.device).view(B, H, 1) * k_cache.shape[2] + pos
        keys = k_cache.reshape(-1, D).index_select(0, rows.view(-1)).view(B, H, m, D)
        exact = (q0.float().view(B, H, G, D) * scaling) @ keys.float().transpose(-1, -2)  # (B, H, G, m)
        if bad is not None:
            exact = exact.masked_fill(bad[:, :, None], float("-inf"))
        reduction = self.policy.group_reduction
        if reduction.startswith("softmax"):
            exact = torch.softmax(exact, dim=-1)
            if bad is not None:
                exact = exact.nan_to_num(0.0).masked_fill(bad[:, :, None], float("-inf"))
        return exact.mean(2) if reduction.endswith("mean") else exact.amax(2)  # (B, H, m)

    def _const(self, name: str, build):
        """Per-layer constant that depends only on the batch size (rebuilt when it changes)."""
        key = (name, self.buffer.k.shape[0])
        hit = self._consts.get(key)
        if hit is None:
            hit = self._consts[key] = build()
        return hit

    def _candidate_scores(self, q0: torch.Tensor, scaling: float, lo: int, hi: int) -> torch.Tensor:
        """`kvpress.kernels.label_scores` of the candidates ``[lo, hi)`` with fewer torch calls.

        Same result (tests compare them): the query's label channels come from one gather with
        a cached index, the scale is folded into one ``baddbmm`` over the label cache (read in
        place), and ``softmax_max`` is one ``softmax`` + ``amax`` (no masks on this path).
        """
        p = self.policy
        B, H_q, _ = q0.shape
        labels = self.label_cache
        H, r = labels.channels.shape
        G = H_q // H
        if p.label_bits != 16 or q0.dtype != torch.float32 or labels.labels.dtype != torch.float32:
            return label_scores(q0, labels.view()[:, :, lo:hi], labels.channels, scale=scaling,
                                reduction=p.group_reduction)
        q_idx = self._const("q_idx", lambda: labels.channels.repeat_interleave(G, 0).expand(B, H_q, r).contiguous())
        q_sel = torch.gather(q0, 2, q_idx).view(B * H, G, r)  # (B * H_kv, G, r)
        label_rows = labels.labels[:, :, :, lo:hi].view(B * H, r, hi - lo)  # a view of the label cache
        zero = self._const("zero", lambda: q0.new_zeros(1, 1, 1))
        s = torch.baddbmm(zero, q_sel, label_rows, beta=0, alpha=scaling)  # (B * H_kv, G, T)
        if p.group_reduction.startswith("softmax"):
            s = torch.softmax(s, dim=-1)  # no -inf here: no NaN to clean up
        s = s.mean(1) if p.group_reduction.endswith("mean") else s.amax(1)
        return s.view(B, H, hi - lo)


register_calibrator("double_sparsity",
                    "rank each head's key channels by their q.k contribution on offline prose (Double Sparsity)",
                    calib.configure_cli, calib.run_cli)
