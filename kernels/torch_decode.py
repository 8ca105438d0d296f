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
        ok = (ids >= 0).repeat_interleave(bs, dim=-1)
        ok &= (p >= sink_end[:, None, None]) & (p < tail_start[:, None, None])
        pos_parts.append(p)
        valid_parts.append(ok)
    if not pos_parts:
        empty = torch.zeros(B, H_kv, 0, dtype=torch.long, device=dev)
        return empty, empty.bool()
    pos = torch.cat(pos_parts, dim=-1)  # (B, H_kv, V)
    valid = torch.cat(valid_parts, dim=-1)
    return torch.where(valid, pos, torch.zeros_like(pos)), valid


_WORKSPACE = threading.local()


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


def _gather_rows(cache: torch.Tensor, pos: torch.Tensor, slot: str) -> torch.Tensor:
    """``cache[b, h, pos[b, h, v]]`` -> ``(B, H_kv, V, D)`` without touching unselected rows."""
    B, H_kv, T_cap, D = cache.shape
    V = pos.shape[-1]
    if cache.is_contiguous():
        # index_select on the flat (B*H_kv*T, D) view copies whole rows
        base = (torch.arange(B * H_kv, device=pos.device) * T_cap).view(B, H_kv, 1)
        flat = (base + pos).reshape(-1)  # (B*H_kv*V,)
        rows = cache.view(B * H_kv * T_cap, D)
        if cache.device.type == "cpu":
            out = _workspace(slot, flat.numel() * D, cache).view(-1, D)
            return torch.index_select(rows, 0, flat, out=out).view(B, H_kv, V, D)
        return rows.index_select(0, flat).view(B, H_kv, V, D)
    b = torch.arange(B, device=pos.device).view(B, 1, 1)
    h = torch.arange(H_kv, device=pos.device).view(1, H_kv, 1)
    return cache[b, h, pos]  # (B, H_kv, V, D)


def torch_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        index: SparseIndex, *, scale: float | None = None,
                        out: torch.Tensor | None = None, validate_index: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of `kvpress.kernels.sparse_decode` (same arguments and results)."""
    B, H_q, H_kv, G, T_cap, D = check_decode_inputs(q, k_cache, v_cache, index, out, validate_index)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    pos, valid = selected_positions(index)  # (B, H_kv, V)
    if out is None:
        out = torch.empty_like(q)
    if pos.shape[-1] == 0 or T_cap == 0:
        out.zero_()
        return out, torch.full((B, H_q), float("-inf"), device=q.device)
    k_sel = _gather_rows(k_cache, pos, "k").float()  # (B, H_kv, V, D); no copy for fp32
    v_sel = _gather_rows(v_cache, pos, "v").float()
    q_g = q.float().reshape(B, H_kv, G, D) * scale  # (B, H_kv, G, D)
    scores = q_g @ k_sel.transpose(-1, -2)  # (B, H_kv, G, V)
    scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H_kv, G)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    o = p @ v_sel  # (B, H_kv, G, D)
    out.copy_(o.reshape(B, H_q, D))
    return out, lse.reshape(B, H_q)
