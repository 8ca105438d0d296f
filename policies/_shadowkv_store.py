"""Host tier of ShadowKV (arXiv 2410.21465): the prompt's values (and key tables) in chunk-contiguous
layout off the accelerator, only the chunks a step selects copied back; consecutive steps select
mostly the same chunks, so the previous step's are reused and only the missing ones cross the link
(pinned memory on CUDA; on CPU a separate tensor, the traffic counted the same way). Also the
truncated SVD of the pre-RoPE keys that stays on the device (`low_rank`) and the key residual."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class TransferCounters:
    """Host -> device traffic of one layer: ``steps`` (fetches from the host tier: decode steps, and
    new turns, which fetch every selectable chunk once for their dense pass), ``requested_chunks``
    (selected chunks summed over steps, rows and KV heads), ``reused_chunks`` (of those, chunks
    already on the device from the previous step), ``fetched_bytes`` (copied from the host tier)
    and ``last_fetched_bytes`` (by the latest step)."""

    steps: int = 0
    requested_chunks: int = 0
    reused_chunks: int = 0
    fetched_bytes: int = 0
    last_fetched_bytes: int = 0

    @property
    def reuse_rate(self) -> float:
        """Fraction of selected chunks served from the device copy of the previous step."""
        return self.reused_chunks / self.requested_chunks if self.requested_chunks else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "requested_chunks": self.requested_chunks, "reused_chunks": self.reused_chunks,
                "fetched_bytes": self.fetched_bytes, "reuse_rate": self.reuse_rate,
                "fetched_bytes_per_step": self.fetched_bytes / self.steps if self.steps else 0.0}


def to_host(values: torch.Tensor) -> torch.Tensor:
    """A host-tier copy of ``values``: pinned CPU memory for CUDA tensors, a fresh CPU tensor otherwise."""
    return torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda).copy_(values.detach())


def fetch_tables(hosts, chunk_idx: torch.Tensor, prev_idx: torch.Tensor | None, prevs, counters: TransferCounters,
                 device: torch.device) -> list[torch.Tensor]:
    """The selected chunks of each host-tier table on ``device``, reusing the previous step's copies:
    one plan for every table (values; with ``fetch_keys`` exact keys, with ``residual_bits`` the
    keys' residual), one step counted in ``counters`` (its chunks once, the bytes of every table).

    ``hosts``: tables (B, H_kv, C, chunk_size, D_i) on the host; ``chunk_idx``: int32 (B, H_kv, K)
    on ``device``, -1 for empty slots (zeros there, nothing fetched); ``prev_idx`` (B, H_kv, K') the
    previous step's selection and ``prevs`` its copies of each table, or None. Returns a list of
    (B, H_kv, K, chunk_size, D_i) on ``device``, one per table.
    """
    B, H, C, cs = hosts[0].shape[:4]
    K, BH = chunk_idx.shape[2], B * H
    ids = chunk_idx.long().view(BH, K)
    valid = ids >= 0  # (BH, K)
    # every slot is one row of a table [previous copies | fetched chunks | a zero row] (one
    # index_select builds the result: no scatter into zeros, no 5-D gather)
    K_prev = 0 if prev_idx is None or any(p is None for p in prevs) else prev_idx.shape[2]
    found = torch.zeros_like(valid)
    prev_slot = ids  # (unused without a previous step)
    if K_prev and K:
        key, order = torch.where(prev_idx >= 0, prev_idx, C).long().view(BH, K_prev).sort(dim=-1)  # -1 -> C, last
        pos = torch.searchsorted(key, torch.where(valid, ids, C + 1)).clamp_(max=K_prev - 1)
        found = (key.gather(1, pos) == ids) & valid
        prev_slot = order.gather(1, pos)  # (BH, K) the previous step's slot of each chunk
    need = valid & ~found
    # the rows the host gathers, worked out on the host from one copy of ids and need (on CUDA the
    # step's one sync, which the host-side gather needs anyway)
    ids_h, need_h = torch.stack([ids, need.long()]).cpu().unbind(0)
    host_rows = (torch.arange(BH)[:, None] * C + ids_h)[need_h.bool()]  # (M,) row-major over (BH, K)
    M, requested = host_rows.numel(), int((ids_h >= 0).sum())
    fresh = BH * K_prev + need.view(-1).cumsum(0).view(BH, K) - 1  # row of each fetched chunk in the table
    rows_of = torch.arange(BH, device=device)[:, None]  # (BH, 1)
    index = torch.where(found, rows_of * K_prev + prev_slot, torch.where(need, fresh, BH * K_prev + M)).view(-1)
    outs, fetched_bytes = [], 0
    for host, prev in zip(hosts, prevs):
        width = cs * host.shape[-1]
        parts = [] if not K_prev else [prev.reshape(BH * K_prev, width)]
        if M:  # the host-side gather; for CUDA straight into pinned memory (no second host copy)
            src = host.view(BH * C, width)
            if device.type == "cuda":
                rows = torch.empty(M, width, dtype=host.dtype, pin_memory=True)
                rows = torch.index_select(src, 0, host_rows, out=rows).to(device, non_blocking=True)
            else:
                rows = src.index_select(0, host_rows)
            parts.append(rows)
            fetched_bytes += rows.numel() * rows.element_size()
        parts.append(torch.zeros(1, width, dtype=host.dtype, device=device))
        table = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        outs.append(table.index_select(0, index).view(B, H, K, cs, host.shape[-1]))
    counters.steps += 1
    counters.requested_chunks += requested
    counters.reused_chunks += requested - M
    counters.fetched_bytes += fetched_bytes
    counters.last_fetched_bytes = fetched_bytes
    return outs


def transfer_summary(cache) -> dict:
    """Host-tier traffic summed over a ShadowKV cache's layers (fetched bytes per step, reuse rate)."""
    layers = [l for l in cache.layers if isinstance(getattr(l, "counters", None), TransferCounters)]
    total = TransferCounters(*(sum(getattr(l.counters, f.name) for l in layers) for f in fields(TransferCounters)))
    total.steps = max((l.counters.steps for l in layers), default=0)
    return {**total.as_dict(), "max_attended": max((getattr(l, "max_attended", 0) for l in cache.layers), default=0)}


def default_rank(key_dim: int, head_dim: int) -> int:
    """Components kept when ``rank`` is None: a quarter of ``key_dim = num_kv_heads * head_dim``, and
    at least half of one head's ``head_dim`` (a model with few KV heads has little redundancy across
    them to factor away)."""
    return max(1, key_dim // 4, head_dim // 2)


def low_rank(k_pre: torch.Tensor, rope_start: torch.Tensor | None, rank: int, num_kv_heads: int, dtype,
             weights: torch.Tensor | None = None, count: torch.Tensor | None = None):
    """Truncated SVD of each row's real tokens: factor (B, T_pad, rank), basis (B, rank, H_kv, D).

    Each row is factored on its own real tokens only (from ``rope_start``; None: all) and short
    rows are zero-padded to ``rank`` components, so a left-padded row of a batch gets the same
    factors as the same prompt run alone. ``count`` (a [1] device tensor, the static fold's): the
    rows past it are zeros and the components past ``min(count, H_kv * D)`` are dropped, as an SVD
    of ``count`` rows has none.

    ``weights`` (B, H_kv * D), positive: the SVD is taken in the metric ``sum_c w_c e_c^2`` of the
    error ``e`` (keys scaled by ``sqrt(w)`` per channel, the scale taken back out of the basis), so
    the basis rows are orthonormal in that metric; `project` puts new keys on it.
    """
    B, T_pad, HD = k_pre.shape
    factor = k_pre.new_zeros(B, T_pad, rank)
    basis = k_pre.new_zeros(B, rank, HD)
    scale = None if weights is None else weights.float().sqrt()  # (B, HD)
    starts = [0] * B if rope_start is None else rope_start.tolist()
    groups = [list(range(B))] if len(set(starts)) == 1 else [[b] for b in range(B)]
    for rows in groups:
        first = starts[rows[0]]
        keys = k_pre[rows, first:] if scale is None else k_pre[rows, first:] * scale[rows, None]
        u, s, vh = torch.linalg.svd(keys, full_matrices=False)  # (n, L, m), (n, m), (n, m, HD)
        r = min(rank, s.shape[-1])
        ok = 1 if count is None else (torch.arange(r, device=s.device) < torch.clamp(count, max=HD)).to(s.dtype)
        factor[rows, first:, :r] = u[..., :r] * (s[:, None, :r] * ok)
        basis[rows, :r] = (vh[:, :r] if scale is None else vh[:, :r] / scale[rows, None]) * (
            ok if count is None else ok[:, None])
    return factor.to(dtype), basis.view(B, rank, num_kv_heads, HD // num_kv_heads).to(dtype)


def project(k_pre: torch.Tensor, basis: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Factors (B, n, R) of pre-RoPE keys ``k_pre`` (B, n, H_kv * D) on a `low_rank` basis (B, R, H_kv, D)
    made with ``weights`` (B, H_kv * D) or None: the closest keys the basis spans, in its metric."""
    B, R = basis.shape[:2]
    k = k_pre if weights is None else k_pre * weights.float()[:, None]
    return k @ basis.float().reshape(B, R, -1).transpose(1, 2)


def query_pair_weights(q_sq: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-channel key weights (B, H_kv * D) from the queries' squares ``q_sq`` (B, H_kv, T, D)
    (mean over each KV head's query group) at the positions ``real`` (B, T) bool: their mean
    over those positions, averaged over each rotary pair (``c``, ``c + D / 2``) -- RoPE rotates a
    pair by the relative position, so the pair's total is what every relative position sees,
    and it is the same before and after RoPE. A floor of 1e-6 of the row's mean keeps every
    channel in the metric."""
    B, H, T, D = q_sq.shape
    m = real[:, None, :, None].to(q_sq.dtype)
    ms = (q_sq * m).sum(2) / m.sum(2).clamp_min(1)  # (B, H, D)
    w = ((ms + ms.roll(D // 2, dims=-1)) / 2).reshape(B, H * D)
    return torch.maximum(w, 1e-6 * w.mean(-1, keepdim=True).clamp_min(1e-30))


def residual_table(keys: torch.Tensor, rebuilt: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The host-tier table of ``residual_bits``: ``keys - rebuilt`` (B, H_kv, T, D; the exact and
    the low-rank post-RoPE keys) quantized per token in groups of ``group_size`` channels, as uint8
    rows (B, H_kv, T, D * bits / 8 + 4 * D / group_size): the packed codes, then the fp16 scales
    and zero points as bytes (one table, so one fetch carries all three)."""
    from kvpress.kernels.quant import quantize_per_token

    codes, scale, zero = quantize_per_token(keys.float() - rebuilt.float(), bits, group_size)
    return torch.cat([codes, scale.view(torch.uint8), zero.view(torch.uint8)], dim=-1)


def add_residual(keys: torch.Tensor, table: torch.Tensor, bits: int, group_size: int,
                 backend: str = "auto") -> torch.Tensor:
    """``keys`` (B, H_kv, n, D) plus the residual whose `residual_table` rows ``table`` (B, H_kv,
    n, W) carries, in ``keys``' dtype. A zero row (an empty slot) adds nothing. fp32 CPU tensors
    take the compiled `kvpress.kernels.native.add_residual` (one pass instead of ~10 torch ops)
    unless ``backend="torch"``; the torch code below is its reference."""
    from kvpress.kernels import native
    from kvpress.kernels.backend import residual_backend
    from kvpress.kernels.quant import unpack_codes

    if residual_backend(keys, table, backend) == "native":
        return native.add_residual(keys, table, bits, group_size)
    B, H, n, D = keys.shape
    nb, ng = D * bits // 8, D // group_size
    sz = table[..., nb:].contiguous().view(torch.float16).float()  # (B, H, n, 2 * ng)
    codes = unpack_codes(table[..., :nb], bits).float().view(B, H, n, ng, group_size)
    res = codes * sz[..., :ng, None] + sz[..., ng:, None]
    return (keys.float() + res.view(B, H, n, D)).to(keys.dtype)


def attended_keys(layer, ids, fetched, rebuilt=None, backend=None):
    """The keys to attend the chosen chunks ``ids`` (B, H, K; -1 empty) with, (B, H, K * cs, D):
    the exact keys fetched beside their values (``fetch_keys``), else ``rebuilt`` (their low-rank
    keys; None: rebuilt here from ``layer``'s factors) plus, with ``residual_bits``, the fetched
    residual rows (``backend``: the residual's, the policy's by default)."""
    from kvpress.kernels.shadowkv_rebuild import shadowkv_rebuild

    p = layer.policy
    backend = backend or p.backend
    if p.fetch_keys:
        return fetched.reshape(*ids.shape[:2], -1, fetched.shape[-1])
    if rebuilt is None:
        rebuilt = shadowkv_rebuild(layer.factor, layer.basis, ids, layer._rope_inv_freq(ids.device), layer.rope_start,
                                   chunk_size=p.chunk_size, backend=backend)
    if not p.residual_bits:
        return rebuilt
    return add_residual(rebuilt, fetched.reshape(*rebuilt.shape[:3], -1), p.residual_bits,
                        p.residual_group_for(rebuilt.shape[-1]), backend=backend)
