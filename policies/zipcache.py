"""``zipcache``: mixed-precision KV quantization driven by normalised attention saliency."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.kernels.quant import check_quant_config, quantize_per_token, token_quant_scores, token_quant_values
from kvpress.registry import Policy, check_int, register_policy

from ._quant import QuantWindowLayer, append_tokens


@register_policy
@dataclass(frozen=True)
class ZipCachePolicy(Policy):
    """ZipCache: salient tokens at ``bits_high`` bits, the rest at ``bits_low`` bits.

    He et al., "ZipCache: Accurate and Efficient KV Cache Quantization with Salient Token
    Identification", arXiv 2405.14256.

    * Keys use channel-separable token-wise quantization: each channel is divided by
      ``c_d = sqrt(max_t |k_td|)`` (fixed at the first flush), then quantized per token in
      groups of ``group_size`` channels; attention multiplies the query by ``c`` instead of
      un-normalising keys. Values are quantized per token.
    * Saliency of a token = attention it received, summed over probe queries and the query
      heads of its KV group, divided by how many probes could attend to it (the normalisation
      that removes the causal bias towards early tokens). Probes are ``probe_recent`` recent
      queries plus ``probe_random`` random prompt queries, scored against the keys with their
      own log-sum-exp, so prefill itself stays plain dense attention.
    * At every flush (the prompt, then every ``flush_size`` decoded tokens) the
      ``salient_ratio`` most salient flushed tokens of each KV head go to the high-precision
      store and the rest to the low-precision store: saliency is re-estimated periodically
      during decode from the most recent queries.

    The prompt's probes need its queries, which a shared dense prefill does not keep, so this
    policy runs its own prefill (``full_prefill = False``). No token budget (``with_budget``
    raises).
    """

    bits_high: int = 4
    bits_low: int = 2
    salient_ratio: float = 0.2
    group_size: int = 64
    residual_length: int = 128
    flush_size: int = 64
    probe_recent: int = 16
    probe_random: int = 16
    seed: int = 0

    name = "zipcache"
    description = "mixed 4/2-bit KV quantization of salient / other tokens, probe-query saliency (ZipCache)"
    paper = "arXiv 2405.14256"
    full_prefill = False
    keeps_full_cache = False

    def validate(self):
        check_quant_config(self.bits_high, self.group_size)
        check_quant_config(self.bits_low, self.group_size)
        if self.bits_low > self.bits_high:
            raise ValueError(f"bits_low={self.bits_low} must not exceed bits_high={self.bits_high}")
        if not 0.0 <= self.salient_ratio <= 1.0:
            raise ValueError(f"salient_ratio={self.salient_ratio!r} is out of range; allowed: 0 <= salient_ratio <= 1")
        check_int("residual_length", self.residual_length, 0)
        check_int("flush_size", self.flush_size, 1)
        check_int("probe_recent", self.probe_recent, 1)
        check_int("probe_random", self.probe_random, 0)

    def check_model(self, adapter):
        check_quant_config(self.bits_low, self.group_size, adapter.head_dim)

    def make_layer(self, cache, layer_idx):
        return ZipCacheLayer(cache, layer_idx, self)

    @classmethod
    def example(cls, adapter):
        return cls(group_size=8, residual_length=16, flush_size=8, probe_recent=4, probe_random=4, salient_ratio=0.5)


class _Store:
    """Token-wise packed codes of one precision: keys (normalised) and values, plus the number
    of left-padding tokens per (row, head), which always sit first (tokens keep sequence order)."""

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size
        self.n = 0
        self.t = dict.fromkeys(("kc", "ks", "kz", "vc", "vs", "vz"))
        self.pad = None  # int32 (B, H)

    def add(self, k, v, pad_count):
        kc, ks, kz = quantize_per_token(k, self.bits, self.group_size)
        vc, vs, vz = quantize_per_token(v, self.bits, self.group_size)
        for name, x in zip(self.t, (kc, ks, kz, vc, vs, vz)):
            self.t[name] = append_tokens(self.t[name], self.n, x)
        self.pad = pad_count if self.pad is None else self.pad + pad_count
        self.n += k.shape[2]

    def scores(self, q):
        n = self.n
        s = token_quant_scores(q, self.t["kc"][:, :, :n], self.t["ks"][:, :, :n], self.t["kz"][:, :, :n],
                               self.bits, self.group_size)
        pad = torch.arange(n, device=q.device)[None, None, :] < self.pad[:, :, None]  # (B, H, n)
        return s.masked_fill(pad[:, :, None], float("-inf"))

    def output(self, p):
        n = self.n
        return token_quant_values(p, self.t["vc"][:, :, :n], self.t["vs"][:, :, :n], self.t["vz"][:, :, :n],
                                  self.bits, self.group_size)


class ZipCacheLayer(QuantWindowLayer):
    """Two token-wise stores (``hi_*``, ``lo_*`` in ``state_tensors``), the key channel
    normaliser ``kn`` fp16 (B, H, D), and the probe queries ``probe_q`` (B, H_q, P, D) with
    their log-sum-exp ``probe_lse`` fp32 (B, H_q, P) and sequence indices ``probe_pos`` (P,)."""

    def __init__(self, cache, layer_idx, policy: ZipCachePolicy):
        super().__init__(cache, layer_idx, policy.residual_length, flush_unit=policy.flush_size)
        self.p = policy
        self.hi = _Store(policy.bits_high, policy.group_size)
        self.lo = _Store(policy.bits_low, policy.group_size)
        self.kn = None
        self.probe_q = self.probe_lse = self.probe_pos = None
        self._random_end, self._scaling = 0, 1.0

    # ------------------------------------------------------------------ probes
    def _prefill(self, q, k, v, scaling):
        B, H_q, T, D = q.shape
        H = k.shape[1]
        n_recent = min(self.p.probe_recent, T)
        older = T - n_recent
        gen = torch.Generator().manual_seed(self.p.seed + self.layer_idx)
        rand = torch.randperm(older, generator=gen)[: self.p.probe_random].sort().values if older else torch.zeros(0)
        pos = torch.cat([rand.long(), torch.arange(older, T)]).to(q.device)  # (P,)
        qp = q[:, :, pos].float()  # (B, H_q, P, D)
        s = (qp.view(B, H, H_q // H, -1, D) @ k.float()[:, :, None].transpose(-1, -2)) * scaling  # (B, H, G, P, T)
        hidden = torch.arange(T, device=q.device)[None, :] > pos[:, None]  # (P, T)
        pad = self.padding_mask(0, T, q.device)
        if pad is not None:
            hidden = hidden[None] | pad[:, None, :]  # (B, P, T)
            hidden = hidden[:, None, None]
        lse = s.masked_fill(hidden, float("-inf")).logsumexp(-1).view(B, H_q, -1)
        self.probe_q, self.probe_lse, self.probe_pos = q[:, :, pos], lse, pos
        self._random_end, self._scaling = older, scaling
        super()._prefill(q, k, v, scaling)

    def _after_attend(self, q, lse, q_start, scaling):
        T = q.shape[2]
        q_all = torch.cat([self.probe_q, q.to(self.probe_q.dtype)], 2)
        lse_all = torch.cat([self.probe_lse, lse], 2)
        pos_all = torch.cat([self.probe_pos, torch.arange(q_start, q_start + T, device=q.device)])
        # the `probe_recent` latest queries, plus the random prompt probes, while they can still
        # attend an unflushed token
        keep = ((pos_all >= self.seen - self.p.probe_recent) | (pos_all < self._random_end)) & (pos_all >= self.n_quant)
        self.probe_q, self.probe_lse, self.probe_pos = q_all[:, :, keep], lse_all[:, :, keep], pos_all[keep]

    def saliency(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """Normalised attention (B, H, n) received by tokens ``start ..`` with keys k (B, H, n, D)."""
        B, H, n, D = k.shape
        H_q, P = self.probe_q.shape[1], self.probe_q.shape[2]
        qp = self.probe_q.float().view(B, H, H_q // H, P, D)
        s = (qp @ k.float()[:, :, None].transpose(-1, -2)) * self._scaling  # (B, H, G, P, n)
        prob = torch.exp(s - self.probe_lse.view(B, H, H_q // H, P)[..., None])
        pos = torch.arange(start, start + n, device=k.device)
        seen_by = self.probe_pos[:, None] >= pos[None, :]  # (P, n) probe can attend token
        pad = self.padding_mask(start, n, k.device)
        rs = self.row_start
        probe_real = torch.ones(B, P, dtype=torch.bool, device=k.device) if rs is None else \
            self.probe_pos[None, :] >= rs[:, None]  # padded probes attended only to themselves
        valid = seen_by[None] & probe_real[:, :, None]  # (B, P, n)
        total = (prob * valid[:, None, None]).sum((2, 3))  # (B, H, n)
        count = valid.sum(1).clamp(min=1) * (H_q // H)  # (B, n)
        sal = total / count[:, None, :]
        sal = torch.where(valid.any(1)[:, None, :], sal, torch.full_like(sal, float("inf")))  # unseen: keep precise
        if pad is not None:
            sal = sal.masked_fill(pad[:, None, :], float("-inf"))
        return sal

    # ------------------------------------------------------------------ storage
    def _flush(self, k, v, start):
        B, H, n, D = k.shape
        if self.kn is None:
            kabs = self.zero_padding(k, start).float().abs().amax(2)  # (B, H, D)
            self.kn = torch.where(kabs > 0, kabs.sqrt(), torch.ones_like(kabs)).half()
        kn = self.kn.float()[:, :, None]
        k_norm = self.zero_padding(k, start).float() / kn
        v = self.zero_padding(v, start)
        n_hi = int(round(self.p.salient_ratio * n))
        sal = self.saliency(k, start) if 0 < n_hi < n else torch.zeros(B, H, n, device=k.device)
        order = sal.argsort(dim=-1, descending=True, stable=True)
        hi_idx, lo_idx = order[..., :n_hi].sort(-1).values, order[..., n_hi:].sort(-1).values  # sequence order
        pad = self.padding_mask(start, n, k.device)
        for store, idx in ((self.hi, hi_idx), (self.lo, lo_idx)):
            if idx.shape[-1] == 0:
                if store.pad is None:
                    store.pad = torch.zeros(B, H, dtype=torch.int32, device=k.device)
                continue
            gi = idx[..., None].expand(-1, -1, -1, D)
            n_pad = torch.zeros(B, H, dtype=torch.int32, device=k.device) if pad is None else \
                torch.gather(pad[:, None, :].expand(-1, H, -1), 2, idx).sum(-1).to(torch.int32)
            store.add(torch.gather(k_norm, 2, gi), torch.gather(v, 2, gi), n_pad)

    def _quant_scores(self, qg, scaling):
        q = qg * scaling * self.kn.float()[:, :, None]
        parts = [s.scores(q) for s in (self.hi, self.lo) if s.n]
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]

    def _quant_output(self, p):
        out, i = 0, 0
        for s in (self.hi, self.lo):
            if s.n:
                out = out + s.output(p[..., i : i + s.n])
                i += s.n
        return out

    def batch_select(self, indices):
        sel = lambda t: None if t is None else t.index_select(0, indices.to(t.device))  # noqa: E731
        self.k_win, self.v_win, self.kn = sel(self.k_win), sel(self.v_win), sel(self.kn)
        self.probe_q, self.probe_lse = sel(self.probe_q), sel(self.probe_lse)
        for store in (self.hi, self.lo):
            store.t = {k: sel(v) for k, v in store.t.items()}
            store.pad = sel(store.pad)

    def _quant_tensors(self):
        out = {"kn": self.kn, "probe_q": self.probe_q, "probe_lse": self.probe_lse, "probe_pos": self.probe_pos}
        for prefix, s in (("hi", self.hi), ("lo", self.lo)):
            out.update({f"{prefix}_{k}": v for k, v in s.t.items()})
            out[f"{prefix}_pad"] = s.pad
        return out
