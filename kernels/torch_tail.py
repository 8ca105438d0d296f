"""The torch math of the chunk-mean tail estimate (`kvpress.kernels.tail` documents it): the
estimate alone, or merged with the exact attention of the tokens a `SparseIndex` selects in one
softmax. A leaf below `tail` and the native ``sparse_decode`` op (which runs it for an index
its compiled kernel does not take)."""
from __future__ import annotations

import torch

from .index import SparseIndex
from .torch_decode import _cache_rows, _gather, _row_view, selected_positions


def _check(q: torch.Tensor, k_sum: torch.Tensor, v_sum: torch.Tensor, count: torch.Tensor) -> None:
    if q.dim() != 3 or k_sum.dim() != 4 or k_sum.shape != v_sum.shape or k_sum.shape[0] != q.shape[0]:
        raise ValueError(f"tail estimate needs q (B, H_q, D) and k_sum / v_sum (B, H_kv, N, D) of one shape, got "
                         f"q {tuple(q.shape)}, k_sum {tuple(k_sum.shape)}, v_sum {tuple(v_sum.shape)}")
    if tuple(count.shape) != (k_sum.shape[0], k_sum.shape[2]):
        raise ValueError(f"count must have shape (B, N) = {(k_sum.shape[0], k_sum.shape[2])}, got {tuple(count.shape)}")
    if q.shape[1] % k_sum.shape[1] or q.shape[2] != k_sum.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not match {k_sum.shape[1]} KV heads of dim {k_sum.shape[3]}")


def _chunk_attention(q: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, n: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H_q, D) over chunk means (B, H_kv, N, D) standing for ``n`` (B, H_kv, N) tokens each."""
    B, H_q, D = q.shape
    H = k_mean.shape[1]
    qg = q.float().reshape(B, H, H_q // H, D) * scale  # (B, H_kv, G, D)
    logits = qg @ k_mean.transpose(-1, -2) + n.clamp(min=1).log()[:, :, None]  # (B, H_kv, G, N)
    logits = logits.masked_fill((n < 0.5)[:, :, None], float("-inf"))  # empty chunks stand for nothing
    lse = torch.logsumexp(logits, dim=-1)  # (B, H_kv, G); -inf when every chunk is empty
    out = torch.softmax(logits, dim=-1).nan_to_num(0.0) @ v_mean  # (B, H_kv, G, D)
    return out.reshape(B, H_q, D), lse.reshape(B, H_q)


def _positions(index: SparseIndex, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attended positions ``(B, H_kv, V)`` and their validity (each real token once).

    The unpadded token index of the decode hot path (`range_topk_index`: ``block_size`` 1, no
    ``seq_starts``, a trusted ``id_range`` inside ``[sinks, seq_len - dense_tail)``) is laid out
    directly as sinks + ids + tail (validity None on CPU when every slot holds an id); anything
    else goes through `selected_positions`.
    """
    r = index.id_range
    if (seq_len is None or index.block_size != 1 or index.seq_starts is not None or r is None
            or r[0] < index.sinks or r[1] >= seq_len - index.dense_tail):
        return selected_positions(index)
    B, H, K = index.block_idx.shape
    dev = index.device
    S, W = index.sinks, index.dense_tail
    pos = torch.empty(B, H, S + K + W, dtype=torch.long, device=dev)
    pos[..., :S] = torch.arange(S, device=dev)
    pos[..., S:S + K] = index.block_idx
    pos[..., S + K:] = torch.arange(seq_len - W, seq_len, device=dev)
    if dev.type == "cpu" and int(index.block_cnt.min()) == K:
        return pos, None  # every slot holds a token (the top-k hot path): no mask to apply
    valid = torch.ones(B, H, S + K + W, dtype=torch.bool, device=dev)
    valid[..., S:S + K] = torch.arange(K, device=dev) < index.block_cnt[..., None]
    return pos.masked_fill_(~valid, 0), valid


