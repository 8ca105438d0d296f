"""``kivi``: tuning-free asymmetric 2/4-bit KV-cache quantization (the quantization baseline)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.kernels import native
from kvpress.kernels.packed_decode import quant_decode
from kvpress.kernels.quant import (READ_BACKENDS, channel_quant_scores, check_quant_config, quantize_per_channel,
                                   quantize_per_token, token_quant_values)
from kvpress.registry import Policy, check_choice, check_int, check_tokens, register_policy

from ._quant import attend_masked
from ._quant_codes import KiviCodesLayer
from ._quant_storage import fill_with_group_median


@register_policy
@dataclass(frozen=True)
class KiviPolicy(Policy):
    """KIVI: keys quantized per channel, values per token, the most recent tokens in full precision.

    Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750.
    Key channels carry outliers, so per-channel ranges suit keys; value errors mix across channels
    only through the attention weights, so per-token ranges suit values. ``bits`` (2, or 4): codes
    packed ``8 / bits`` per byte, fp16 scales and zero points, read directly by attention; keys in
    groups of ``group_size`` (32) tokens, values of ``value_group_size`` channels (None: ``group_size``,
    the paper's single group); the ``residual_length`` (128) latest tokens in full precision. No token
    budget (``with_budget`` raises). ``sink_tokens`` (0, the paper's scheme): each row's first real
    tokens kept exactly in fp16 (attention sinks, Xiao et al., arXiv 2309.17453; KVQuant keeps the first
    token so too), their keys in the codes as their group's median. ``rotate_values`` (False): values
    stored rotated by a fixed orthonormal matrix (`_rotation.value_basis`), as QuaRot does (Ashkboos et
    al., arXiv 2404.00456), the output rotated back once a step, so no single large value channel sets
    every token's range. ``backend`` ("auto": native when built; "torch": the reference; "native").

    Measured on SmolLM2-135M (BENCHMARKS "4-bit `kivi` and `zipcache` at about 5.3-5.4 bits"):
    ``bits=4`` (5.31 bits per element at 8k) keeps ``full``'s perplexity (29.128 / 30.288 against
    29.124 / 30.276 at 4k / 8k), all 32 4k niah_single needles, 95.0% of 4k niah_multivalue and 27 of
    29 8k needles; where it errs, 4-bit keys tip near-tied choices (2 of 16 4k niah_multikey answers,
    digits ``full`` decides by 0.76 and 0.32 nats; ``kvpress.evals.margins``). 2-bit at group 64 / 32
    / 16: 2.88 / 3.31 / 4.28 bits, 4k perplexity 34.32 / 31.54 / 30.43.
    ``bits=4:group_size=64:value_group_size=16:residual_length=64`` (5.50 bits) scores 103% of ``full``
    on 64 4k niah_multivalue samples where one group of 32 keeps 94.4% (4-bit values in 32-channel
    groups are the loss; ``benchmarks/kv_controls.py``), but 89.7% on 8k niah_single.
    ``bits=4:sink_tokens=4`` (5.32 bits) keeps 28 of 29 8k needles and 96.2% of 4k niah_multivalue,
    against 27 and 95.0% without (the first token takes 30-90% of many heads' attention).
    ``rotate_values`` cuts 4-bit values' attention-output error by a fifth (``benchmarks/kv_quant_error.py``)
    yet hardly moves answers (teacher-forced KL 1.274e-2 against 1.276e-2, ``benchmarks/answer_kl.py``;
    4k perplexity 29.133 / 29.129 at 4 bits): 4-bit keys make the attention's distance from ``full``.

    Decode on CPU is one `kvpress.kernels.native.quant_attend` call: 1.32x / 1.27x ``full``'s speed at
    8k on one / two threads with 63 against 366 MiB of cache, 1.28x / 1.22x with ``sink_tokens=4``
    (BENCHMARKS "Quantized decode on CPU, SmolLM2 at 8k"). On a GPU the fused Triton kernel
    (`kvpress.kernels.quant_decode`) runs at 0.99x (4-bit) / 0.90x (2-bit) bf16 SDPA's speed at 32k on an
    H200, 1.12x / 1.04x at batch 8 (BENCHMARKS "Fused dequantize-attention decode kernel against bf16
    SDPA on an H200"); a whole 2-bit step at 0.74x ``full``'s speed with 19% of its cache, host-bound
    (BENCHMARKS "End-to-end decode on an H200 at 32k"). A compiled step takes the static path (`_quant_static`).
    """

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    value_group_size: int | None = None
    sink_tokens: int = 0
    rotate_values: bool = False
    backend: str = "auto"

    name = "kivi"
    description = "2/4-bit KV quantization: keys per channel, values per token, fp recent window (KIVI)"
    paper = "arXiv 2402.02750"
    full_prefill = True
    keeps_full_cache = False
    croppable = True
    chunked_prompt_exact = False  # prompt pieces read the quantized cache

    def validate(self):
        check_quant_config(self.bits, self.group_size)
        if self.value_group_size is not None:
            self._check_value_group("value_group_size")
        check_tokens("residual_length", self.residual_length, 0)
        check_int("sink_tokens", self.sink_tokens, 0, 64)
        check_choice("backend", self.backend, READ_BACKENDS)

    def check_model(self, adapter):
        # keys are grouped over tokens (any head_dim); only the values' channel group divides head_dim
        self._check_value_group("value_group_size" if self.value_group_size is not None else
                                "group_size (also the values' channel group while value_group_size is None)",
                                adapter.head_dim)

    def _check_value_group(self, field: str, head_dim: int | None = None) -> None:
        try:
            check_quant_config(self.bits, self.value_group, head_dim)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None

    @property
    def value_group(self) -> int:
        """Channels per value quantization group."""
        return self.group_size if self.value_group_size is None else self.value_group_size

    def make_layer(self, cache, layer_idx):
        return KiviLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(bits=4, group_size=8, residual_length=16, sink_tokens=2)


class KiviLayer(KiviCodesLayer):
    """KIVI's codes (`KiviCodesLayer`), flushed every ``group_size`` tokens; ``sk`` / ``sv``: each row's
    first S real tokens exactly (zero until flushed), read in place of their packed columns."""

    def __init__(self, cache, layer_idx, policy: KiviPolicy):
        super().__init__(cache, layer_idx, bits=policy.bits, group_size=policy.group_size,
                         value_group=policy.value_group, sink_tokens=policy.sink_tokens,
                         residual_length=policy.residual_length, flush_unit=policy.group_size,
                         rotate_values=policy.rotate_values)
        self.policy = policy
        self.decode_backend = "auto"  # fused_quant_backend's choice for the fused GPU path ("triton": tests on CPU)

    def _row_layer(self, cache):
        return KiviLayer(cache, self.layer_idx, self.policy)

    def _quantized(self, k, v, sink, commit=None):
        """Codes ``(keys, values)`` of a chunk (B, H, n, D); the rows of ``sink`` (`sinks_in_chunk`'s pair)
        are kept exactly (under a static flush's ``commit``) and enter the key codes as their group's median."""
        if sink is not None:
            self._keep_sinks(self._sink_rows(k, sink[0]).half(), self._sink_rows(v, sink[0]).half(), sink[1], commit)
            k = fill_with_group_median(k.float(), *sink, self.group_size).to(k.dtype)
        return quantize_per_channel(k, self.bits, self.group_size), quantize_per_token(v, self.bits, self.value_group)

    def _flush(self, k, v, start):
        k, v = self.zero_padding(k, start), self.zero_padding(v, start)
        sink = self.sinks_in_chunk(self.sink_tokens, k, start) if self.sink_tokens else None
        self._append_codes(start, *self._quantized(k, v, sink))

    def _static_flush(self, n, due):
        g = self.group_size
        k, v = self.k_win[:, :, :g], self.v_win[:, :, :g]  # (B, H, g, D): what `_flush` gets
        sink = self._static_sinks(n, k.shape[0]) if self.sk is not None else None
        commit = due.view(1, 1, 1, 1)
        self._write_codes(n, *self._quantized(k, v, sink, commit), commit)

    # ------------------------------------------------------------------ reads
    def _exact_sinks(self, k, v, col, flushed):
        """k / v fp32 (B, H, N, D) with the flushed sinks' columns ``col`` (B, S) holding the exact rows."""
        idx = col[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, H, S, D)
        here = flushed[:, None, :, None]
        return (k.scatter(2, idx, torch.where(here, self.sk.float(), k.gather(2, idx))),
                v.scatter(2, idx, torch.where(here, self.sv.float(), v.gather(2, idx))))

    def _static_packed(self, n):
        k, v = self._dequantized_store()  # (B, H, C, D)
        if self.sk is not None:  # a static step's layer has no padding: the sinks are columns 0 .. S - 1
            col = torch.arange(self.sink_tokens, device=n.device).expand(k.shape[0], -1)
            k, v = self._exact_sinks(k, v, col, col < n)
        return [(k, v, torch.arange(k.shape[2], device=n.device) < n)]

    def _dequantize_into(self, k_out, v_out):
        k, v = self._dequantized(*self._views())
        if self.sk is not None:  # flushed sink columns hold the exact rows, not the codes
            k, v = self._exact_sinks(k, v, *self._sink_columns(k.shape[0], k.device))
        k_out.copy_(k)
        v_out.copy_(v)
        return True

    def _quant_scores(self, qg, scaling):
        q = qg * scaling
        s = channel_quant_scores(q, *self._views()[0], self.bits, self.group_size, backend=self.policy.backend)
        if self.sk is not None:  # flushed sink columns: the exact score in place of the codes' one
            col, flushed = self._sink_index(s)  # unflushed sinks add 0 to whatever column they clamp to
            s = s.scatter_add(-1, col, (q @ self.sk.float().transpose(-1, -2) - s.gather(-1, col)) * flushed)
        return self.mask_padding_scores(s)

    def _quant_output(self, p):
        p_sink = None
        if self.sv is not None:  # flushed sink columns read the exact values, not the codes
            col, flushed = self._sink_index(p)
            p_sink = p.gather(-1, col) * flushed  # (B, H, M, S)
            p = p.scatter_add(-1, col, -p_sink)
        out = token_quant_values(p, *self._views()[1], self.bits, self.value_group, backend=self.policy.backend)
        return out if p_sink is None else out + p_sink @ self.sv.float()

    # ------------------------------------------------------------------ decode steps
    def _attend(self, q, k_new, v_new, scaling):
        if self.fused_step_ok(q, k_new, self.decode_backend):
            return self._fused_decode(q, k_new, v_new, scaling)
        # one native call over the packed tokens, the exact sinks and the window (`native.quant_attend`) once
        # every row's sinks are flushed; before that the reads still go native through `_quant_scores` / `_output`
        sinks_flushed = self.sk is None or self.n_quant >= self.cache.max_row_start + self.sink_tokens
        views = self._views() if self.n_quant and sinks_flushed else None
        if views is not None and self.native_step_ok(q, k_new, self.policy.backend, [views]):
            starts, exact = self.row_start, None
            if self.sk is not None:  # the packed part starts after each row's sinks, which attend exactly
                starts = self.sink_positions(self.sink_tokens, q.shape[0], q.device)[:, 0] + self.sink_tokens
                exact = (self.sk, self.sv)
            seg = native.PackedSegment(*views, self.bits, self.group_size, self.value_group, starts=starts)
            return self.native_decode(q, k_new, v_new, scaling, [seg], exact=exact)
        return super()._attend(q, k_new, v_new, scaling)

    def _fused_parts(self, q0, scaling):
        """The packed codes through the fused dequantize-attention kernel (from each row's first
        unflushed sink on), then the flushed sinks exactly."""
        B, H_q, D = q0.shape
        starts, parts = self.row_start, []
        if self.sk is not None:
            H = self.sk.shape[1]
            pos = self.sink_positions(self.sink_tokens, B, q0.device)
            flushed = pos < self.n_quant
            starts = pos[:, 0] + flushed.sum(1)
            out, lse = attend_masked(q0.float().view(B, H, H_q // H, D), self.sk, self.sv, ~flushed[:, None, None],
                                     scaling)  # lse -inf for a row with no sink flushed yet
            parts.append((out.view(B, H_q, D), lse.view(B, H_q)))
        keys, values = self._views()
        out, lse = quant_decode(q0, *keys, *values, bits=self.bits, group_size=self.group_size, seq_starts=starts,
                                scale=scaling, backend=self.decode_backend, value_group_size=self.value_group)
        return [(out.float(), lse), *parts]
