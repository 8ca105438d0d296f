"""``zipcache``: mixed-precision KV quantization driven by normalised attention saliency."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.cache import PROMPT_CROP_TOKENS
from kvpress.kernels import native
from kvpress.kernels.quant import ALLOWED_BITS, ALLOWED_GROUP_SIZES, READ_BACKENDS, check_quant_config
from kvpress.registry import MAX_CHANNELS, MAX_SEED, Policy, check_choice, check_int, check_tokens, register_policy

from ._quant import QuantWindowLayer
from ._zipcache_static import (StaticState, mirror_probes, probes_from_static, reserve_store, salient_target,
                               static_after_attend, static_flush, static_packed, store_slots)
from ._zipcache_probes import (after_attend, crop_probes, prompt_probe_rows, random_probes, refine_channels,
                               saliency, set_prompt_probes)
from ._zipcache_store import _Store, dequantize_into, fused_decode


@register_policy
@dataclass(frozen=True)
class ZipCachePolicy(Policy):
    """ZipCache: salient tokens at ``bits_high`` bits, the rest at ``bits_low`` bits.

    He et al., "ZipCache: Accurate and Efficient KV Cache Quantization with Salient Token
    Identification", arXiv 2405.14256.

    * Quantization granularity as in the paper's experiments: keys per channel (groups of
      ``group_size`` tokens of one precision store), values channel-separable token-wise: each
      value channel is divided by ``c_d = sqrt(max_t |v_td|)`` (fixed at the first flush), then
      quantized per token in groups of ``value_group_size`` channels; attention multiplies its
      output by ``c`` instead of un-normalising values. (Token-wise keys, even normalised, lose
      ~6 dB of attention-output SQNR on SmolLM2 against per-channel keys at 2 bits.)
    * Saliency of a token = attention it received, summed over probe queries and the query
      heads of its KV group, divided by how many probes could attend to it (the normalisation
      that removes the causal bias towards early tokens). Probes are the ``probe_recent`` latest
      queries plus ``probe_random`` random queries of every multi-token step (the prompt, a
      prefill chunk), each scored against the keys with its own log-sum-exp, so prefill itself
      stays plain dense attention.
    * At every flush (the prompt, then every ``flush_size`` decoded tokens) the most salient
      flushed tokens of each KV head go to the high-precision store and the rest to the
      low-precision store, so saliency is re-estimated periodically during decode from the most
      recent queries. The high-precision store holds ``salient_ratio`` of all flushed tokens,
      rounded to whole key groups (a flush may take none, a later one catches up).

    A 4-bit setting, ``bits_low=4, bits_high=8, salient_ratio=0.0625`` (5.41 bits per element
    at 8k in fp16, everything counted), keeps every needle ``full`` finds on SmolLM2 at 8k (29)
    and 4k (32) with ``full``'s perplexity, where uniform 4-bit ``kivi`` loses some, and 97.0% of
    ``full``'s 4k niah_multivalue score over 256 samples (BENCHMARKS "4-bit `zipcache` against
    `full`: bits, needles, perplexity, multivalue"). Of twelve 4-bit settings (5.16-5.66 bits)
    it is the closest to ``full`` by teacher-forced KL along ``full``'s answers (1.7e-3 nats per
    step; uniform 4/4 6.6e-3, twice the salient tokens 3.5e-3; 8-bit ``kivi`` 3.5e-5;
    ``benchmarks/answer_kl.py``).

    ``rotate_values`` (default False): values stored in a Hadamard-rotated basis, the output
    rotated back (as ``kivi``'s option; the normaliser then sees evenly spread channels). On
    SmolLM2 at 4k it lowers the attention-output error of 4-bit values in groups of 64 by 29%
    (``benchmarks/kv_quant_error.py``) but not the perturbation of the answers: the 4/8-bit
    setting above with it 1.9e-3 nats per step against 1.7e-3 without (lower on 3 of 8 samples,
    ``benchmarks/answer_kl.py``), perplexity 29.125 against 29.135; the 2/4-bit default loses
    with it (4k perplexity 30.54 against 30.22, ``kvpress eval --tasks ppl``). Off by default.

    ``refine_key_channels`` (default 0: off; a multiple of 8, at most head_dim, ``bits_low <= 4``)
    gives that many key channels of each KV head in the low-precision store twice the bits: the
    channels whose rounding error moves the probes' scores most (mean squared probe query channel
    times the channel's mean squared group range, chosen at the first flush, as the value
    normaliser). Each is quantized at ``2 * bits_low`` bits and split into the ordinary codes
    (its high bits, readable by every reader of the format) and a second packed code with its own
    fp16 scale (`kvpress.kernels.quant_refine.quantize_refined_keys`); the torch path, the native CPU
    decode step (in its one call) and the fused GPU kernel read both. Mixed precision across key
    channels is this library's addition, not the paper's: on SmolLM2 an eighth of the key
    channels at 8 bits takes a third of 4-bit keys' attention error off
    (``benchmarks/kv_quant_error.py``, ``kch8``), and along ``full``'s 4k niah_multivalue answers
    the 4/8-bit setting above with 8 refined channels (5.67 bits) is half as far from ``full`` by
    teacher-forced KL (9.8e-4 against 1.7e-3 nats per step), with 16 (5.94 bits) 3.5x closer,
    where other ways to spend a quarter bit (more salient tokens, finer value groups) are not
    closer at all (``benchmarks/answer_kl.py``). With 8 refined channels (the ``zipcache-4bit``
    preset) it keeps 99.5% of ``full``'s values over 256 4k niah_multivalue samples (paired 95%
    interval 96.3-102.5%) against 97.0% without, all 32 4k niah_single needles and ``full``'s
    perplexity at 4k and 8k (BENCHMARKS "4-bit `zipcache` against `full`: bits, needles,
    perplexity, multivalue"), and 78 of ``full``'s 79 8k niah_single needles over 144 samples
    (BENCHMARKS "`zipcache-4bit` on 8k niah_single over 144 samples"). The second codes add 8%
    (8 channels) / 16% (16) to the native CPU decode call at 8k
    (``benchmarks/refine_attend_cpu.py``) and 4-5% to the attention's time per token, nothing
    measurable to a whole decode step (BENCHMARKS "4-bit `zipcache` with refined key channels:
    decode on CPU, SmolLM2 at 8k, one thread").

    Assisted decoding (``crop``): with past recording on, a forward's flush waits for the crop;
    the crop puts the probes back as they were before the forward and lets the kept queries
    join them again. The prompt's random probes are drawn anew for each prompt length, so a
    recorded prompt forward keeps the queries every prompt shorter by up to 64 tokens would
    probe (at most ``65 * probe_random + 64 + probe_recent`` rows per layer) until its crop.

    The prompt's probes need its queries, which a shared dense prefill does not keep, so this
    policy runs its own prefill (``full_prefill = False``). No token budget (``with_budget``
    raises). On CPU a decode step is one call of `kvpress.kernels.native.quant_attend` (both
    stores, each with its own left padding, the value normaliser and the window under one
    softmax; ``backend="auto"``, ``"torch"`` the reference path): 1.22x ``full``'s decode speed
    at 8k on one thread, 1.16x on two (BENCHMARKS "Quantized decode on CPU, SmolLM2 at 8k"). On
    CUDA a decode step runs each store through the fused dequantize-attention kernel
    (`kvpress.kernels.quant_decode`, as ``kivi``) and merges them with the window: with the
    default settings 0.42x ``full``'s decode speed at 32k on an H200 with 19% of its cache,
    host-bound on kernel launches (BENCHMARKS "End-to-end decode on an H200 at 32k (random Llama-3-8B-shaped weights,
    bf16, batch 1, budget 1024)").
    """

    bits_high: int = 4
    bits_low: int = 2
    salient_ratio: float = 0.125
    group_size: int = 32
    value_group_size: int = 64
    residual_length: int = 128
    flush_size: int = 64
    probe_recent: int = 16
    probe_random: int = 16
    seed: int = 0
    rotate_values: bool = False
    refine_key_channels: int = 0
    backend: str = "auto"

    name = "zipcache"
    description = "mixed 4/2-bit KV quantization of salient / other tokens, probe-query saliency (ZipCache)"
    paper = "arXiv 2405.14256"
    full_prefill = False
    keeps_full_cache = False
    croppable = True
    chunked_prompt_exact = False  # prompt pieces read the quantized cache, each draws its own probes

    def validate(self):
        for field in ("bits_high", "bits_low"):
            check_choice(field, getattr(self, field), ALLOWED_BITS)
        for field in ("group_size", "value_group_size"):
            check_choice(field, getattr(self, field), ALLOWED_GROUP_SIZES)
        check_quant_config(self.bits_high, self.group_size)
        check_choice("backend", self.backend, READ_BACKENDS)
        check_quant_config(self.bits_low, self.value_group_size)
        if self.bits_low > self.bits_high:
            raise ValueError(f"bits_low={self.bits_low} must not exceed bits_high={self.bits_high}")
        if not 0.0 <= self.salient_ratio <= 1.0:
            raise ValueError(f"salient_ratio={self.salient_ratio!r} is out of range; allowed: 0 <= salient_ratio <= 1")
        check_tokens("residual_length", self.residual_length, 0)
        check_tokens("flush_size", self.flush_size, self.group_size)
        if self.flush_size % self.group_size:
            raise ValueError(f"flush_size={self.flush_size} must be a multiple of group_size={self.group_size}")
        check_tokens("probe_recent", self.probe_recent, 1)
        check_tokens("probe_random", self.probe_random, 0)
        check_int("seed", self.seed, 0, MAX_SEED)
        check_int("refine_key_channels", self.refine_key_channels, 0, MAX_CHANNELS)
        if self.refine_key_channels % 8:
            raise ValueError(f"refine_key_channels={self.refine_key_channels} must be a multiple of 8 "
                             "(0 = off; their second codes are packed whole bytes)")
        if self.refine_key_channels and self.bits_low > 4:
            raise ValueError(f"refine_key_channels needs bits_low <= 4 (refined channels take 2 * bits_low bits, "
                             f"at most 8), got bits_low={self.bits_low}")

    def check_model(self, adapter):
        check_quant_config(self.bits_low, self.value_group_size, adapter.head_dim)
        check_int("refine_key_channels", self.refine_key_channels, 0, adapter.head_dim)

    def make_layer(self, cache, layer_idx):
        return ZipCacheLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(group_size=8, value_group_size=8, residual_length=16, flush_size=8, probe_recent=4,
                   probe_random=4, salient_ratio=0.5)


class ZipCacheLayer(QuantWindowLayer):
    """Two packed stores (``hi_*``, ``lo_*`` in ``state_tensors``), the value channel normaliser
    ``vn`` fp16 (B, H, D), and the probe queries ``probe_q`` (B, H_q, P, D) with their
    log-sum-exp ``probe_lse`` fp32 (B, H_q, P), sequence indices ``probe_pos`` (a list of P ints)
    and ``probe_rand`` (P bools: random probe, kept while it can still see an unflushed token).
    The two lists live on the host, so choosing which probes to keep never waits for the device
    (a device boolean mask would, several times per layer and step on CUDA); ``probe_pos_dev``
    holds the same positions on the queries' device, for the saliency. A static decode step
    (``static_decode``) keeps the probes in fixed slots instead, with the high-precision counts
    of its flushes in a table (``zs``, `kvpress.policies._zipcache_static`); with a planned
    capacity the eager paths keep those slots current, and take the probes back from them after
    static steps."""

    packed_in_sequence_order = False  # high-precision store first, then the low-precision one
    # Croppable (the flush waits for the crop, as for every quantized window): the probes are put
    # back as they were before the forward and the kept queries join them again; the prompt's
    # forward keeps the queries any shorter prompt (by up to PROMPT_CROP_TOKENS tokens) would draw.
    croppable = True

    def __init__(self, cache, layer_idx, policy: ZipCachePolicy):
        super().__init__(cache, layer_idx, policy.residual_length, flush_unit=policy.flush_size,
                         rotate_values=policy.rotate_values)
        self.p = policy
        self.hi = _Store(policy.bits_high, policy.group_size, policy.value_group_size, policy.backend)
        self.lo = _Store(policy.bits_low, policy.group_size, policy.value_group_size, policy.backend,
                         policy.refine_key_channels)
        self.vn = None
        self._vn_q = None  # (vn, vn per query head in fp32) for the fused decode
        self.probe_q = self.probe_lse = self.probe_pos = self.probe_rand = self.probe_pos_dev = None
        self._scaling = 1.0
        self._probes_before = self._forward_q = None  # while a recorded forward can be cropped
        self.decode_backend = "auto"  # quant_decode backend of the fused GPU path ("triton": tests on CPU)
        self.zs = StaticState()  # the static step's probe slots and store bookkeeping (`_zipcache_static`)
        self._static_steps = False  # static steps ran since the eager path last looked: `probes_from_static`

    def _row_layer(self, cache):
        return ZipCacheLayer(cache, self.layer_idx, self.p)

    # ------------------------------------------------------------------ probes
    def probe_state(self) -> tuple:
        """The probes as they are (to put back with ``set_probe_state``)."""
        return self.probe_q, self.probe_lse, self.probe_pos, self.probe_rand, self.probe_pos_dev

    def set_probe_state(self, state: tuple) -> None:
        self.probe_q, self.probe_lse, self.probe_pos, self.probe_rand, self.probe_pos_dev = state

    def _prefill(self, q, k, v, scaling):
        if q is not None:
            T = q.shape[2]
            pos, rand = prompt_probe_rows(self, T)
            set_prompt_probes(self, q[:, :, pos.to(q.device)], pos, rand, k, scaling)
            if self._recorded:  # keep the queries a prompt shorter by up to PROMPT_CROP_TOKENS would probe
                rows = torch.cat([prompt_probe_rows(self, T - n)[0]
                                  for n in range(1, min(PROMPT_CROP_TOKENS, T - 1) + 1)] + [pos]).unique()
                self._forward_q = ("prompt", rows, q[:, :, rows.to(q.device)], scaling)
        super()._prefill(q, k, v, scaling)

    # ------------------------------------------------------------------ crop
    def record_forward(self, k, v):
        super().record_forward(k, v)
        self._probes_before = self.probe_state()
        self._forward_q = None

    def truncatable(self) -> int:
        n = super().truncatable()
        if n and self._forward_q is not None and self._forward_q[0] == "prompt":
            n = min(n, PROMPT_CROP_TOKENS, self.seen - 1)
        return n

    def _after_crop(self, n: int) -> None:
        """The forward lost its last ``n`` tokens: its probes again from the kept queries, before
        the flush reads them (`crop_probes`), and every probe slot rewritten (a prompt's kept
        probes have new log-sum-exps)."""
        crop_probes(self, n)
        mirror_probes(self, full=True)

    def _after_attend(self, q, lse, q_start, scaling, as_steps: bool = False):
        after_attend(self, q, lse, q_start, scaling, as_steps)

    def saliency(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """Normalised attention (B, H, n) received by tokens ``start ..`` with keys k (B, H, n, D);
        +inf where no probe sees the token (kept precise), -inf on left padding (`saliency`)."""
        return saliency(self, k, start)

    # ------------------------------------------------------------------ storage
    # a flush appends to the two stores (and sets the value normaliser once); the saliency it
    # reads comes from the probes of the steps before it, which a segmented verification has
    undoable_flush = True

    def _flush_state(self):
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        return self.hi.n, clone(self.hi.pad), self.lo.n, clone(self.lo.pad), self.vn, self.lo.ridx

    def _unflush(self, state) -> None:
        self.hi.n, self.hi.pad, self.lo.n, self.lo.pad, self.vn, self.lo.ridx = state

    def _flush(self, k, v, start):
        B, H, n, D = k.shape
        k, v = self.zero_padding(k, start), self.zero_padding(v, start)
        if self.vn is None:
            vabs = v.float().abs().amax(2)  # (B, H, D)
            self.vn = torch.where(vabs > 0, vabs.sqrt(), torch.ones_like(vabs)).half()
        if self.lo.refine and self.lo.ridx is None:  # fixed at the first flush, as the normaliser
            self.lo.ridx = refine_channels(self, k)
        v_norm = v.float() / self.vn.float()[:, :, None]
        # the high store tracks salient_ratio of everything flushed so far, in whole key groups
        target = salient_target(self.p, start + n)
        n_hi = min(n, max(0, target - self.hi.n))
        sal = self.saliency(k, start) if 0 < n_hi < n else torch.zeros(B, H, n, device=k.device)
        order = sal.argsort(dim=-1, descending=True, stable=True)
        hi_idx, lo_idx = order[..., :n_hi].sort(-1).values, order[..., n_hi:].sort(-1).values  # sequence order
        pad = self.padding_mask(start, n, k.device)
        for store, idx in ((self.hi, hi_idx), (self.lo, lo_idx)):
            if store.pad is None:
                store.pad = torch.zeros(B, H, dtype=torch.int32, device=k.device)
            if idx.shape[-1] == 0:
                continue
            gi = idx[..., None].expand(-1, -1, -1, D)
            n_pad = torch.zeros(B, H, dtype=torch.int32, device=k.device) if pad is None else \
                torch.gather(pad[:, None, :].expand(-1, H, -1), 2, idx).sum(-1).to(torch.int32)
            store.add(torch.gather(k, 2, gi), torch.gather(v_norm, 2, gi), n_pad)

    # ------------------------------------------------------------------ static decode (`_zipcache_static`)
    static_decode = True

    def _store_slots(self):
        return store_slots(self)

    def _reserve_store(self, like_k, like_v, slots):
        reserve_store(self, like_k, like_v, slots)

    def _static_packed(self, n):
        return static_packed(self, n)

    def _static_flush(self, n, due):
        static_flush(self, n, due)

    def _static_after_attend(self, q, lse, pos, scaling):
        static_after_attend(self, q, lse, pos)

    def count_tokens(self, n: int) -> None:
        super().count_tokens(n)
        self._static_steps = True

    def _from_static(self) -> None:
        """Before an eager forward: the host state of the static steps since the last one."""
        if self._static_steps:
            self._static_steps = False
            probes_from_static(self)

    def _fused_decode(self, q, k_new, v_new, scaling):  # (a method: the interpreter tests count its calls)
        return fused_decode(self, q, k_new, v_new, scaling)

    def _attend(self, q, k_new, v_new, scaling):
        self._from_static()
        if self.fused_step_ok(q, k_new, self.decode_backend):
            return self._fused_decode(q, k_new, v_new, scaling)
        stores = [st for st in (self.hi, self.lo) if st.n]
        if self.native_step_ok(q, k_new, self.p.backend, [st.views() for st in stores]):
            segments = [native.PackedSegment(*st.views(), st.bits, st.group_size, st.value_group_size, starts=st.pad,
                                             value_scale=self.vn, refine=st.refine_views()) for st in stores]
            return self.native_decode(q, k_new, v_new, scaling, segments)  # both stores and the window in one call
        return super()._attend(q, k_new, v_new, scaling)

    def _dequantize_into(self, k_out, v_out):
        return dequantize_into(self, k_out, v_out)

    def _lse_rows(self, q_start, T):
        if self._recorded:  # a crop re-reads the kept rows' log-sum-exp: every row may be needed
            return torch.ones(T, dtype=torch.bool)
        pos = torch.arange(q_start, q_start + T)
        return random_probes(self, q_start, T) | (pos >= self.seen - self.p.probe_recent)

    def _quant_scores(self, qg, scaling):
        q = qg * scaling
        parts = [s.scores(q) for s in (self.hi, self.lo) if s.n]
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]

    def _quant_output(self, p):
        out, i = 0, 0
        for s in (self.hi, self.lo):
            if s.n:
                out = out + s.output(p[..., i : i + s.n])
                i += s.n
        return out * self.vn.float()[:, :, None]  # undo the value channel normalisation

    def batch_select(self, indices):
        if self.by_row is not None:
            return super().batch_select(indices)
        self._from_static()
        self.zs.select(indices)
        sel = lambda t: None if t is None else t.index_select(0, indices.to(t.device))  # noqa: E731
        self.k_win, self.v_win, self.vn = sel(self.k_win), sel(self.v_win), sel(self.vn)
        self.probe_q, self.probe_lse = sel(self.probe_q), sel(self.probe_lse)
        for store in (self.hi, self.lo):
            store.t = {k: sel(v) for k, v in store.t.items()}
            store.pad, store.ridx = sel(store.pad), sel(store.ridx)

    def _quant_tensors(self):
        out = {"vn": self.vn, "probe_q": self.probe_q, "probe_lse": self.probe_lse, "probe_pos_dev": self.probe_pos_dev}
        for prefix, s in (("hi", self.hi), ("lo", self.lo)):
            out.update({f"{prefix}_{k}": v for k, v in s.t.items()})
            out[f"{prefix}_pad"] = s.pad
        if self.lo.refine:
            out["lo_ridx"] = self.lo.ridx
        return {**out, **self.zs.tensors()}

