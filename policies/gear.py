"""``gear``: low-bit quantization + low-rank error correction + exact sparse outliers."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpress.kernels.quant import (channel_quant_scores, check_quant_config, dequantize_per_channel,
                                   dequantize_per_token, quantize_per_channel, quantize_per_token,
                                   token_quant_values)
from kvpress.registry import Policy, check_int, register_policy

from ._quant import QuantWindowLayer, append_tokens


@register_policy
@dataclass(frozen=True)
class GearPolicy(Policy):
    """GEAR: KIVI-style ``bits``-bit codes, plus a rank-``rank`` approximation of the quantization
    error per KV head (power iteration), plus a sparse set of outlier entries kept exactly.

    Kang et al., "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative
    Inference of LLM", arXiv 2403.05527. For every flushed chunk (the prompt, then every
    ``flush_size`` decoded tokens) and KV head: the ``outlier_ratio`` fraction of entries that
    lie furthest from their quantization group's centre (z-score over the group's axis: tokens
    for keys, channels for values) is removed, the rest is quantized as in KIVI, the residual
    ``X - dequant`` is approximated as ``L @ R.T`` (``L`` (n, rank), ``R`` (D, rank), fp16) by
    ``power_iterations`` steps of subspace iteration, and the outliers store ``X - dequant - L R^T``
    at their (int32 flat index) positions, so they are reproduced exactly up to fp16 rounding.
    Attention applies all three parts without materialising keys or values: packed codes
    through ``kvpress.kernels.quant``, the low-rank part as ``(q R) L^T``, the outliers by
    gather/scatter. No token budget (``with_budget`` raises).
    """

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    flush_size: int = 128
    rank: int = 1
    outlier_ratio: float = 0.01
    power_iterations: int = 3

    name = "gear"
    description = "low-bit KV quantization + low-rank error + sparse outliers (GEAR)"
    paper = "arXiv 2403.05527"
    full_prefill = True
    keeps_full_cache = False

    def validate(self):
        check_quant_config(self.bits, self.group_size)
        check_int("residual_length", self.residual_length, 0)
        check_int("flush_size", self.flush_size, self.group_size)
        if self.flush_size % self.group_size:
            raise ValueError(f"flush_size={self.flush_size} must be a multiple of group_size={self.group_size}")
        check_int("rank", self.rank, 0, 64)
        check_int("power_iterations", self.power_iterations, 1, 20)
        if not 0.0 <= self.outlier_ratio <= 0.5:
            raise ValueError(f"outlier_ratio={self.outlier_ratio!r} is out of range; allowed: 0 <= outlier_ratio <= 0.5")

    def check_model(self, adapter):
        check_quant_config(self.bits, self.group_size, adapter.head_dim)
        if self.rank > adapter.head_dim:
            raise ValueError(f"rank={self.rank} exceeds head_dim={adapter.head_dim}")

    def make_layer(self, cache, layer_idx):
        return GearLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(bits=4, group_size=8, residual_length=16, flush_size=8, rank=2, outlier_ratio=0.02)


def low_rank(e: torch.Tensor, rank: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors of ``e`` (B, H, n, D) by subspace (power) iteration.

    Returns ``L`` (B, H, n, rank) with orthonormal columns and ``R = e^T L`` (B, H, D, rank), so
    ``L @ R^T`` is the projection of ``e`` onto its estimated top singular subspace. The start
    matrix is drawn from a fixed seed, so results are deterministic.
    """
    B, H, n, D = e.shape
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(D, rank, generator=gen).to(e.device).expand(B, H, D, rank)
    for _ in range(iterations):
        left, _ = torch.linalg.qr(e @ r)  # (B, H, n, rank)
        r = e.transpose(-1, -2) @ left  # (B, H, D, rank)
    return left, r


