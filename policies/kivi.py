"""``kivi``: tuning-free asymmetric 2/4-bit KV-cache quantization (the quantization baseline)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.kernels import native
from kvpress.kernels.merge import merge_states
from kvpress.kernels.packed_decode import quant_decode
from kvpress.kernels.quant import (READ_BACKENDS, channel_quant_scores, check_quant_config, quantize_per_channel,
                                   quantize_per_token, token_quant_values)
from kvpress.registry import Policy, check_choice, check_int, check_tokens, register_policy

from ._quant_codes import KiviCodesLayer
from ._quant_storage import fill_with_group_median


@register_policy
@dataclass(frozen=True)
class KiviPolicy(Policy):
    """KIVI: keys quantized per channel (groups of ``group_size`` tokens), values per token
    (groups of ``value_group_size`` channels; None = ``group_size``, the paper's single group),
    the ``residual_length`` most recent tokens kept in full precision (their storage grows with
    the tokens seen, so a large ``residual_length`` costs a short prompt nothing).

    Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750.
    Key channels carry outliers, so per-channel ranges quantize keys well; value errors mix
    across channels only through the attention weights, so per-token ranges suit values. Codes
    are packed ``8 / bits`` per byte with fp16 scales and zero points; decode attention reads
    the codes directly (``kvpress.kernels.packed_decode.quant_decode``; Triton on CUDA). No token
    budget: every token stays, at ``bits`` bits (``with_budget`` raises).

    On SmolLM2-135M ``kivi:bits=4`` (5.31 bits per element at 8k, everything counted) keeps
    ``full``'s perplexity (29.128 / 30.288 against 29.124 / 30.276 at 4k / 8k) and all 32 4k
    niah_single needles, 95.0% of ``full``'s 4k niah_multivalue score over 32 samples and 27 of
    ``full``'s 29 8k niah_single needles (93.1%; BENCHMARKS "4-bit `kivi` and `zipcache` at about
    5.3-5.4 bits"). Where it errs, 4-bit keys tip near-tied choices: on 16 4k niah_multikey
    samples its answers equal ``full``'s on 14, and on the other two it writes another key's
    value where ``full`` itself decides that digit by 0.76 and 0.32 nats (``python -m
    kvpress.evals.margins``). 2-bit by group size 64 / 32 / 16: 2.88 / 3.31 / 4.28 bits, 4k
    perplexity 34.32 / 31.54 / 30.43 (``kvpress eval --model smollm2 --tasks ppl --lengths 4096``).

    Separate value groups: ``kivi:bits=4:group_size=64:value_group_size=16:residual_length=64``
    (5.50 bits at 8k) scores 0.574 against ``full``'s 0.559 over 64 4k niah_multivalue samples
    (103%; 10 answers up, 10 down), where the paper's single group of 32 keeps 94.4%: 4-bit
    values in groups of 32 channels are the loss (``benchmarks/kv_controls.py``). It also
    answers all 32 4k niah_single needles and keeps perplexity at 29.269 / 30.404 at 4k / 8k,
    but loses 3 of ``full``'s 29 8k niah_single needles over 48 samples (89.7% of ``full``'s
    score): it keeps 98% of ``full`` at 4k, neither configuration does at 8k.

    ``sink_tokens`` (default 0, the paper's scheme) keeps each row's first real tokens exactly
    in fp16 beside the codes (attention sinks, Xiao et al., arXiv 2309.17453; KVQuant keeps the
    first token in fp16 too): their keys enter the codes as their group's median, so they do not
    stretch a group's range, and attention reads the exact rows in place of their packed
    columns (torch and fused paths). On SmolLM2 the first token takes 30-90% of the attention
    of many heads (see ``gear``), so its 4-bit key error moves every weight of those rows.
    ``kivi:bits=4:sink_tokens=4`` (5.32 bits at 8k) keeps 28 of ``full``'s 29 8k niah_single
    needles (96.6%) and 96.2% of its 4k niah_multivalue score over 32 samples, against 93.1% and
    95.0% without (BENCHMARKS "4-bit `kivi` and `zipcache` at about 5.3-5.4 bits").

    ``rotate_values`` (default False) stores every value rotated by a fixed orthonormal matrix
    (``kvpress.policies._rotation.value_basis``: the Hadamard matrix for a power-of-two head_dim), as
    QuaRot does before 4-bit KV quantization (Ashkboos et al., arXiv 2404.00456), and rotates each
    step's attention output back once (one D x D product per layer and step; attention is linear
    in the values). The window, the codes and every reader (torch, compiled, fused Triton) work
    unchanged in the rotated basis, and no bit is added (in a half-precision model the window's
    values are rounded once more, in the rotated basis). A value channel far larger than the
    others then no longer sets every token's range: on SmolLM2 at 4k the attention-output error
    that 4-bit values cause drops by a fifth (0.0259 to 0.0201 relative;
    ``benchmarks/kv_quant_error.py``), but answers hardly move: teacher-forced KL of
    ``kivi:bits=4:sink_tokens=4`` along ``full``'s 4k niah_multivalue answers 1.274e-2 against
    1.276e-2 (lower on 7 of 8 samples; ``benchmarks/answer_kl.py``); 4k perplexity 29.133 against
    29.129 at 4 bits, 31.478 against 31.529 at 2 bits. The answers do not follow the values'
    error on this model; 4-bit keys make all of the attention's distance from ``full`` (and, with
    the first tokens' keys exact, about 30% of the output error: 0.0090 of 0.0299). Off by default.

    On CPU a decode step is one call of the compiled kernel `kvpress.kernels.native.quant_attend`
    on torch's threads (packed tokens, exact sinks and the fp window under one softmax; each
    packed row unpacked in registers once for the GQA group; the packed part starts after each
    row's flushed sinks, and until every row's sinks are flushed the two packed reads are native
    and the rest torch). At 8k ``kivi:bits=4`` decodes at 1.32x / 1.27x ``full``'s speed on one /
    two threads with 63 against 366 MiB of cache, ``sink_tokens=4`` at 1.28x / 1.22x (BENCHMARKS
    "Quantized decode on CPU, SmolLM2 at 8k"). ``backend`` picks the CPU reader: ``"auto"``
    (native when built), ``"torch"`` (the reference path), ``"native"``.

    A compiled decode step (``torch.compile``, transformers' compiled ``generate``: the cache is
    ``is_compileable``) takes a static path instead: stores preallocated to the planned capacity,
    the whole store dequantized in torch every step (masked past the packed tokens) with the
    window under one softmax, and the flush committed by a device mask, so flushing steps and the
    others are one graph; a left-padded batch flushes row by row the same way (not timed yet).

    GPU decode reads the packed codes in the fused Triton kernel (``kvpress.kernels.quant_decode``).
    On an H200 at 32k it runs at 0.99x (4-bit) / 0.90x (2-bit) the speed of bf16 SDPA over the
    dense cache at batch 1, 1.12x / 1.04x at batch 8: the unpacking, not the bytes, binds it
    (BENCHMARKS "Fused dequantize-attention decode kernel against bf16 SDPA on an H200 (Llama-3-8B
    attention)"). A whole 2-bit decode step at 32k runs at 0.74x ``full``'s speed with 19% of its
    cache, host-bound on kernel launches (BENCHMARKS "End-to-end decode on an H200 at 32k (random
    Llama-3-8B-shaped weights, bf16, batch 1, budget 1024)").
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
            _check_value_group(self.bits, self.value_group_size)
        check_tokens("residual_length", self.residual_length, 0)
        check_int("sink_tokens", self.sink_tokens, 0, 64)
        check_choice("backend", self.backend, READ_BACKENDS)

    def check_model(self, adapter):
        # keys are grouped over tokens (any head_dim); only the values' channel group divides head_dim
        field = "value_group_size" if self.value_group_size is not None else \
            "group_size (also the values' channel group while value_group_size is None)"
        _check_value_group(self.bits, self.value_group, adapter.head_dim, field)

    @property
    def value_group(self) -> int:
        """Channels per value quantization group."""
        return self.group_size if self.value_group_size is None else self.value_group_size

    def make_layer(self, cache, layer_idx):
        return KiviLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(bits=4, group_size=8, residual_length=16, sink_tokens=2)


