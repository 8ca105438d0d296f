"""``gear``: low-bit quantization + low-rank error correction + exact sparse outliers."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.kernels import native
from kvpress.kernels.quant import (READ_BACKENDS, channel_quant_scores, check_quant_config, dequantize_per_channel,
                                   dequantize_per_token, quantize_per_channel, quantize_per_token, reads_natively,
                                   token_quant_values)
from kvpress.registry import Policy, check_choice, check_int, check_tokens, register_policy

from . import _gear_static
from ._gear_static import outlier_positions, power_start  # noqa: F401 (outlier_positions: API)
from ._quant_codes import KiviCodesLayer
from ._quant_storage import GROW, append_tokens, fill_with_group_median

OUTLIER_CHUNK = 1024  # packed tokens whose outliers are applied at a time (torch path)
CUDA_OUTLIER_CHUNK = 32768  # the same on a GPU: each pass is a few launches of host time


@register_policy
@dataclass(frozen=True)
class GearPolicy(Policy):
    """GEAR: KIVI's codes + a low-rank approximation of their error + sparse entries kept exactly.

    Kang et al., "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative
    Inference of LLM", arXiv 2403.05527. For every flushed chunk (the prompt, then every ``flush_size``
    (64) decoded tokens; the ``residual_length`` (128) latest stay in full precision) and KV head: each
    quantization group (``group_size`` (32) tokens of a key channel or channels of a value token) loses
    its ``outliers_per_group`` (1) entries furthest from the median (replaced by it), the rest is
    quantized to ``bits`` (2) as in KIVI, the residual is approximated as ``L @ R.T`` of rank ``rank``
    (1; fp16) by ``power_iterations`` (3) of subspace iteration, and each outlier stores what is left at
    its position (uint8 offset, fp16 value). Beyond the paper the exact part also holds each row's first
    ``sink_tokens`` (4) real tokens (attention sinks, Xiao et al., arXiv 2309.17453; KVQuant, arXiv
    2401.18079): keys replaced by the group median before quantizing, rows kept as fp16 corrections.
    Attention applies every part without materialising keys or values (codes through
    ``kvpress.kernels.quant``, low rank as ``(q R) L^T``, outliers and sinks by scatter-add). No token
    budget (``with_budget`` raises). ``backend`` ("auto": native CPU kernels when built; "torch").

    On SmolLM2 the sinks matter more than the paper's parts: the first token takes 30-90% of many heads'
    attention (layer 12's attention-output SQNR: 7 dB with kivi-2, 34 dB with the sink exact;
    ``python -m kvpress.evals.bench_quant attn``). Perplexity (full 29.12 at 4k, 30.28 at 8k; ``kvpress
    eval --model smollm2 --tasks ppl --lengths 4096,8192``), bits at 8k (``bench_quant bits``)::

        kivi-2 group 64 / 32 / 16            2.88 / 3.31 / 4.28 bits   4k 34.32 / 31.54 / 30.43
        gear default (g32, 1 outlier, rank 1, 4 sinks)     4.41 bits   4k 29.76   8k 31.34
        the same without sinks (sink_tokens=0)             4.41 bits   4k 30.54   8k 32.22
        sinks alone on kivi-2's codes (rank=0, outliers_per_group=0)  3.38 bits   4k 30.36
        group 64, 1 outlier, rank 1, 4 sinks               3.54 bits   4k 30.78
        sinks on kivi-2 g16's codes (group 16, no outliers, no rank)  4.38 bits   4k 29.83
        (kivi-2 g16 at 8k: 32.23; kivi-2 34.16)

    The paper's parts pay about what halving kivi's group pays per bit (on top of the sinks, +1.03 bit
    for -0.60 against +1.0 for -0.53); rank 1 is the weakest (+0.4 dB attention SQNR for 0.28 bit: key
    errors are nearly white across channels). The sinks do not help exact recall (4k, 8 samples:
    niah_single 4/8, niah_multikey 3/8, against full 8/8 and 5/8, kivi-2 2/8 and 1/8), the misses mostly
    digits garbled in the copy. A CPU decode step is one `native.quant_attend` call with every correction
    inside: 1.09x / 1.11x ``full``'s speed at 8k on one / two threads, the torch path 0.37x / 0.34x
    (BENCHMARKS "Quantized decode on CPU, SmolLM2 at 8k"). A GPU runs the torch path (no fused kernel for
    the corrections): 0.31x ``full``'s speed at 32k on an H200 (123.7 against 38.3 ms/token), host-bound
    on small launches (BENCHMARKS "End-to-end decode on an H200 at 32k"). A compiled step takes the
    static path (`_quant_static`; this layer's store in `_gear_static`).
    """

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    flush_size: int = 64
    rank: int = 1
    outliers_per_group: int = 1
    power_iterations: int = 3
    sink_tokens: int = 4
    backend: str = "auto"

    name = "gear"
    description = "low-bit KV quantization + low-rank error + sparse outliers (GEAR)"
    paper = "arXiv 2403.05527"
    full_prefill = True
    keeps_full_cache = False
    croppable = True
    chunked_prompt_exact = False  # prompt pieces read the quantized cache

    def validate(self):
        check_quant_config(self.bits, self.group_size)
        check_choice("backend", self.backend, READ_BACKENDS)
        check_tokens("residual_length", self.residual_length, 0)
        check_tokens("flush_size", self.flush_size, self.group_size)
        if self.flush_size % self.group_size:
            raise ValueError(f"flush_size={self.flush_size} must be a multiple of group_size={self.group_size}")
        check_int("rank", self.rank, 0, 64)
        check_int("power_iterations", self.power_iterations, 1, 20)
        check_int("outliers_per_group", self.outliers_per_group, 0, self.group_size // 2)
        check_int("sink_tokens", self.sink_tokens, 0, 64)

    def check_model(self, adapter):
        check_quant_config(self.bits, self.group_size, adapter.head_dim)
        if self.rank > adapter.head_dim:
            raise ValueError(f"rank={self.rank} exceeds head_dim={adapter.head_dim}")

    def make_layer(self, cache, layer_idx):
        return GearLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(bits=4, group_size=8, residual_length=16, flush_size=8, rank=2, outliers_per_group=1, sink_tokens=2)


def _outlier_chunk(x: torch.Tensor) -> int:
    return CUDA_OUTLIER_CHUNK if x.is_cuda else OUTLIER_CHUNK


def low_rank(e: torch.Tensor, rank: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors of ``e`` (B, H, n, D) by subspace (power) iteration.

    Returns ``L`` (B, H, n, rank) with orthonormal columns and ``R = e^T L`` (B, H, D, rank), so
    ``L @ R^T`` is the projection of ``e`` onto its estimated top singular subspace. The start
    matrix is drawn from a fixed seed (`power_start`), so results are deterministic.
    """
    B, H, n, D = e.shape
    r = power_start(D, rank, e.device).expand(B, H, D, rank)
    for _ in range(iterations):
        left, _ = torch.linalg.qr(e @ r)  # (B, H, n, rank)
        r = e.transpose(-1, -2) @ left  # (B, H, D, rank)
    return left, r


def group_view(x: torch.Tensor, group_size: int, per_channel: bool) -> torch.Tensor:
    """x (B, H, n, D) seen as quantization groups, the group axis at dim -2 for keys (per
    channel: (B, H, n/G, G, D)) and at dim -1 for values (per token: (B, H, n, D/G, G))."""
    B, H, n, D = x.shape
    return x.view(B, H, n // group_size, group_size, D) if per_channel else x.view(B, H, n, D // group_size, group_size)


def split_outliers(x: torch.Tensor, group_size: int, per_channel: bool, count: int):
    """Take the ``count`` entries furthest from their group's median out of every group.

    Returns ``rest`` (x with those entries set to the median, (B, H, n, D)) and ``offset``
    int64: position inside the group, (B, H, n/G, count, D) for keys, (B, H, n, D/G, count)
    for values.
    """
    xg = group_view(x, group_size, per_channel)
    dim = 3 if per_channel else 4
    med = xg.median(dim, keepdim=True).values
    offset = (xg - med).abs().topk(count, dim).indices
    rest = xg.scatter(dim, offset, med.expand_as(offset))
    return rest.reshape(x.shape), offset


class GearLayer(KiviCodesLayer):
    """KIVI's codes (`KiviCodesLayer`: ``kc, ks, kz, vc, vs, vz``, values in groups of ``group_size``
    channels) + low-rank error factors + per-group outliers + sink corrections.

    ``kl`` / ``vl`` fp16 (B, H, cap, rank): left factors, token-aligned; ``kr`` / ``vr`` fp16
    (B, H, chunks, D, rank): right factors of each flushed chunk (chunk bounds in
    ``chunk_starts``). Key outliers, per token group: ``ko`` uint8 offset inside the group and
    ``kx`` fp16 correction, (B, H, cap/G, m, D). Value outliers, per token: ``vo`` / ``vx``
    (B, H, cap, D/G * m). Sinks: ``sk`` / ``sv`` fp16 (B, H, sink_tokens, D), what the parts
    above miss on each row's first tokens (zero until those tokens are flushed).

    Static decode steps (`kvpress.policies._quant_static`; this layer's store hooks are in
    `_gear_static`) read the right factors per flush block of ``flush_size`` tokens instead,
    ``krb`` / ``vrb`` fp16 (B, H, cap/flush_size, D, rank) (every chunk starts and ends on a
    block; a chunk's factors repeat over its blocks), which
    exist with a planned capacity; ``chunk_starts`` and ``kr`` / ``vr`` catch up with the blocks
    flushed by static steps when an eager forward next runs (`_gear_static.sync_chunks`).
    """

    def __init__(self, cache, layer_idx, policy: GearPolicy):
        super().__init__(cache, layer_idx, bits=policy.bits, group_size=policy.group_size,
                         value_group=policy.group_size, sink_tokens=policy.sink_tokens,
                         residual_length=policy.residual_length, flush_unit=policy.flush_size)
        self.score_block_factor = 1 + 2 * policy.rank  # (B, H, M, N, rank) corrections of a query block
        self.p = policy
        self.kl = self.vl = self.kr = self.vr = None
        self.ko = self.kx = self.vo = self.vx = None
        self.chunk_starts: list[int] = []
        self._chunk_ids = self._chunk_bounds = None
        self.krb = self.vrb = None  # right factors per flush block (static steps)
        self._chunked_to = 0  # packed tokens that chunk_starts / kr / vr cover

    def _row_layer(self, cache):
        return GearLayer(cache, self.layer_idx, self.p)

    # ------------------------------------------------------------------ compression
    def _compress(self, x, start, per_channel: bool, sink=None):
        """-> codes, scale, zero, left, right, outlier offsets (uint8), outlier corrections (fp16),
        sink corrections (fp16 (B, H, S, D), or None when no sink token is in this chunk).
        ``start``: the chunk's first sequence index; None in a static step, which passes
        ``sink`` (`sinks_in_chunk`'s pair, from device positions: possibly no sink inside)."""
        p = self.p
        x = x.float() if start is None else self.zero_padding(x, start).float()
        rest, offset = x, None
        if start is not None:
            sink = self.sinks_in_chunk(p.sink_tokens, x, start) if p.sink_tokens else None
        if sink is not None and per_channel:  # a sink key must not stretch its channel groups
            rest = fill_with_group_median(x, *sink, p.group_size)
        if p.outliers_per_group:
            rest, offset = split_outliers(rest, p.group_size, per_channel, p.outliers_per_group)
        if per_channel:
            codes, scale, zero = quantize_per_channel(rest, p.bits, p.group_size)
            approx = dequantize_per_channel(codes, scale, zero, p.bits, p.group_size)
        else:
            codes, scale, zero = quantize_per_token(rest, p.bits, p.group_size)
            approx = dequantize_per_token(codes, scale, zero, p.bits, p.group_size)
        left = right = corr = None
        if p.rank:
            left, right = low_rank(rest - approx, p.rank, p.power_iterations)
            left, right = left.half(), right.half()
            approx = approx + left.float() @ right.float().transpose(-1, -2)
        if offset is not None:
            dim = 3 if per_channel else 4
            corr = (group_view(x, p.group_size, per_channel) - group_view(approx, p.group_size, per_channel))
            corr = corr.gather(dim, offset).half()
            # what attention reproduces: the outlier entries corrected (by their fp16-rounded values)
            approx = group_view(approx, p.group_size, per_channel).scatter_add(dim, offset, corr.float())
            approx = approx.reshape(x.shape)
            offset = offset.to(torch.uint8)
            if not per_channel:  # (B, H, n, D/G, m) -> token-major (B, H, n, D/G * m)
                offset, corr = offset.flatten(3), corr.flatten(3)
        if sink is not None:  # exact sink rows: store what the codes, factors and outliers miss
            idx, inside = sink
            sink = (self._sink_rows(x - approx, idx) * inside[:, None, :, None]).half(), inside  # (B, H, S, D)
        return codes, scale, zero, left, right, offset, corr, sink

    def _flush(self, k, v, start):
        _gear_static.sync_chunks(self)
        g = self.p.group_size
        kc, ks, kz, kl, kr, ko, kx, k_sink = self._compress(k, start, per_channel=True)
        vc, vs, vz, vl, vr, vo, vx, v_sink = self._compress(v, start, per_channel=False)
        if k_sink is not None:
            self._keep_sinks(k_sink[0], v_sink[0], k_sink[1])
        self._append_codes(start, (kc, ks, kz), (vc, vs, vz))
        grow_g = max(1, GROW // g)
        if kl is not None:
            nc = len(self.chunk_starts)
            self.kl, self.vl = append_tokens(self.kl, start, kl), append_tokens(self.vl, start, vl)
            self.kr = append_tokens(self.kr, nc, kr[:, :, None], 16)
            self.vr = append_tokens(self.vr, nc, vr[:, :, None], 16)
            if self.krb is not None:  # the same factors for each flush block of the chunk (static steps)
                b0, blocks = start // self.flush_unit, k.shape[2] // self.flush_unit
                self.krb = append_tokens(self.krb, b0, kr[:, :, None].expand(-1, -1, blocks, -1, -1), 16)
                self.vrb = append_tokens(self.vrb, b0, vr[:, :, None].expand(-1, -1, blocks, -1, -1), 16)
        if ko is not None:
            self.ko = append_tokens(self.ko, start // g, ko, grow=grow_g)
            self.kx = append_tokens(self.kx, start // g, kx, grow=grow_g)
            self.vo, self.vx = append_tokens(self.vo, start, vo), append_tokens(self.vx, start, vx)
        self.chunk_starts.append(start)
        self._chunk_ids = self._chunk_bounds = None
        self._chunked_to = start + k.shape[2]

    def _flush_state(self):
        return len(self.chunk_starts), super()._flush_state()

    def _unflush(self, state) -> None:
        chunks, sinks = state
        del self.chunk_starts[chunks:]
        self._chunked_to = self.n_quant
        self._chunk_ids = self._chunk_bounds = None
        super()._unflush(sinks)

    # ------------------------------------------------------------------ static decode (`_gear_static`)
    def _store_slots(self) -> int:
        return _gear_static.store_slots(self)

    def _reserve_store(self, like_k, like_v, slots) -> None:
        _gear_static.reserve_store(self, like_k, like_v, slots)

    def _static_packed(self, n) -> list:
        return _gear_static.static_packed(self, n)

    def _static_flush(self, n, due) -> None:
        _gear_static.static_flush(self, n, due)

    # ------------------------------------------------------------------ attention
    def _chunk_of_token(self, device) -> torch.Tensor:
        if self._chunk_ids is None:
            bounds = self.chunk_starts + [self.n_quant]
            sizes = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
            self._chunk_ids = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)
        return self._chunk_ids  # (N,) chunk of each packed token

    def _bounds(self, device) -> torch.Tensor:
        """int64 (chunks + 1,): the flushed chunks' first tokens, then ``n_quant``."""
        if self._chunk_bounds is None:
            self._chunk_bounds = torch.tensor(self.chunk_starts + [self.n_quant], dtype=torch.int64, device=device)
        return self._chunk_bounds

    def _native_parts(self, device) -> native.GearParts:
        """The low-rank factors, outliers and sink corrections as the compiled kernels take them."""
        p, n, g, nc = self.p, self.n_quant, self.p.group_size, len(self.chunk_starts)
        low, out = p.rank > 0, p.outliers_per_group > 0
        return native.GearParts(
            bounds=self._bounds(device) if low else None,
            k_low=(self.kl, self.kr[:, :, :nc]) if low else None, v_low=(self.vl, self.vr[:, :, :nc]) if low else None,
            k_out=(self.ko[:, :, : n // g], self.kx[:, :, : n // g]) if out else None,
            v_out=(self.vo[:, :, :n], self.vx[:, :, :n]) if out else None,
            sinks=None if self.sk is None else (self.sk, self.sv), sink_start=self.row_start)

    def _attend(self, q, k_new, v_new, scaling):
        _gear_static.sync_chunks(self)
        keys, values = self._views() if self.n_quant else (None, None)
        if self.native_step_ok(q, k_new, self.p.backend, [(keys, values)]):  # the whole step in one compiled call
            g = self.p.group_size
            seg = native.PackedSegment(keys, values, self.p.bits, g, g, starts=self.row_start,
                                       gear=self._native_parts(q.device))
            return self.native_decode(q, k_new, v_new, scaling, [seg])
        return super()._attend(q, k_new, v_new, scaling)

    def _dequantize_into(self, k_out, v_out):
        p, n = self.p, self.n_quant
        k, v = self._dequantized(*self._views())  # (B, H, N, D) fp32
        if p.rank:  # each flushed chunk's error factors: left (B, H, t, r) @ right (B, H, D, r)^T
            for c, (a, b) in enumerate(zip(self.chunk_starts, self.chunk_starts[1:] + [n])):
                k[:, :, a:b] += self.kl[:, :, a:b].float() @ self.kr[:, :, c].float().transpose(-1, -2)
                v[:, :, a:b] += self.vl[:, :, a:b].float() @ self.vr[:, :, c].float().transpose(-1, -2)
        if p.outliers_per_group:
            k, v = _gear_static.add_outliers(self, k, v, n)
        if self.sk is not None:  # what the parts above miss on the sinks (zero until flushed)
            col = self._sink_columns(k.shape[0], k.device)[0]
            idx = col[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, H, S, D)
            k.scatter_add_(2, idx, self.sk.float())
            v.scatter_add_(2, idx, self.sv.float())
        k_out.copy_(k)
        v_out.copy_(v)
        return True

    def _quant_scores(self, qg, scaling):
        p, n, g = self.p, self.n_quant, self.p.group_size
        q = qg * scaling
        keys = self._views()[0]
        if reads_natively(q, *keys, p.backend):  # low-rank, outliers and sinks in one compiled call too
            s = native.channel_scores(q, *keys, p.bits, g)
            return self.mask_padding_scores(native.gear_key_extra(s, q, g, self._native_parts(q.device)))
        s = channel_quant_scores(q, *keys, p.bits, g, backend="torch")
        if p.rank:
            nc = len(self.chunk_starts)
            qr = torch.einsum("bhmd,bhcdr->bhmcr", q, self.kr[:, :, :nc].float())  # (B, H, M, C, r)
            qr_t = qr[:, :, :, self._chunk_of_token(q.device)]  # (B, H, M, N, r)
            s = s + (qr_t * self.kl[:, :, None, :n].float()).sum(-1)
        if p.outliers_per_group:
            M = q.shape[2]
            step = max(1, _outlier_chunk(q) // g)  # token groups per pass: bounds the (B, H, M, O) temporaries
            for g0 in range(0, n // g, step):
                g1 = min(n // g, g0 + step)
                tok, chan = outlier_positions(self.ko[:, :, g0:g1].long(), g, True, g0)  # (B, H, O)
                corr = self.kx[:, :, g0:g1].float().flatten(2)  # (B, H, O)
                contrib = q.gather(-1, chan[:, :, None].expand(-1, -1, M, -1)) * corr[:, :, None]  # (B, H, M, O)
                s = s.scatter_add(-1, tok[:, :, None].expand(-1, -1, M, -1), contrib)
        if self.sk is not None:  # sink rows not flushed yet have a zero correction: any in-range column will do
            s = s.scatter_add(-1, self._sink_index(s)[0], q @ self.sk.float().transpose(-1, -2))  # (B, H, M, S)
        return self.mask_padding_scores(s)

    def _quant_output(self, prob):
        p, n, g = self.p, self.n_quant, self.p.group_size
        values = self._views()[1]
        if reads_natively(prob, *values, p.backend):  # low-rank, outliers and sinks in one compiled call too
            out = native.token_values(prob, *values, p.bits, g)
            return native.gear_value_extra(out, prob, g, self._native_parts(prob.device))
        out = token_quant_values(prob, *values, p.bits, g, backend="torch")
        if p.rank:
            nc = len(self.chunk_starts)
            # each chunk's sum of p_t * L_t, from a running sum over the tokens (the last axis: a
            # scan along an outer axis took 2 ms per layer at 32k on an H200, and an index_add_ into
            # the few chunk rows, which serializes its atomics, 1.6 ms; benchmarks/gpu/profile_decode.py)
            pl = prob[:, :, :, None] * self.vl[:, :, :n].float().transpose(-1, -2)[:, :, None]  # (B, H, M, r, N)
            run = torch.nn.functional.pad(pl.cumsum(-1), (1, 0))  # run[..., t]: the sum over the tokens before t
            bounds = self._bounds(prob.device)
            per_chunk = (run.index_select(-1, bounds[1:]) - run.index_select(-1, bounds[:-1])).transpose(-1, -2)
            out = out + torch.einsum("bhmcr,bhcdr->bhmd", per_chunk, self.vr[:, :, :nc].float())
        if p.outliers_per_group:
            M, D = prob.shape[2], out.shape[-1]
            chunk = _outlier_chunk(prob)
            for t0 in range(0, n, chunk):
                t1 = min(n, t0 + chunk)
                off = self.vo[:, :, t0:t1].long().unflatten(3, (D // g, p.outliers_per_group))
                tok, chan = outlier_positions(off, g, False, t0)  # (B, H, O), O = t * D/G * m
                corr = self.vx[:, :, t0:t1].float().flatten(2)
                contrib = prob.gather(-1, tok[:, :, None].expand(-1, -1, M, -1)) * corr[:, :, None]  # (B, H, M, O)
                out = out.scatter_add(-1, chan[:, :, None].expand(-1, -1, M, -1), contrib)
        if self.sv is not None:
            out = out + prob.gather(-1, self._sink_index(prob)[0]) @ self.sv.float()  # (B, H, M, S) @ (B, H, S, D)
        return out

    def _quant_tensors(self):
        return {**super()._quant_tensors(), "kl": self.kl, "vl": self.vl, "kr": self.kr, "vr": self.vr,
                "ko": self.ko, "kx": self.kx, "vo": self.vo, "vx": self.vx, "krb": self.krb, "vrb": self.vrb}
