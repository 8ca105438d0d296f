"""Torch backend of `sparse_decode`: gather only the selected K/V rows, then two small matmuls.

Work and memory traffic grow with the budget (sinks + tail + K_max * block_size), not with
the context, which makes this the fast path on CPU. Scores and softmax run in fp32.
"""
from __future__ import annotations

import math
import threading

import torch

from .checks import check_decode_inputs
from .index import SparseIndex


def selected_positions(index: SparseIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions each (row, KV head) attends, as a padded list.

    Returns
    -------
    pos : torch.Tensor
        int64 ``(B, H_kv, V)`` with ``V = sinks + dense_tail + K_max * block_size``; padded
        slots hold 0.
    valid : torch.Tensor
        bool ``(B, H_kv, V)``; True exactly once for every attended token (deduplicated).
    """
    B, H_kv, K_max = index.block_idx.shape
    dev = index.device
    starts, sink_end, tail_start = index.row_ranges()  # (B,) each
    lens = index.seq_lens.long()
    pos_parts, valid_parts = [], []
    if index.sinks:
        p = starts[:, None] + torch.arange(index.sinks, device=dev)  # (B, sinks)
        pos_parts.append(p[:, None, :].expand(B, H_kv, -1))
        valid_parts.append((p < sink_end[:, None])[:, None, :].expand(B, H_kv, -1))
    if index.dense_tail:
        p = tail_start[:, None] + torch.arange(index.dense_tail, device=dev)  # (B, tail)
        pos_parts.append(p[:, None, :].expand(B, H_kv, -1))
        valid_parts.append((p < lens[:, None])[:, None, :].expand(B, H_kv, -1))
    if K_max:
        bs = index.block_size
        ids = index.block_idx.long()  # (B, H_kv, K_max)
        p = (ids[..., None] * bs + torch.arange(bs, device=dev)).reshape(B, H_kv, K_max * bs)  # (B, H_kv, K_max*bs)
        # padding ids (-1) give p < 0 <= sink_end, so this also drops the padded slots
        ok = (p >= sink_end[:, None, None]) & (p < tail_start[:, None, None])
        pos_parts.append(p)
        valid_parts.append(ok)
    if not pos_parts:
        empty = torch.zeros(B, H_kv, 0, dtype=torch.long, device=dev)
        return empty, empty.bool()
    pos = torch.cat(pos_parts, dim=-1) if len(pos_parts) > 1 else pos_parts[0]  # (B, H_kv, V)
    valid = torch.cat(valid_parts, dim=-1) if len(valid_parts) > 1 else valid_parts[0]
    return torch.where(valid, pos, torch.zeros_like(pos)), valid


_WORKSPACE = threading.local()
CPU_CHUNK_BYTES = 4 << 20  # gathered K+V bytes per step of the CPU loop: fits in L2/L3


def _workspace(slot: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """Reusable per-thread CPU buffer of at least ``numel`` elements.

    Why: a fresh multi-MB CPU tensor is returned to the OS on free and page-faults again on
    the next step; at a 4k budget that costs more than the gather itself.
    """
    key = (slot, like.dtype)
    buf = getattr(_WORKSPACE, "buffers", {}).get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype)
        if not hasattr(_WORKSPACE, "buffers"):
            _WORKSPACE.buffers = {}
        _WORKSPACE.buffers[key] = buf
    return buf[:numel]


def _gather_rows(cache: torch.Tensor, first: int, pos: torch.Tensor, slot: str) -> torch.Tensor:
    """Rows ``cache[b, h, pos[i, v]]`` for the (b, h) pairs ``first + i`` -> ``(n, V, D)``.

    Touches only the selected rows; pair ``p`` is ``(b, h) = divmod(p, H_kv)``.
    """
    B, H_kv, T_cap, D = cache.shape
    n, V = pos.shape
    pairs = torch.arange(first, first + n, device=pos.device)[:, None]  # (n, 1)
    if cache.is_contiguous():
        flat = (pairs * T_cap + pos).reshape(-1)  # (n*V,) rows of the (B*H_kv*T, D) view
        rows = cache.view(B * H_kv * T_cap, D)
        if cache.device.type == "cpu":
            buf = _workspace(slot, flat.numel() * D, cache).view(-1, D)
            return torch.index_select(rows, 0, flat, out=buf).view(n, V, D)
        return rows.index_select(0, flat).view(n, V, D)
    return cache[pairs // H_kv, pairs % H_kv, pos]  # (n, V, D)


def _attend(q_g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 masked softmax attention: q_g (..., G, D), k/v (..., V, D), valid (..., V).

    Written out instead of ``torch.logsumexp`` + ``exp`` (that pair was ~20x slower than one
    exp on small CPU tensors); normalising the (G, D) output is cheaper than the (G, V) weights.
    """
    scores = q_g @ k.float().transpose(-1, -2)  # (..., G, V)
    scores.masked_fill_(~valid[..., None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # (..., G, 1)
    m.masked_fill_(m == float("-inf"), 0.0)  # nothing valid: exp(-inf - 0) = 0, no NaN
    p = scores.sub_(m).exp_()
    denom = p.sum(dim=-1, keepdim=True)  # (..., G, 1); 0 when nothing is valid
    lse = (m + denom.log()).squeeze(-1)  # log(0) = -inf for empty rows
    o = (p @ v.float()).div_(denom.masked_fill_(denom == 0, 1.0))  # (..., G, D)
    return o, lse


def torch_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        index: SparseIndex, *, scale: float | None = None,
                        out: torch.Tensor | None = None, validate_index: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of `kvpress.kernels.sparse_decode` (same arguments and results)."""
    B, H_q, H_kv, G, T_cap, D = check_decode_inputs(q, k_cache, v_cache, index, out, validate_index)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    pos, valid = selected_positions(index)  # (B, H_kv, V)
    V = pos.shape[-1]
    if out is None:
        out = torch.empty_like(q)
    if V == 0 or T_cap == 0:
        out.zero_()
        return out, torch.full((B, H_q), float("-inf"), device=q.device)
    q_g = q.float().reshape(B, H_kv, G, D) * scale  # (B, H_kv, G, D)
    if V >= T_cap:
        # the padded selection is no smaller than the cache: a masked pass over the cache
        # reads less than gathering (copying) it first
        o, lse = _attend(q_g, k_cache, v_cache, index.token_mask(T_cap))  # (B, H_kv, G, D), (B, H_kv, G)
        out.copy_(o.reshape(B, H_q, D))
        return out, lse.reshape(B, H_q)
    N = B * H_kv
    # CPU: gather a few heads at a time so the gathered rows are still in cache when the
    # matmuls read them (one pass over DRAM instead of three)
    per_pair = 2 * V * D * k_cache.element_size()
    chunk = N if q.device.type != "cpu" else max(1, CPU_CHUNK_BYTES // per_pair)
    q_n, pos_n, valid_n = q_g.view(N, G, D), pos.view(N, V), valid.view(N, V)
    o = torch.empty(N, G, D, device=q.device)
    lse = torch.empty(N, G, device=q.device)
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        k_sel = _gather_rows(k_cache, s, pos_n[s:e], "k")  # (n, V, D)
        v_sel = _gather_rows(v_cache, s, pos_n[s:e], "v")
        o[s:e], lse[s:e] = _attend(q_n[s:e], k_sel, v_sel, valid_n[s:e])
    out.copy_(o.view(B, H_q, D))
    return out, lse.view(B, H_q)