def _check_value_group(bits: int, group: int, head_dim: int | None = None, field: str = "value_group_size") -> None:
    try:
        check_quant_config(bits, group, head_dim)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


class KiviLayer(KiviCodesLayer):
    """KIVI's codes (`KiviCodesLayer`: ``kc, ks, kz, vc, vs, vz``), flushed every ``group_size``
    tokens. With ``sink_tokens``: ``sk`` / ``sv`` hold each row's first S real tokens exactly (zero
    until flushed); their keys enter the codes as their group's median and their packed columns are
    never read (every reader takes the exact rows in their place)."""

    def __init__(self, cache, layer_idx, policy: KiviPolicy):
        super().__init__(cache, layer_idx, bits=policy.bits, group_size=policy.group_size,
                         value_group=policy.value_group, sink_tokens=policy.sink_tokens,
                         residual_length=policy.residual_length, flush_unit=policy.group_size,
                         rotate_values=policy.rotate_values)
        self.policy = policy
        self.read_backend = policy.backend
        self.decode_backend = "auto"  # fused_quant_backend's choice for the fused GPU path ("triton": tests on CPU)

    def _row_layer(self, cache):
        return KiviLayer(cache, self.layer_idx, self.policy)

    def _quantized(self, k, v, sink, commit=None):
        """Codes of a chunk ``k`` / ``v`` (B, H, n, D): ``(keys, values)`` triples. ``sink``:
        `sinks_in_chunk`'s pair (or None), whose rows are kept exactly (`_keep_sinks`, under a static
        flush's ``commit``) and enter the key codes as their group's median."""
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

    def _static_packed(self, n):
        k, v = self._dequantized_store()  # (B, H, C, D)
        if self.sk is not None:  # flushed sinks read exactly (a static step's layer has no padding)
            S = self.sink_tokens
            flushed = (torch.arange(S, device=n.device) < n)[:, None]  # (S, 1)
            k = torch.cat([torch.where(flushed, self.sk.float(), k[:, :, :S]), k[:, :, S:]], 2)
            v = torch.cat([torch.where(flushed, self.sv.float(), v[:, :, :S]), v[:, :, S:]], 2)
        return [(k, v, torch.arange(k.shape[2], device=n.device) < n)]

    # ------------------------------------------------------------------ reads
    def _quant_scores(self, qg, scaling):
        q = qg * scaling
        s = channel_quant_scores(q, *self._views()[0], self.bits, self.group_size, backend=self.read_backend)
        if self.sk is not None:  # flushed sink columns: the exact score in place of the codes' one
            col, flushed = self._sink_columns(q.shape[0], q.device)
            col = col[:, None, None].expand(-1, q.shape[1], q.shape[2], -1)  # (B, H, M, S)
            delta = (q @ self.sk.float().transpose(-1, -2) - s.gather(-1, col)) * flushed[:, None, None]
            s = s.scatter_add(-1, col, delta)  # unflushed sinks add 0 to whatever column they clamp to
        return self.mask_padding_scores(s)

    def _quant_output(self, p):
        p_sink = None
        if self.sv is not None:  # flushed sink columns read the exact values, not the codes
            col, flushed = self._sink_columns(p.shape[0], p.device)
            col = col[:, None, None].expand(-1, p.shape[1], p.shape[2], -1)
            p_sink = p.gather(-1, col) * flushed[:, None, None]  # (B, H, M, S)
            p = p.scatter_add(-1, col, -p_sink)
        out = token_quant_values(p, *self._views()[1], self.bits, self.value_group, backend=self.read_backend)
        return out if p_sink is None else out + p_sink @ self.sv.float()

    def _dequantize_into(self, k_out, v_out):
        k, v = self._dequantized(*self._views())
        k_out.copy_(k)
        v_out.copy_(v)
        if self.sk is not None:  # flushed sink columns hold the exact rows, not the codes
            col, flushed = self._sink_columns(k_out.shape[0], k_out.device)
            idx = col[:, None, :, None].expand(-1, k_out.shape[1], -1, k_out.shape[3])  # (B, H, S, D)
            here = flushed[:, None, :, None]
            k_out.scatter_(2, idx, torch.where(here, self.sk.float(), k_out.gather(2, idx)))
            v_out.scatter_(2, idx, torch.where(here, self.sv.float(), v_out.gather(2, idx)))
        return True

    # ------------------------------------------------------------------ decode steps
    def _attend(self, q, k_new, v_new, scaling):
        if self.fused_step_ok(q, k_new, self.decode_backend):
            return self._fused_decode(q, k_new, v_new, scaling)
        if self._native_step(q, k_new):
            return self._native_decode(q, k_new, v_new, scaling)
        return super()._attend(q, k_new, v_new, scaling)

    def _native_step(self, q, k_new) -> bool:
        """Whether this step runs as one native call (`kvpress.kernels.native.quant_attend`): over
        packed tokens, the native reader chosen (`native_step_ok`), and every row's exact sinks
        flushed (before that, the reads still go native through `_quant_scores` / `_quant_output`)."""
        if not self.n_quant:
            return False
        if self.sk is not None:  # then no row's window holds padding either
            rs = self.row_start
            if self.n_quant < (0 if rs is None else int(rs.max())) + self.sink_tokens:
                return False
        return self.native_step_ok(q, k_new, self.read_backend, [self._views()])

    def _native_decode(self, q, k_new, v_new, scaling):
        """CPU decode: the packed tokens, the exact sinks and the window under one softmax in one
        native call (the packed part starts after each row's sinks, which attend exactly)."""
        (keys, values), starts, exact = self._views(), self.row_start, None
        if self.sk is not None:
            starts = self.sink_positions(self.sink_tokens, q.shape[0], q.device)[:, 0] + self.sink_tokens
            exact = (self.sk, self.sv)
        seg = native.PackedSegment(keys, values, self.bits, self.group_size, self.value_group, starts=starts)
        return self.native_decode(q, k_new, v_new, scaling, [seg], exact=exact)

    def _fused_decode(self, q, k_new, v_new, scaling):
        """GPU decode: the packed part through the fused dequantize-attention kernel, the window
        through `window_rows` (one launch once no row's window is padding), merged by log-sum-exp."""
        B, H_q, _, D = q.shape
        H = k_new.shape[1]
        q_start = self.seen
        self._append(k_new, v_new)
        self.seen += 1
        starts = self.row_start
        if self.sk is not None:  # the packed part starts after the flushed sinks, which attend exactly
            qg = q[:, :, 0].float().view(B, H, H_q // H, D)
            pos = self.sink_positions(self.sink_tokens, B, q.device)
            flushed = pos < self.n_quant
            starts = pos[:, 0] + flushed.sum(1)
            s_sink = (qg @ self.sk.float().transpose(-1, -2) * scaling).masked_fill(~flushed[:, None, None], float("-inf"))
            lse_s = s_sink.logsumexp(-1)  # (B, H, G); -inf for a row with no sink flushed yet
            out_s = torch.nan_to_num((s_sink - lse_s[..., None]).exp()) @ self.sv.float()
        keys, values = self._views()
        out_q, lse_q = quant_decode(q[:, :, 0], *keys, *values, bits=self.bits, group_size=self.group_size,
                                    seq_starts=starts, scale=scaling, backend=self.decode_backend,
                                    value_group_size=self.value_group)
        out, lse = merge_states(out_q.float(), lse_q, *self.window_rows(q[:, :, 0], scaling))
        if self.sk is not None:
            out, lse = merge_states(out, lse, out_s.view(B, H_q, D), lse_s.view(B, H_q))
        self._after_attend(q, lse.view(B, H_q, 1), q_start, scaling)
        self._maybe_flush()
        return out.to(q.dtype)[:, :, None]