def _outliers(x: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """Flat indices (B, H, count) of the entries of x (B, H, n, D) furthest from their group mean
    along ``dim``, in units of that group's standard deviation."""
    z = (x - x.mean(dim, keepdim=True)).abs() / (x.std(dim, keepdim=True, unbiased=False) + 1e-6)
    return z.flatten(2).topk(count, dim=-1).indices


class GearLayer(QuantWindowLayer):
    """KIVI store (``kc, ks, kz, vc, vs, vz``) + low-rank error factors + outliers.

    ``kl`` / ``vl`` fp16 (B, H, cap, rank): left factors, token-aligned; ``kr`` / ``vr`` fp16
    (B, H, chunks, D, rank): right factors of each flushed chunk (chunk bounds in
    ``chunk_starts``); ``ki`` / ``vi`` int32 (B, H, n_out): flat index ``token * D + channel``
    of each outlier, ``kx`` / ``vx`` fp16 (B, H, n_out): its correction.
    """

    def __init__(self, cache, layer_idx, policy: GearPolicy):
        super().__init__(cache, layer_idx, policy.residual_length, flush_unit=policy.flush_size)
        self.p = policy
        self.kc = self.ks = self.kz = self.vc = self.vs = self.vz = None
        self.kl = self.vl = self.kr = self.vr = None
        self.ki = self.vi = self.kx = self.vx = None
        self.n_out = 0
        self.chunk_starts: list[int] = []
        self._chunk_ids = None

    # ------------------------------------------------------------------ compression
    def _compress(self, x, start, per_channel: bool):
        """-> codes, scale, zero, left, right, outlier flat index, outlier correction."""
        p = self.p
        B, H, n, D = x.shape
        x = self.zero_padding(x, start).float()
        count = math.ceil(p.outlier_ratio * n * D)
        dim = 2 if per_channel else 3
        idx = _outliers(x, dim, count) if count else None
        rest = x
        if count:  # outliers do not stretch their group's range: replace them by the group mean
            rest = x.flatten(2).scatter(-1, idx, x.mean(dim, keepdim=True).expand_as(x).flatten(2).gather(-1, idx))
            rest = rest.view(B, H, n, D)
        if per_channel:
            codes, scale, zero = quantize_per_channel(rest, p.bits, p.group_size)
            deq = dequantize_per_channel(codes, scale, zero, p.bits, p.group_size)
        else:
            codes, scale, zero = quantize_per_token(rest, p.bits, p.group_size)
            deq = dequantize_per_token(codes, scale, zero, p.bits, p.group_size)
        approx = deq
        left = right = None
        if p.rank:
            left, right = low_rank(rest - deq, p.rank, p.power_iterations)
            left, right = left.half(), right.half()
            approx = deq + left.float() @ right.float().transpose(-1, -2)
        corr = None
        if count:
            corr = (x.flatten(2).gather(-1, idx) - approx.flatten(2).gather(-1, idx)).half()
            idx = (idx + start * D).to(torch.int32)
        return codes, scale, zero, left, right, idx, corr

    def _flush(self, k, v, start):
        g = self.p.group_size
        kc, ks, kz, kl, kr, ki, kx = self._compress(k, start, per_channel=True)
        vc, vs, vz, vl, vr, vi, vx = self._compress(v, start, per_channel=False)
        self.kc, self.vc = append_tokens(self.kc, start, kc), append_tokens(self.vc, start, vc)
        self.vs, self.vz = append_tokens(self.vs, start, vs), append_tokens(self.vz, start, vz)
        self.ks = append_tokens(self.ks, start // g, ks, grow=max(1, 256 // g))
        self.kz = append_tokens(self.kz, start // g, kz, grow=max(1, 256 // g))
        if kl is not None:
            nc = len(self.chunk_starts)
            self.kl, self.vl = append_tokens(self.kl, start, kl), append_tokens(self.vl, start, vl)
            self.kr, self.vr = append_tokens(self.kr, nc, kr[:, :, None], 16), append_tokens(self.vr, nc, vr[:, :, None], 16)
        if ki is not None:
            m = self.n_out
            self.ki, self.vi = append_tokens(self.ki, m, ki, 1024), append_tokens(self.vi, m, vi, 1024)
            self.kx, self.vx = append_tokens(self.kx, m, kx, 1024), append_tokens(self.vx, m, vx, 1024)
            self.n_out += ki.shape[2]
        self.chunk_starts.append(start)
        self._chunk_ids = None

    # ------------------------------------------------------------------ attention
    def _chunk_of_token(self, device) -> torch.Tensor:
        if self._chunk_ids is None:
            bounds = self.chunk_starts + [self.n_quant]
            sizes = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
            self._chunk_ids = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)
        return self._chunk_ids  # (N,) chunk of each packed token

    def _quant_scores(self, qg, scaling):
        p, n, g = self.p, self.n_quant, self.p.group_size
        q = qg * scaling
        s = channel_quant_scores(q, self.kc[:, :, :n], self.ks[:, :, : n // g], self.kz[:, :, : n // g], p.bits, g)
        if p.rank:
            nc = len(self.chunk_starts)
            qr = torch.einsum("bhmd,bhcdr->bhmcr", q, self.kr[:, :, :nc].float())  # (B, H, M, C, r)
            qr_t = qr[:, :, :, self._chunk_of_token(q.device)]  # (B, H, M, N, r)
            s = s + (qr_t * self.kl[:, :, None, :n].float()).sum(-1)
        if self.n_out:
            D = q.shape[-1]
            idx = self.ki[:, :, : self.n_out].long()  # (B, H, O)
            M = q.shape[2]
            contrib = q.gather(-1, (idx % D)[:, :, None].expand(-1, -1, M, -1)) * self.kx[:, :, None, : self.n_out].float()
            s = s.scatter_add(-1, (idx // D)[:, :, None].expand(-1, -1, M, -1), contrib)
        return self.mask_padding_scores(s)

    def _quant_output(self, prob):
        p, n = self.p, self.n_quant
        out = token_quant_values(prob, self.vc[:, :, :n], self.vs[:, :, :n], self.vz[:, :, :n], p.bits, p.group_size)
        if p.rank:
            nc = len(self.chunk_starts)
            pl = prob[..., None] * self.vl[:, :, None, :n].float()  # (B, H, M, N, r)
            per_chunk = pl.new_zeros(*pl.shape[:3], nc, p.rank).index_add_(3, self._chunk_of_token(prob.device), pl)
            out = out + torch.einsum("bhmcr,bhcdr->bhmd", per_chunk, self.vr[:, :, :nc].float())
        if self.n_out:
            D = out.shape[-1]
            idx = self.vi[:, :, : self.n_out].long()
            M = prob.shape[2]
            contrib = prob.gather(-1, (idx // D)[:, :, None].expand(-1, -1, M, -1)) * self.vx[:, :, None, : self.n_out].float()
            out = out.scatter_add(-1, (idx % D)[:, :, None].expand(-1, -1, M, -1), contrib)
        return out

    def _quant_tensors(self):
        return {"kc": self.kc, "ks": self.ks, "kz": self.kz, "vc": self.vc, "vs": self.vs, "vz": self.vz,
                "kl": self.kl, "vl": self.vl, "kr": self.kr, "vr": self.vr,
                "ki": self.ki, "vi": self.vi, "kx": self.kx, "vx": self.vx}
