"""``shadowkv``: low-rank pre-RoPE keys on the device, values in a host tier, sparse rebuild per step."""

from __future__ import annotations

from dataclasses import dataclass

from kvpress.kernels import REDUCTIONS
from kvpress.kernels.quant import ALLOWED_GROUP_SIZES
from kvpress.kernels.shadowkv_rebuild import SHADOWKV_CHUNK_SIZES
from kvpress.registry import MAX_CHANNELS, Policy, check_choice, check_int, check_tokens, register_policy

from ._shadowkv_layer import ShadowKVLayer
from ._shadowkv_store import transfer_summary  # noqa: F401  (re-exported)

_BACKENDS = ("auto", "torch", "triton")
SELECT_UNITS = ("chunks", "tokens")
SVD_METRICS = ("plain", "query")
RESIDUAL_BITS = (0, 2, 4, 8)  # 0: off


@register_policy
@dataclass(frozen=True)
class ShadowKVPolicy(Policy):
    """ShadowKV: Sun et al., "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM
    Inference", arXiv 2410.21465.

    Prefill is plain full attention. Then, per layer, the pre-RoPE keys (RoPE inverted exactly by
    the adapter) are factored by a truncated SVD over all KV heads (``rank`` components); each
    ``chunk_size``-token chunk gets a landmark (its mean post-RoPE key); the ``outlier_chunks``
    chunks per KV head their landmark represents worst, the partial chunk at each row's start and
    the last ``local_window`` tokens stay exact on the device; values move to a host tier (pinned
    memory on CUDA). Each decode step scores chunks by ``q . landmark``, shortlists ``rerank``
    times what the budget allows, re-scores the shortlist on keys rebuilt from the factors (RoPE
    at their original positions), fetches the chosen chunks' values (reusing the previous step's)
    and attends exact + chosen + generated tokens under one softmax.

    ``budget`` counts every token a KV head attends per step, the always-exact ones included; when
    it covers the prompt nothing is factored and the policy equals ``full``. Deviations from the
    paper's defaults: ``rank=None`` keeps a quarter of ``num_kv_heads * head_dim`` and at least half
    of ``head_dim`` (`_shadowkv_store.default_rank`; the paper's fixed 160 suits Llama-3-8B's 1024,
    not SmolLM2's 192, which gets 48; Gemma 3 270M's single 256-wide KV head gets 128), and
    ``rerank=8`` re-scores a shortlist on rebuilt keys, since a mean key can hide the one key a query
    matches (``rerank=1`` is the paper's landmark-only selection).

    On Gemma 3 270M at 16k tokens and budget 1024 (BENCHMARKS.md "Gemma 3 270M at 16k tokens"), rank
    64 keeps 11 of ``full``'s 32 answers on 16 samples per task and the default rank 128 all 63 on
    32 samples per task (at budgets 512 and 2048 too), with 0.43x ``full``'s device bytes. The
    misses at rank 64 come from attending rebuilt keys, not from choosing tokens with them: with the
    same selection, ``rank=64:residual_bits=2`` (the attended tokens' keys corrected by 2-bit
    residuals from the host) keeps all 32 of those at 0.32x, and 61 of 63 on 32 samples (it drops or
    doubles one digit of two UUIDs). At 32k tokens (budget 1024, "Gemma 3 270M at 32k tokens") rank
    128 loses one UUID of 7 that ``exact_topk`` keeps, and ``residual_bits=2`` keeps it.

    Options (all off by default, so the default is the paper's method):

    - ``tail_chunk=N``: the selectable tokens a step leaves out are estimated per N-token group
      (mean landmark as key, mean value as value) and merged into the softmax, as in RetroInfer
      (arXiv 2505.02922).
    - ``select="tokens"``: the shortlist's tokens are chosen one by one by their rebuilt keys'
      exact scores instead of whole chunks (same attended and fetched counts).
    - ``fetch_keys=True``: the host tier also holds exact keys, fetched beside the values of the
      attended tokens; the low-rank keys only select. Doubles host bytes and traffic.
    - ``residual_bits=N`` (2, 4, 8): the host tier holds each key's residual from its rebuild,
      quantized per token in groups of ``residual_group`` channels, fetched beside the values and
      added to the rebuilt keys (at 2 bits +19% of bf16 values' traffic). Excludes ``fetch_keys``.
    - ``svd="query"``: the SVD minimises the error of the prompt's query-key scores (key channels
      weighted by the queries' mean square, per rotary pair) instead of the keys' squared error;
      needs the prompt's queries, so the policy runs its own prefill.
    - ``fold_size=N`` (None: a quarter of the budget): tokens after the prompt are held exactly
      until ``local_window + N`` of them, then the oldest fold into the store (factors, landmarks,
      values to the host), so long generations and later turns keep the budget and device bytes
      bounded; 0 keeps them all exact, as the paper does.

    A prompt in pieces is factorised when it ends, a new turn attends every stored token densely,
    a verification runs as decode steps. With the cache's capacity planned (``generate`` plans it)
    the decode step is static (`kvpress.policies._shadowkv_static.StaticStore`): one graph, the
    chosen values gathered from the host tier by device ids.

    On SmolLM2-135M at budget 256, ``rerank=32:tail_chunk=64:select=tokens:residual_bits=2`` (the
    ``shadowkv-offload`` preset) keeps 28 of ``full``'s 29 8k niah_single needles and 100.3% of its
    4k niah_multivalue score with 22.7-22.9% of ``full``'s bytes on the device; on CPU it decodes
    at 0.62-0.65x ``full``, and on an H200 the default decodes host-bound at a fraction of
    ``full``'s speed (BENCHMARKS.md: "`shadowkv` at budget 256", "`shadowkv` decode and bytes on
    CPU", "`shadowkv` (default) against `full` on an H200").
    """

    budget: int = 2048
    chunk_size: int = 8
    rank: int | None = None
    outlier_chunks: int = 8
    local_window: int = 32
    score_reduction: str = "softmax_max"
    rerank: int = 8
    tail_chunk: int = 0
    fold_size: int | None = None
    select: str = "chunks"
    fetch_keys: bool = False
    residual_bits: int = 0
    residual_group: int | None = None
    svd: str = "plain"
    backend: str = "auto"

    name = "shadowkv"
    description = "low-rank pre-RoPE keys + landmarks on device, values on host, sparse rebuild per step"
    paper = "ShadowKV, arXiv 2410.21465"
    full_prefill = True
    keeps_full_cache = False
    croppable = True

    def validate(self):
        check_tokens("budget", self.budget, 1)
        check_choice("chunk_size", self.chunk_size, SHADOWKV_CHUNK_SIZES)
        if self.rank is not None:
            check_int("rank", self.rank, 1, MAX_CHANNELS)
        check_tokens("outlier_chunks", self.outlier_chunks, 0)
        check_tokens("local_window", self.local_window, 0)
        check_choice("score_reduction", self.score_reduction, REDUCTIONS)
        check_int("rerank", self.rerank, 1, 1024)
        check_tokens("tail_chunk", self.tail_chunk, 0)
        if self.tail_chunk % self.chunk_size:
            raise ValueError(f"tail_chunk={self.tail_chunk} must be 0 (off) or a multiple of chunk_size="
                             f"{self.chunk_size}: its value sums cover whole chunks")
        if self.fold_size is not None:
            check_tokens("fold_size", self.fold_size, 0)
        for name, unit in (("chunk_size", self.chunk_size), ("tail_chunk", self.tail_chunk)):
            if unit and self.fold_size and self.fold_size % unit:
                whole = "chunks" if name == "chunk_size" else "tail groups"
                raise ValueError(f"fold_size={self.fold_size} must be 0 (off) or a multiple of {name}={unit}: "
                                 f"folded tokens join the store in whole {whole}")
        check_choice("select", self.select, SELECT_UNITS)
        check_choice("residual_bits", self.residual_bits, RESIDUAL_BITS)
        if self.residual_group is not None:
            check_choice("residual_group", self.residual_group, ALLOWED_GROUP_SIZES)
        if self.residual_bits and self.fetch_keys:
            raise ValueError("shadowkv: fetch_keys=True attends exact keys, residual_bits corrects the rebuilt ones; "
                             "choose one (residual_bits=0 or fetch_keys=False)")
        check_choice("svd", self.svd, SVD_METRICS)
        check_choice("backend", self.backend, _BACKENDS)

    def check_model(self, adapter):
        key_dim = adapter.num_kv_heads * adapter.head_dim
        if self.rank is not None and self.rank > key_dim:
            raise ValueError(f"rank={self.rank} is larger than the key dimension num_kv_heads * head_dim = "
                             f"{adapter.num_kv_heads} * {adapter.head_dim} = {key_dim}; "
                             f"allowed: 1 <= rank <= {key_dim}")
        if adapter.head_dim % 2:
            raise ValueError(f"shadowkv needs an even head_dim for RoPE, got {adapter.head_dim}")
        if self.residual_bits:
            self.residual_group_for(adapter.head_dim)

    def residual_group_for(self, head_dim: int) -> int:
        """Channels per scale of the residual: ``residual_group``, or with None the largest allowed
        group of at most 32 channels that divides ``head_dim``."""
        fits = [g for g in ALLOWED_GROUP_SIZES if head_dim % g == 0]
        group = self.residual_group or max((g for g in fits if g <= 32), default=None)
        if group in fits:
            return group
        group = (f"any residual_group of at most 32 channels in {list(ALLOWED_GROUP_SIZES)}"
                 if self.residual_group is None else f"residual_group={self.residual_group}")
        raise ValueError(f"head_dim={head_dim} is not divisible by {group}; allowed for this model: "
                         f"{fits or 'none (no supported group divides it; use residual_bits=0)'}")

    def prefills_densely(self) -> bool:
        # plain attention either way, but svd="query" needs the prompt's queries, which a shared
        # dense prefill does not keep
        return self.svd == "plain"

    @property
    def fold_tokens(self) -> int:
        """Tokens a fold moves at a time: ``fold_size``, or with None a quarter of the budget in
        whole chunks (and tail groups), at least one."""
        if self.fold_size is not None:
            return self.fold_size
        unit = max(self.chunk_size, self.tail_chunk)  # tail_chunk is a multiple of chunk_size
        return max(unit, self.budget // 4 // unit * unit)

    def make_layer(self, cache, layer_idx):
        return ShadowKVLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        # Tiny test models: 2 KV heads * head_dim 16 = 32-dim keys, 48-token prompts = 6 chunks of
        # 8. One outlier + one window chunk exact, rank 8 of 32, budget 32: about two of the four
        # remaining chunks per step, so selection, rebuild and host fetches all run; the tail
        # estimate (groups of two chunks) covers the chunks left out; from the 24th generated
        # token on, decode steps fold 16 of them into the store.
        return cls(budget=32, chunk_size=8, rank=8, outlier_chunks=1, local_window=8, tail_chunk=16, fold_size=16)
