"""``zipcache``: mixed-precision KV quantization driven by normalised attention saliency."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.cache import PROMPT_CROP_TOKENS
from kvpress.kernels import native
from kvpress.kernels.merge import merge_states
from kvpress.kernels.packed_decode import quant_decode
from kvpress.kernels.quant import ALLOWED_BITS, ALLOWED_GROUP_SIZES, READ_BACKENDS, check_quant_config
from kvpress.registry import MAX_CHANNELS, MAX_SEED, Policy, check_choice, check_int, check_tokens, register_policy

from ._quant import QuantWindowLayer
from ._zipcache_store import _joined, _runs, _Store


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
    holds the same positions on the queries' device, for the saliency."""

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

    def _row_layer(self, cache):
        return ZipCacheLayer(cache, self.layer_idx, self.p)

    # ------------------------------------------------------------------ probes
    def _random_probes(self, q_start: int, T: int) -> torch.Tensor:
        """bool (T,) on the host: ``probe_random`` random rows among a step's queries older than the
        recent ones."""
        older = max(0, T - self.p.probe_recent)
        mask = torch.zeros(T, dtype=torch.bool)
        if older:
            gen = torch.Generator().manual_seed(self.p.seed * 1_000_003 + self.layer_idx * 8191 + q_start)
            mask[torch.randperm(older, generator=gen)[: self.p.probe_random]] = True
        return mask

    def probe_state(self) -> tuple:
        """The probes as they are (to put back with ``set_probe_state``)."""
        return self.probe_q, self.probe_lse, self.probe_pos, self.probe_rand, self.probe_pos_dev

    def set_probe_state(self, state: tuple) -> None:
        self.probe_q, self.probe_lse, self.probe_pos, self.probe_rand, self.probe_pos_dev = state

    def _keep_probes(self, parts, pos: list[int], rand: list[bool]) -> None:
        """Keep the ``probe_recent`` latest queries and the random probes that can still attend
        an unflushed token (probe at position p sees tokens <= p). ``parts``: ``(q, lse, pos_dev)``
        device tensors whose rows (dim 2, dim 2, dim 0) follow one another in sequence order;
        ``pos`` / ``rand`` (host) describe all those rows. The kept rows are joined from slices
        of the parts (one ``cat`` per tensor): no index or mask on the device."""
        lo, flushed = self.seen - self.p.probe_recent, self.n_quant
        keep = [(r or p >= lo) and p >= flushed for p, r in zip(pos, rand)]
        pieces, start = [], 0
        for part in parts:
            n = part[0].shape[2]
            pieces += [(part, a - start, b - a) for a, b in _runs(keep, start, start + n)]
            start += n
        self.probe_q, self.probe_lse = _joined(parts, pieces, 0, 2), _joined(parts, pieces, 1, 2)
        self.probe_pos_dev = _joined(parts, pieces, 2, 0)
        self.probe_pos = [p for p, k in zip(pos, keep) if k]
        self.probe_rand = [r for r, k in zip(rand, keep) if k]

    def _prompt_probe_rows(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``T``-token prompt's probes: sequence indices (P,) and whether each is a random one (host)."""
        rand = self._random_probes(0, T)
        pos_all = torch.arange(T)
        sel = rand | (pos_all >= T - self.p.probe_recent)
        return pos_all[sel], rand[sel]

    def _prefill(self, q, k, v, scaling):
        if q is not None:
            T = q.shape[2]
            pos, rand = self._prompt_probe_rows(T)
            self._set_prompt_probes(q[:, :, pos.to(q.device)], pos, rand, k, scaling)
            if self._recorded:  # keep the queries a prompt shorter by up to PROMPT_CROP_TOKENS would probe
                rows = torch.cat([self._prompt_probe_rows(T - n)[0]
                                  for n in range(1, min(PROMPT_CROP_TOKENS, T - 1) + 1)] + [pos]).unique()
                self._forward_q = ("prompt", rows, q[:, :, rows.to(q.device)], scaling)
        super()._prefill(q, k, v, scaling)

    def _set_prompt_probes(self, qp, pos, rand, k, scaling) -> None:
        """Probes from prompt queries ``qp`` (B, H_q, P, D) at sequence indices ``pos`` over the
        prompt's keys ``k`` (B, H, T, D), each with its own log-sum-exp (``pos``, ``rand``: host)."""
        B, H_q, P, D = qp.shape
        H, T = k.shape[1], k.shape[2]
        pos_dev = pos.to(k.device)
        s = (qp.float().view(B, H, H_q // H, P, D) @ k.float()[:, :, None].transpose(-1, -2)) * scaling  # (B, H, G, P, T)
        hidden = torch.arange(T, device=k.device)[None, :] > pos_dev[:, None]  # (P, T)
        pad = self.padding_mask(0, T, k.device)
        if pad is not None:
            hidden = (hidden[None] | pad[:, None, :])[:, None, None]  # (B, 1, 1, P, T)
        lse = s.masked_fill(hidden, float("-inf")).logsumexp(-1).view(B, H_q, -1)
        seen, self.seen = self.seen, T  # _keep_probes reads the sequence length
        self._keep_probes([(qp, lse, pos_dev)], pos.tolist(), rand.tolist())
        self.seen = seen
        self._scaling = scaling

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
        """The forward lost its last ``n`` tokens (window and ``seen`` already cut): its probes
        again, from the kept queries, before the flush reads them."""
        record, self._forward_q = self._forward_q, None
        if n == 0 or record is None:
            return
        self.set_probe_state(self._probes_before)
        if record[0] == "prompt":
            _, rows, q_rows, scaling = record
            pos, rand = self._prompt_probe_rows(self.seen)
            self._set_prompt_probes(q_rows[:, :, torch.searchsorted(rows, pos).to(q_rows.device)], pos, rand,
                                    self.k_win[:, :, : self.seen], scaling)
        else:
            _, q, lse, q_start, scaling = record
            keep = self.seen - q_start
            self._after_attend(q[:, :, :keep], lse[:, :, :keep], q_start, scaling, as_steps=True)

    def _after_attend(self, q, lse, q_start, scaling, as_steps: bool = False):
        verification = bool(self._recorded and q_start)  # assisted decoding's: probes as its decode steps'
        if verification:
            prev = self._forward_q
            if prev is not None and prev[0] == "step" and prev[3] + prev[1].shape[2] == q_start:
                # a later segment of the same verification (`_attend_across_flushes`): all its queries
                self._forward_q = ("step", torch.cat([prev[1], q], 2), torch.cat([prev[2], lse], 2), prev[3], scaling)
            else:
                self._forward_q = ("step", q, lse, q_start, scaling)
        T = q.shape[2]
        pos, pos_dev = list(range(q_start, q_start + T)), torch.arange(q_start, q_start + T, device=q.device)
        if verification or as_steps or T <= self.p.probe_recent:  # no random probe (none of the rows is older)
            rand = [False] * T
        else:
            rand = self._random_probes(q_start, T).tolist()
        if self.probe_q is None:
            self._keep_probes([(q, lse, pos_dev)], pos, rand)
            return
        before = (self.probe_q, self.probe_lse, self.probe_pos_dev)
        self._keep_probes([before, (q.to(self.probe_q.dtype), lse, pos_dev)], self.probe_pos + pos, self.probe_rand + rand)

    def saliency(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """Normalised attention (B, H, n) received by tokens ``start ..`` with keys k (B, H, n, D);
        +inf where no probe sees the token (kept precise), -inf on left padding."""
        B, H, n, D = k.shape
        if self.probe_q is None:  # no queries seen (shared prefill): no evidence, all equal
            sal = torch.zeros(B, H, n, device=k.device)
        else:
            H_q, P = self.probe_q.shape[1], self.probe_q.shape[2]
            qp = self.probe_q.float().view(B, H, H_q // H, P, D)
            s = (qp @ k.float()[:, :, None].transpose(-1, -2)) * self._scaling  # (B, H, G, P, n)
            prob = torch.exp(s - self.probe_lse.view(B, H, H_q // H, P)[..., None])
            pos = torch.arange(start, start + n, device=k.device)
            seen_by = self.probe_pos_dev[:, None] >= pos[None, :]  # (P, n) probe can attend token
            rs = self.row_start
            probe_real = torch.ones(B, P, dtype=torch.bool, device=k.device) if rs is None else \
                self.probe_pos_dev[None, :] >= rs[:, None]  # padded probes attended only to themselves
            valid = seen_by[None] & probe_real[:, :, None]  # (B, P, n)
            total = (prob * valid[:, None, None]).sum((2, 3))  # (B, H, n)
            count = valid.sum(1).clamp(min=1) * (H_q // H)  # (B, n)
            sal = total / count[:, None, :]
            sal = torch.where(valid.any(1)[:, None, :], sal, torch.full_like(sal, float("inf")))
        pad = self.padding_mask(start, n, k.device)
        return sal if pad is None else sal.masked_fill(pad[:, None, :], float("-inf"))

    # ------------------------------------------------------------------ storage
    # a flush appends to the two stores (and sets the value normaliser once); the saliency it
    # reads comes from the probes of the steps before it, which a segmented verification has
    undoable_flush = True

    def _flush_state(self):
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        return self.hi.n, clone(self.hi.pad), self.lo.n, clone(self.lo.pad), self.vn, self.lo.ridx

    def _unflush(self, state) -> None:
        self.hi.n, self.hi.pad, self.lo.n, self.lo.pad, self.vn, self.lo.ridx = state

    def refine_channels(self, k: torch.Tensor) -> torch.Tensor:
        """The ``refine_key_channels`` key channels of each KV head whose coarse codes would move
        the probes' scores most, long (B, H, R): mean squared probe query channel (over the
        probes and the KV head's query heads; 1 without probes) times the channel's mean squared
        range over the token groups of keys ``k`` (B, H, n, D) -- the variance of a code's
        rounding error is proportional to the squared range of its group."""
        B, H, n, D = k.shape
        g = self.p.group_size
        kg = k.float().view(B, H, n // g, g, D)
        spread = (kg.amax(3) - kg.amin(3)).pow(2).mean(2)  # (B, H, D)
        if self.probe_q is not None:
            spread = spread * self.probe_q.float().pow(2).view(B, H, -1, D).mean(2)
        return spread.topk(self.p.refine_key_channels, dim=-1).indices.sort(-1).values

    def _flush(self, k, v, start):
        B, H, n, D = k.shape
        g = self.p.group_size
        k, v = self.zero_padding(k, start), self.zero_padding(v, start)
        if self.vn is None:
            vabs = v.float().abs().amax(2)  # (B, H, D)
            self.vn = torch.where(vabs > 0, vabs.sqrt(), torch.ones_like(vabs)).half()
        if self.lo.refine and self.lo.ridx is None:  # fixed at the first flush, as the normaliser
            self.lo.ridx = self.refine_channels(k)
        v_norm = v.float() / self.vn.float()[:, :, None]
        # the high store tracks salient_ratio of everything flushed so far, in whole key groups
        target = int(self.p.salient_ratio * (start + n) / g + 0.5) * g
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

    def _attend(self, q, k_new, v_new, scaling):
        if self.fused_step_ok(q, k_new, self.decode_backend):
            return self._fused_decode(q, k_new, v_new, scaling)
        stores = [st for st in (self.hi, self.lo) if st.n]
        if self.native_step_ok(q, k_new, self.p.backend, [st.views() for st in stores]):
            segments = [native.PackedSegment(*st.views(), st.bits, st.group_size, st.value_group_size, starts=st.pad,
                                             value_scale=self.vn, refine=st.refine_views()) for st in stores]
            return self.native_decode(q, k_new, v_new, scaling, segments)  # both stores and the window in one call
        return super()._attend(q, k_new, v_new, scaling)

    def _fused_decode(self, q, k_new, v_new, scaling):
        """GPU decode: each store through the fused dequantize-attention kernel (`quant_decode`),
        the window through `window_rows`, merged by log-sum-exp. A store's left padding is its
        first ``pad`` rows, the same count in every head (padding has -inf saliency in all of
        them, so every flush sends the same number of padding tokens to each store): ``pad[:, 0]``
        is the kernel's per-row start."""
        B, H_q, _, D = q.shape
        H = k_new.shape[1]
        q_start = self.seen
        self._append(k_new, v_new)
        self.seen += 1
        out, lse = self.window_rows(q[:, :, 0], scaling)
        if self._vn_q is None or self._vn_q[0] is not self.vn:  # a new normaliser (first flush, batch_select)
            self._vn_q = (self.vn, self.vn.float().repeat_interleave(H_q // H, dim=1))
        vn = self._vn_q[1]  # (B, H_q, D): query head h reads KV head h // G
        for st in (self.hi, self.lo):
            if st.n:
                (kc, ks, kz), (vc, vs, vz) = st.views()
                o, l = quant_decode(q[:, :, 0], kc, ks, kz, vc, vs, vz, bits=st.bits, group_size=st.group_size,
                                    seq_starts=st.pad[:, 0], scale=scaling, backend=self.decode_backend,
                                    value_group_size=st.value_group_size, refine=st.refine_views())
                out, lse = merge_states(out, lse, o.float() * vn, l)
        self._after_attend(q, lse.view(B, H_q, 1), q_start, scaling)
        self._maybe_flush()
        return out.to(q.dtype)[:, :, None]

    def _dequantize_into(self, k_out, v_out):
        # column of each store row: every padding row first (the high store's, then the low
        # store's), then the high store's real rows, then the low store's
        stores = [st for st in (self.hi, self.lo) if st.n]
        vn = self.vn.float()[:, :, None]  # undo the value channel normalisation
        if self.row_start is None:  # no padding: the stores one after the other
            i = 0
            for st in stores:
                k, v = st.dequantized()
                k_out[:, :, i : i + st.n] = k
                torch.mul(v, vn, out=v_out[:, :, i : i + st.n])
                i += st.n
            return True
        pads = [st.pad.long()[..., None] for st in stores]  # (B, H, 1) each
        pad_total, real_before = sum(pads), 0
        pad_before = torch.zeros_like(pad_total)
        for st, pad in zip(stores, pads):
            k, v = st.dequantized()
            i = torch.arange(st.n, device=k.device)  # (n,) row of the store
            col = torch.where(i < pad, pad_before + i, pad_total + real_before + i - pad)  # (B, H, n)
            col = col[..., None].expand(-1, -1, -1, k.shape[-1])
            k_out.scatter_(2, col, k)
            v_out.scatter_(2, col, v * vn)
            pad_before, real_before = pad_before + pad, real_before + (st.n - pad)
        return True

    def _lse_rows(self, q_start, T):
        if self._recorded:  # a crop re-reads the kept rows' log-sum-exp: every row may be needed
            return torch.ones(T, dtype=torch.bool)
        pos = torch.arange(q_start, q_start + T)
        return self._random_probes(q_start, T) | (pos >= self.seen - self.p.probe_recent)

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
        return out