def _estimate(q, k_cache, v_cache, index, k_sum, v_sum, count, chunk_size: int, scale: float, seq_len: int | None,
              *, with_exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`tail_estimate` (``with_exact=False``) or `sparse_decode_tail`'s merged attention (True), fp32."""
    B, H, N, D = k_sum.shape
    G = q.shape[1] // H
    pos, valid = _positions(index, seq_len)  # (B, H_kv, V) attended positions, each real token once
    V = pos.shape[-1]
    rel = pos if index.seq_starts is None else (pos - index.seq_starts.long()[:, None, None]).clamp_(min=0)
    chunk = torch.div(rel, chunk_size, rounding_mode="floor").clamp_(max=N - 1).view(B * H, 1, V)
    # the attended tokens' rows, fp32 (B * H_kv, V, D), gathered once as the decode does
    rows_k, flat_k = _cache_rows(k_cache, pos)
    k_att = _gather(rows_k, flat_k, "tail_k")
    flat_v = flat_k if v_cache.stride() == k_cache.stride() else _cache_rows(v_cache, pos)[1]
    v_att = _gather(_row_view(v_cache)[0], flat_v, "tail_v")
    validf = None if valid is None else valid.view(B * H, 1, V).float()
    # Linear in the chunk sums, so the attended tokens come out of the scores and the output
    # instead of out of the (N, D) sums: q . mean_c = (q . S_c - sum_{j in c} q . k_j) / n_c and
    # out = (p / n) @ S_v - sum_j (p / n)_{c(j)} v_j. Per-chunk sums of the attended tokens' scores
    # and counts are one index_add over (V, G + 1) values; uncounted slots go to a spare chunk N.
    qg = q.float().reshape(B * H, G, D) * scale
    s_att = torch.bmm(qg, k_att.transpose(1, 2))  # (B * H_kv, G, V)
    ones = s_att.new_ones(B * H, 1, V) if validf is None else validf
    per_slot = torch.cat([s_att, ones], 1).transpose(1, 2)  # (B * H_kv, V, G + 1)
    slot_chunk = chunk.view(B * H, V) if valid is None else torch.where(valid.view(B * H, V), chunk.view(B * H, V), N)
    target = (torch.arange(B * H, device=pos.device).view(B * H, 1) * (N + 1) + slot_chunk).view(-1)
    removed = per_slot.new_zeros(B * H * (N + 1), G + 1).index_add_(0, target, per_slot.reshape(-1, G + 1))
    removed = removed.view(B * H, N + 1, G + 1)[:, :N]  # (B * H_kv, N, G + 1)
    n_rest = count[:, None, :].expand(B, H, N).reshape(B * H, 1, N) - removed[:, None, :, G]  # (B * H_kv, 1, N)
    inv = 1.0 / n_rest.clamp(min=1)
    s_chunk = (torch.bmm(qg, k_sum.reshape(B * H, N, D).transpose(1, 2)) - removed[..., :G].transpose(1, 2)) * inv
    s_chunk = (s_chunk + n_rest.clamp(min=1).log()).masked_fill(n_rest < 0.5, float("-inf"))  # (B * H_kv, G, N)
    # softmax and log-sum-exp from one exp (torch.logsumexp costs more than the rest on CPU); with
    # the exact part, one softmax over [attended tokens, chunk summaries]
    top = s_chunk.amax(-1, keepdim=True)
    if with_exact:
        if validf is not None:
            s_att = s_att.masked_fill(validf < 0.5, float("-inf"))
        top = torch.maximum(top, s_att.amax(-1, keepdim=True))
    top = top.clamp_(min=torch.finfo(torch.float32).min)  # finite when everything is -inf
    e_chunk = (s_chunk - top).exp_()
    total = e_chunk.sum(-1, keepdim=True)  # (B * H_kv, G, 1); 0 when nothing is attended or estimated
    if with_exact:
        e_att = (s_att - top).exp_()
        total = total + e_att.sum(-1, keepdim=True)
    lse = (top + total.log()).view(B, H * G)  # -inf when nothing is attended or estimated
    norm = 1.0 / total.clamp(min=torch.finfo(torch.float32).tiny)
    w_chunk = e_chunk.mul_(inv).mul_(norm)  # (B * H_kv, G, N): per unit of a chunk's value sum
    # an attended token's weight, less its share of its chunk's (value sum - attended values)
    w_att = torch.gather(w_chunk, 2, chunk.expand(B * H, G, V)).neg_()
    if validf is not None:
        w_att = w_att.mul_(validf)
    if with_exact:
        w_att = w_att.add_(e_att.mul_(norm))
    out = torch.baddbmm(torch.bmm(w_chunk, v_sum.reshape(B * H, N, D)), w_att, v_att)  # (B * H_kv, G, D)
    return out.view(B, H * G, D), lse
