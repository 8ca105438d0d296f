"""``duo``: DuoAttention — full KV for retrieval heads, sinks + recent window for streaming heads."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvpress.attention import dense_causal_attention, static_decode_attention, whole_cache_decode
from kvpress.cache import CacheLayer, KVBuffer
from kvpress.calibration import register_calibrator
from kvpress.layers import SinkWindowLayer
from kvpress.policies._duo_calibrate import configure_parser, run_from_args
from kvpress.policies._duo_gates import check_gates, load_gates, read_upstream_pattern  # noqa: F401  (re-exported)
from kvpress.registry import MAX_SEED, Policy, check_choice, check_int, check_tokens, register_policy

# Growth step of the retrieval heads' buffer: small, so slack stays ~1% of a 4k cache.
_GROW = 32
PREFILL_MODES = ("streaming", "chunked", "dense")


@register_policy
@dataclass(frozen=True)
class DuoPolicy(Policy):
    """DuoAttention: retrieval heads keep every token, streaming heads keep sinks + a window.

    Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
    Heads", arXiv 2410.10819. A gate per (layer, KV head), calibrated offline on passkey retrieval,
    ranks the heads; ``sparsity`` or ``threshold`` makes the lowest ones streaming. Each layer keeps a
    dense buffer [B, H_ret, T, D] for its retrieval heads and a bounded sinks + window buffer [B, H_str,
    <= S + W, D] for its streaming heads (``cache_stats`` lists both). A decode step runs both groups
    through ``kvpress.kernels.sparse_decode`` (disjoint query heads of one output: nothing to merge); a
    compiled step attends them through masked SDPA over fixed shapes. Gates come from ``gates``, else
    ``artifact``, else the artifact shipped for the model (``policies/artifacts/duo-smollm2.safetensors``,
    ``duo-gemma3-270m.safetensors``; `_duo_gates`), made by ``_duo_calibrate``, which describes the
    calibration (far shorter than the paper's) and the variants tried.

    Measured on SmolLM2-135M with 50% retrieval heads (BENCHMARKS.md "`duo` (50% retrieval heads):
    prefill chunk size" and "`duo` at 8k on samples not used to choose its chunk size"): with 2048-token
    chunks it keeps 27 of ``full``'s 29 8k niah_single needles over samples 0-47 (and one ``full``
    misses), 25 of 27 over samples 48-95, not used to choose the chunk size; at 4k 100% of ``full`` on
    niah_single and 102.8% on niah_multivalue, with 0.52 / 0.51 of its resident KV at 4k / 8k.
    1024-token chunks keep 24 of the 29. The needles lost are those ``full`` writes with the smallest
    margin (``python -m kvpress.evals.margins``): the chunked prefill tips them. Random heads of the
    same count answer far fewer (``random_heads_seed``): the calibration matters.

    Attributes
    ----------
    artifact : str or None
        kvpress ``.safetensors`` artifact (``kvpress calibrate duo``), upstream
        ``full_attention_heads.tsv`` (layers x KV heads, tab separated, as published in
        github.com/mit-han-lab/duo-attention under ``attn_patterns/<model>/<run>/``) or a directory
        holding one; None = the artifact shipped for the model.
    sparsity : float or None
        Fraction of KV heads (over all layers) made streaming, lowest gates first (the paper's
        deployment knob), ``floor(sparsity * heads)`` of them: at most that fraction streams; default
        0.5. None = use ``threshold``. On a model with few heads the rounding matters: Gemma 3 270M
        has 3 global KV heads, and streaming 1 of them keeps 63 of ``full``'s 63 answers at 16k
        where streaming 2 (``sparsity=0.67``) keeps 2 of 32 on the first 16 samples (budget 1024;
        BENCHMARKS.md "Gemma 3 270M at 16k tokens"); streaming 1 keeps 62 at budget 512 and 63 at
        2048 ("... the policies with their own prefill at budgets 512 and 2048").
    threshold : float
        With ``sparsity=None``: heads with gate < threshold (0.5) stream.
    sink_tokens, window_size : int
        What a streaming head keeps (16 + 240; its per-step budget is their sum).
    random_heads_seed : int or None
        Ablation: stream the same *number* of heads, chosen at random with this seed. With
        ``sparsity`` set and no ``artifact`` it reads no gates, so it runs on any model.
    gates : tuple of tuples or None
        In-memory gates [layers][KV heads] (tests, experiments); overrides ``artifact``.
    prefill : {"streaming", "chunked", "dense"}
        How streaming heads attend during a prompt forward; every mode keeps the same tokens after
        it, so decode memory and attention are the same. ``"chunked"`` (the default): the paper's
        chunked pre-filling, as upstream deploys it (chunks of 32000, sinks 64 + recent 256): a
        streaming head's queries see sinks + the window before their chunk + their chunk's earlier
        tokens. ``"streaming"``: sinks + window at every position, the pattern the gates are
        calibrated with. ``"dense"``: the whole prompt (one chunk; a runner may share a dense prefill).
    prefill_chunk_size : int
        Chunk of ``prefill="chunked"`` (2048), counted from each row's first real token (rows whose
        padding differs modulo the chunk run as separate groups during the prompt).
    tail_chunk : int
        0 (the default, the paper): a streaming head forgets what leaves its window. ``N > 0``: it
        also keeps fp32 key / value sums of what it evicted per ``N``-token chunk, attended as one mean
        key per chunk (RetroInfer, arXiv 2505.02922; the estimate ``exact_topk`` gains from at 8k);
        needs ``prefill="chunked"`` or ``"dense"``, and its decode step is not static. It loses more
        needles than it wins back at 8k on SmolLM2 (the gates chose heads that work *without* the
        middle of the context): an experiment knob.
    """

    artifact: str | None = None
    sparsity: float | None = 0.5
    threshold: float = 0.5
    sink_tokens: int = 16
    window_size: int = 240
    random_heads_seed: int | None = None
    gates: tuple | None = None
    prefill: str = "chunked"
    prefill_chunk_size: int = 2048
    tail_chunk: int = 0

    name = "duo"
    description = "retrieval heads full KV, streaming heads sinks + window (DuoAttention)"
    paper = "arXiv 2410.10819"
    full_prefill = False  # streaming heads prefill chunked or streaming (unless prefill="dense")
    keeps_full_cache = False
    needs_artifact = True
    croppable = True

    def validate(self):
        check_tokens("sink_tokens", self.sink_tokens, 0)
        check_tokens("window_size", self.window_size, 1)
        check_tokens("prefill_chunk_size", self.prefill_chunk_size, 1)
        check_tokens("tail_chunk", self.tail_chunk, 0)
        check_choice("prefill", self.prefill, PREFILL_MODES)
        if self.tail_chunk and self.prefill == "streaming":
            raise ValueError('tail_chunk needs prefill="chunked" or "dense" (the per-token streaming prefill '
                             "evicts inside the forward)")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold={self.threshold!r} is out of range; allowed: a finite number")
        if self.sparsity is not None and not 0.0 <= self.sparsity <= 1.0:
            raise ValueError(f"sparsity={self.sparsity!r} is out of range; allowed: 0 <= sparsity <= 1 (or None)")
        if self.random_heads_seed is not None:
            check_int("random_heads_seed", self.random_heads_seed, 0, MAX_SEED)
        check_gates(self.gates, self.artifact)

    # ----------------------------------------------------------------- gates -> head split
    def load_gates(self, adapter) -> torch.Tensor:
        """Gate per (layer, KV head), fp32 [num_layers, num_kv_heads]; higher = retrieval
        (`kvpress.policies._duo_gates.load_gates`)."""
        return load_gates(self, adapter)

    def retrieval_mask(self, adapter) -> torch.Tensor:
        """bool [num_layers, num_kv_heads]: True where the head keeps its full KV.

        Only the full-attention layers (``adapter.policy_layers``) are split, so ``sparsity`` is
        their share of streaming heads; the rows of sliding-window layers (the model's own window,
        never a duo layer) are left True.
        """
        gates = self.load_gates(adapter)
        layers = list(adapter.policy_layers)
        mask = torch.ones(gates.shape, dtype=torch.bool)
        mask[layers] = split_heads(gates[layers], self.sparsity, self.threshold, self.random_heads_seed)
        return mask

    def check_model(self, adapter):
        self.load_gates(adapter)

    def prefills_densely(self) -> bool:
        return self.prefill == "dense"

    def make_layer(self, cache, layer_idx):
        key = "duo_retrieval_mask"
        if key not in cache.shared:  # one artifact read per generation, shared by all layers
            cache.shared[key] = self.retrieval_mask(cache.adapter)
        return DuoLayer(cache, layer_idx, cache.shared[key][layer_idx], self.sink_tokens, self.window_size,
                        prefill=self.prefill, prefill_chunk=self.prefill_chunk_size, tail_chunk=self.tail_chunk)

    def with_budget(self, budget: int) -> "DuoPolicy":
        """Budget of the streaming heads (``sink_tokens + window_size``); retrieval heads keep all."""
        if budget <= self.sink_tokens:
            raise ValueError(f"budget={budget} must exceed sink_tokens={self.sink_tokens} "
                             "(budget = sink_tokens + window_size)")
        return replace(self, window_size=int(budget) - self.sink_tokens)

    @classmethod
    def example(cls, adapter) -> "DuoPolicy":
        # Synthetic gates: alternate which heads stream so every layer has both kinds when it can.
        rows = tuple(tuple(float((layer + head) % 2) for head in range(adapter.num_kv_heads))
                     for layer in range(adapter.num_layers))
        return cls(gates=rows, sparsity=0.5, sink_tokens=2, window_size=8)


def split_heads(gates: torch.Tensor, sparsity: float | None, threshold: float,
                random_seed: int | None = None) -> torch.Tensor:
    """Turn gates [L, H] into a retrieval mask (bool [L, H], True = full KV).

    With ``sparsity`` the ``floor(sparsity * L * H)`` lowest gates stream (ties by index, so the
    split is deterministic); otherwise gates below ``threshold`` stream. ``random_seed`` keeps the
    count but picks the streaming heads uniformly at random (the ablation).
    """
    flat = gates.reshape(-1).to(torch.float32)
    if sparsity is not None:
        num_stream = math.floor(sparsity * flat.numel() + 1e-9)  # at most that fraction (1e-9: 0.3 * 10)
    else:
        num_stream = int((flat < threshold).sum())
    if random_seed is not None:
        order = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(random_seed))
    else:
        order = torch.sort(flat, stable=True).indices
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    keep[order[:num_stream]] = False
    return keep.view(gates.shape)


class DuoLayer(CacheLayer):
    """One decoder layer's split storage: the retrieval KV heads' dense K/V [B, H_ret, capacity, D]
    (``retrieval_k/v``) and a :class:`SinkWindowLayer` over the streaming heads, K/V [B, H_str, <= S + W, D]
    and positions (``streaming_k/v/pos``); query head q reads KV head q // G. Crops record (the
    retrieval buffer's length, the streaming heads' slots), or truncate with no streaming head. A static
    step writes the retrieval heads at the plan's device position and attends their whole capacity
    masked past ``plan.end``; the streaming heads take their layer's static step (none with ``tail_chunk``)."""

    step_ints = ("seen", "dense.length", "stream.seen")

    def __init__(self, cache, layer_idx: int, retrieval: torch.Tensor, sinks: int, window: int,
                 prefill: str = "streaming", prefill_chunk: int | None = None, tail_chunk: int = 0):
        super().__init__(cache, layer_idx)
        heads = torch.arange(retrieval.numel())
        self.retrieval_heads = heads[retrieval]
        self.streaming_heads = heads[~retrieval]
        self.group = cache.adapter.group_size
        self.dense = KVBuffer(grow=_GROW) if self.retrieval_heads.numel() else None
        self.stream = (SinkWindowLayer(cache, layer_idx, sinks, window, dense_prefill=prefill != "streaming",
                                       prefill_chunk=prefill_chunk if prefill == "chunked" else None,
                                       tail_chunk=tail_chunk)
                       if self.streaming_heads.numel() else None)
        self._index: dict | None = None

    def _indices(self, device) -> dict:
        if self._index is None:
            g = torch.arange(self.group)

            def q_heads(kv):  # (H_sub * G,) query heads of these KV heads, in order
                return (kv[:, None] * self.group + g[None, :]).reshape(-1).to(device)

            self._index = {
                "ret": self.retrieval_heads.to(device), "str": self.streaming_heads.to(device),
                "ret_q": q_heads(self.retrieval_heads), "str_q": q_heads(self.streaming_heads),
            }
        return self._index

    @property
    def static_decode(self) -> bool:
        return self.stream is None or self.stream.static_decode

    def _split(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """K/V [B, H_kv, T, D] -> the retrieval heads' (k_r, v_r) and the streaming heads' (k_s, v_s),
        each [B, H_sub, T, D] (the streaming layer initialised on its first tokens)."""
        idx = self._indices(k.device)
        k_s, v_s = k.index_select(1, idx["str"]), v.index_select(1, idx["str"])
        if self.stream is not None and not self.stream.is_initialized:
            self.stream.lazy_initialization(k_s, v_s)
        return k.index_select(1, idx["ret"]), v.index_select(1, idx["ret"]), k_s, v_s

    def _store_retrieval(self, k_r: torch.Tensor, v_r: torch.Tensor) -> None:
        """Append to the retrieval heads' buffer, sized to the planned capacity on its first store
        (static steps then write in place)."""
        if self.dense.k is None and self.cache.capacity:
            self.dense.reserve(self.cache.capacity, k_r, v_r, exact=True)
        self.dense.append(k_r, v_r)

    def attend(self, q, k_new, v_new, scaling):
        plan = self.cache.plan
        static = plan is not None and plan.static and self.static_decode
        idx = self._indices(q.device)
        k_r, v_r, k_s, v_s = self._split(k_new, v_new)
        out = q.new_empty(q.shape)  # (B, H_q, T, D)
        if self.dense is not None:
            q_ret = q.index_select(1, idx["ret_q"])
            if static:  # at the plan's device position over the whole capacity (fixed shapes)
                if self.dense.length + 1 > self.dense.capacity:  # outgrown: the next bucket (a new shape)
                    self.dense.reserve(self.dense.length + 1, k_r, v_r)
                self.dense.write_at(plan.start, k_r, v_r)
                out[:, idx["ret_q"]] = static_decode_attention(q_ret, self.dense.k, self.dense.v, scaling,
                                                               end=plan.end, row_start=self.row_start)
            else:
                self._store_retrieval(k_r, v_r)
                if q.shape[2] == 1 and self.seen > 0:  # decode: the decode kernel over the whole buffer
                    out[:, idx["ret_q"]] = whole_cache_decode(q_ret, self.dense.keys, self.dense.values, scaling,
                                                              self.row_start)
                else:
                    out[:, idx["ret_q"]] = dense_causal_attention(q_ret, self.dense.keys, self.dense.values,
                                                                  scaling, q_start=self.seen, row_start=self.row_start)
        if self.stream is not None:
            # a static step: the streaming layer's own (it counts its token itself); else through the
            # core, so that a verification reaches the streaming heads as decode steps
            attend = self.stream.attend if static else lambda *a: self.cache.attend(self.stream, *a)
            out[:, idx["str_q"]] = attend(q.index_select(1, idx["str_q"]), k_s, v_s, scaling)
        if static:
            self.count_static_step()
        else:
            self.seen += k_new.shape[2]
        return out

    def count_tokens(self, n: int) -> None:
        self.seen += n
        if self.dense is not None:
            self.dense.length += n
        if self.stream is not None and self.stream.counts_deferred:  # the streaming heads' deferred count
            self.stream.counts_deferred = False
            self.stream.count_tokens(n)

    def end_prompt(self) -> None:
        if self.stream is not None:
            self.stream.end_prompt()

    def ingest_prefill(self, k, v):
        """Take a prompt that attended densely (``prefill="dense"``): retrieval heads keep it all,
        streaming heads their sinks + window."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        k_r, v_r, k_s, v_s = self._split(k, v)
        if self.dense is not None:
            self._store_retrieval(k_r, v_r)
        if self.stream is not None:
            self.stream.ingest_prefill(k_s, v_s)
        self.seen += k.shape[2]

    # ------------------------------------------------------------------ crop
    @property
    def rollback(self) -> str:
        """Truncate when every head is a retrieval head, else record (the streaming heads' slots)."""
        return "truncate" if self.stream is None else "record"

    @property
    def rollback_state(self) -> tuple[str, ...]:
        return ("dense",) if self.stream is None else ("dense", "stream")

    def store_again(self, k, v):
        k_r, v_r, k_s, v_s = self._split(k, v)
        if self.dense is not None:
            self.dense.append(k_r, v_r)
        self.stream.store_again(k_s, v_s)
        self.seen += k.shape[2]

    def state_tensors(self):
        out = {}
        if self.dense is not None:
            out.update(retrieval_k=self.dense.k, retrieval_v=self.dense.v)
        if self.stream is not None:
            out.update({f"streaming_{name}": t for name, t in self.stream.state_tensors().items()})
        return out

    def batch_select(self, indices):
        if self.dense is not None and self.dense.k is not None:
            self.dense.k = self.dense.k.index_select(0, indices.to(self.dense.k.device))
            self.dense.v = self.dense.v.index_select(0, indices.to(self.dense.v.device))
        if self.stream is not None and self.stream.k is not None:
            self.stream.batch_select(indices)

    def stored_tokens(self) -> int:
        dense = self.dense.length if self.dense is not None else 0
        return max(dense, self.stream.stored_tokens() if self.stream is not None else 0)

    def cached_elements(self) -> int:
        total = 0
        if self.dense is not None and self.dense.k is not None:
            b, h, _, d = self.dense.k.shape
            total += 2 * b * h * self.dense.length * d
        if self.stream is not None:
            total += self.stream.cached_elements()
        return total


register_calibrator("duo", "train DuoAttention's per-(layer, KV head) gates on synthetic passkey retrieval",
                    configure_parser, run_from_args)
