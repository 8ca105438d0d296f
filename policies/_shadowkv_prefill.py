"""``shadowkv``'s prompt and new turns (for `ShadowKVLayer`): a prompt factorised into the store
(`ingest`), a turn's tokens attended densely over everything stored (`attend_turn`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpress.attention import masked_group_attention
from kvpress.kernels import chunk_landmarks
from kvpress.kernels.shadowkv_rebuild import shadowkv_rebuild

from ._shadowkv_select import tail_value_sums
from ._shadowkv_store import (attended_keys, default_rank, fetch_tables, low_rank, query_pair_weights,
                              residual_table, to_host)


def query_squares(policy, q: torch.Tensor, num_kv_heads: int) -> torch.Tensor | None:
    """With ``svd="query"``: the squares of a forward's queries (B, H_q, T, D), averaged over
    each KV head's group, fp32 (B, H_kv, T, D); else None."""
    if policy.svd != "query":
        return None
    B, H_q, T, D = q.shape
    return q.float().square().view(B, num_kv_heads, H_q // num_kv_heads, T, D).mean(2)


@torch.no_grad()
def ingest(layer, k: torch.Tensor, v: torch.Tensor, q_sq: torch.Tensor | None = None) -> None:
    """Factorise a prompt ``k``/``v`` (B, H_kv, T, D) into ``layer``'s store (see `ShadowKVLayer`); ``q_sq``:
    its query squares with ``svd="query"`` (`query_squares`)."""
    p, adapter = layer.policy, layer.cache.adapter
    B, H, T, D = k.shape
    cs, dev = p.chunk_size, k.device
    shift = (-T) % cs
    C = (T + shift) // cs
    rs = layer.row_start
    rs = torch.zeros(B, dtype=torch.long, device=dev) if rs is None else rs.to(dev)
    rope_start = rs + shift  # (B,) padded index of each row's first real token
    kp = F.pad(k, (0, 0, shift, 0))  # (B, H, T_pad, D)
    vp = F.pad(v, (0, 0, shift, 0))
    tok = torch.arange(C * cs, device=dev)
    real = tok[None, :] >= rope_start[:, None]  # (B, T_pad)
    chunk = torch.arange(C, device=dev)
    n_win = -(-p.local_window // cs)
    win_first = max(C - n_win, 0)
    first_full = (rope_start + cs - 1) // cs  # (B,) first chunk without padding
    middle = (chunk[None, :] >= first_full[:, None]) & (chunk[None, :] < win_first)  # (B, C)
    # A row whose prompt fits the budget keeps every chunk exact (decided per row, so a padded
    # row of a batch behaves like the same prompt alone); other rows keep `outlier_chunks`.
    row_exact = p.budget >= T - rs  # (B,)
    out_cnt = torch.where(row_exact, middle.sum(1), middle.sum(1).clamp(max=p.outlier_chunks))  # (B,)
    n_out = int(out_cnt.max()) if B else 0
    layer.row_exact, layer.rope_start, layer.n_chunks = row_exact, rope_start, C

    landmarks = chunk_landmarks(kp, cs, seq_starts=rope_start)  # (B, H, C, D)
    # Outliers: chunks whose landmark represents its keys worst (lowest min cosine similarity).
    cos = F.cosine_similarity(kp.float().view(B, H, C, cs, D), landmarks.float()[:, :, :, None], dim=-1)
    cos = cos.masked_fill(~real.view(B, 1, C, cs), float("inf")).amin(-1)  # (B, H, C)
    cos = cos.masked_fill(~middle[:, None], float("inf"))
    out_score, out_ids = torch.topk(-cos, n_out, dim=-1)  # (B, H, n_out)
    out_ok = torch.isfinite(out_score) & (torch.arange(n_out, device=dev) < out_cnt[:, None, None])
    is_outlier = torch.zeros(B, H, C + 1, dtype=torch.bool, device=dev)
    is_outlier.scatter_(2, torch.where(out_ok, out_ids, torch.full_like(out_ids, C)), True)
    selectable = middle[:, None] & ~is_outlier[:, :, :C]  # (B, H, C)

    # Exact tokens: the partial chunk at the row start, the outliers, the window chunks.
    head = (first_full - 1)[:, None, None].expand(B, H, 1)
    head_ok = (head >= 0) & (head < win_first)
    win = torch.arange(win_first, C, device=dev).view(1, 1, -1).expand(B, H, -1)
    ex_chunks = torch.cat([head, out_ids, win], dim=2)  # (B, H, N_ex)
    ex_ok = torch.cat([head_ok, out_ok, torch.ones_like(win, dtype=torch.bool)], dim=2)
    pos = (ex_chunks.clamp(min=0)[..., None] * cs + torch.arange(cs, device=dev)).flatten(2)  # (B, H, N_ex*cs)
    ok = ex_ok.repeat_interleave(cs, dim=2) & torch.gather(real[:, None].expand(B, H, -1), 2, pos)
    order = torch.sort((~ok).to(torch.int8), dim=2, stable=True).indices  # valid slots first
    cnt = ok.sum(2)  # (B, H)
    E = int(cnt.max()) if B else 0
    pos = torch.gather(pos, 2, order[..., :E])  # (B, H, E)
    gidx = pos[..., None].expand(B, H, E, D)
    layer.exact_k = torch.gather(kp, 2, gidx).contiguous()
    layer.exact_v = torch.gather(vp, 2, gidx).contiguous()
    layer.exact_cnt = cnt.to(torch.int32)
    layer.exact_max = E
    layer._exact_cnt_cpu = cnt.cpu()  # (B, H) per-head budgets, read on the host: no sync per step
    layer._sel_cnt_cpu = selectable.sum(-1).cpu()

    layer.max_selectable = int(selectable.sum(-1).max()) if B else 0
    # a row that keeps its prompt exact takes its basis from the first tokens it folds, as alone
    layer.has_basis = ~row_exact if layer.max_selectable else torch.zeros_like(row_exact)
    layer.key_weight = None  # svd="query": the SVD's channel metric, from the prompt's queries (folds use it too)
    if p.svd == "query":
        if q_sq is None:
            raise ValueError("shadowkv:svd='query' needs the prompt's queries")
        layer.key_weight = query_pair_weights(q_sq, torch.arange(T, device=dev)[None, :] >= rs[:, None])
    if layer.max_selectable:
        layer.landmarks, layer.selectable = landmarks, selectable
        # Pre-RoPE keys (exact inverse rotation), padding zeroed.
        positions = (tok[None, :] - rope_start[:, None])[:, None, :]
        k_pre = adapter.invert_rope(kp, positions, layer.layer_idx)  # (B, H, T_pad, D)
        k_pre = (k_pre.float() * real[:, None, :, None]).permute(0, 2, 1, 3).reshape(B, C * cs, H * D)
        rank = default_rank(H * D, D) if p.rank is None else p.rank
        layer.factor, layer.basis = low_rank(k_pre, rope_start, min(rank, H * D), H, k.dtype, layer.key_weight)
        layer.v_host = to_host(vp.view(B, H, C, cs, D))
        if p.fetch_keys:
            layer.k_host = to_host(kp.view(B, H, C, cs, D))
        if p.residual_bits:
            ids = torch.arange(C, dtype=torch.int32, device=dev).expand(B, H, -1).contiguous()
            rebuilt = shadowkv_rebuild(layer.factor, layer.basis, ids, layer._rope_inv_freq(dev), rope_start,
                                       chunk_size=cs, backend=p.backend)
            residual = residual_table(kp, rebuilt, p.residual_bits, p.residual_group_for(D))  # (B, H, T_pad, W)
            layer.kr_host = to_host(residual.view(B, H, C, cs, -1))
        if p.tail_chunk:
            layer.tail_v_sum = tail_value_sums(vp.view(B, H, C, cs, D), selectable, p.tail_chunk)
    layer.seen = T


def attend_turn(layer, q, k_new, v_new, scaling):
    """Several tokens after the prompt without past recording (a new turn): they attend densely, as
    any policy's prompt continuation does -- every exact token, every selectable chunk (keys rebuilt,
    values fetched once), the generated tokens and their own earlier ones -- and are kept as
    generated tokens. The rebuilt keys and fetched values are transient (like a prefill's)."""
    p = layer.policy
    B, H_q, T, D = q.shape
    H, dev = k_new.shape[1], q.device
    keys, values, seen_by_all = [], [], []  # keys every query of the turn may see, and which are real
    if layer.exact_max:
        keys.append(layer.exact_k)
        values.append(layer.exact_v)
        seen_by_all.append(torch.arange(layer.exact_max, device=dev) < layer.exact_cnt[..., None].to(dev))
    if layer.max_selectable:
        C, cs = layer.selectable.shape[-1], p.chunk_size
        order = torch.where(layer.selectable, torch.arange(C, device=dev), C).sort(dim=-1).values
        ids = torch.where(order < C, order, -1)[..., : layer.max_selectable].to(torch.int32)  # (B, H, K)
        tables = [t for t in (layer.v_host, layer.k_host if p.fetch_keys else layer.kr_host) if t is not None]
        fetched, *extra = fetch_tables(tables, ids, None, [None] * len(tables), layer.counters, dev)
        keys.append(attended_keys(layer, ids, extra[0] if extra else None))
        values.append(fetched.view(B, H, layer.max_selectable * cs, D))
        seen_by_all.append((ids >= 0).repeat_interleave(cs, dim=-1))
    if layer.gen_len:
        keys.append(layer.gen.keys)
        values.append(layer.gen.values)
        seen_by_all.append(torch.ones(B, H, layer.gen_len, dtype=torch.bool, device=dev))
    keys, values = torch.cat(keys + [k_new], dim=2), torch.cat(values + [v_new], dim=2)
    seen_by_all = torch.cat(seen_by_all + [torch.zeros(B, H, 0, dtype=torch.bool, device=dev)], dim=2)  # (B, H, N0)
    qg = q.reshape(B, H, H_q // H, T, D)
    out = q.new_empty(B, H, H_q // H, T, D)
    steps = torch.arange(T, device=dev)
    block = 128
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        own = steps[None, :t1] <= steps[t0:t1, None]  # (b, t1) causal over the turn's tokens
        visible = torch.cat([seen_by_all[:, :, None].expand(-1, -1, t1 - t0, -1),
                             own.expand(B, H, -1, -1)], dim=-1)
        n0 = seen_by_all.shape[2]
        out[:, :, :, t0:t1] = masked_group_attention(qg[:, :, :, t0:t1], keys[:, :, : n0 + t1],
                                                     values[:, :, : n0 + t1], visible, scaling)
    layer.gen.append(k_new, v_new)
    layer.seen += T
    return out.reshape(B, H_q, T, D).to(q.dtype)
