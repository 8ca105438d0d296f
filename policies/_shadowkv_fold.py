"""``shadowkv``'s tokens after the prompt folded into its store (for `ShadowKVLayer`): the oldest
generated tokens join the prompt's chunk grid as factors, landmarks, host-tier values (and with
``fetch_keys`` / ``residual_bits`` their host key tables), see `ShadowKVPolicy.fold_size`."""

from __future__ import annotations

import torch

from kvpress.kernels import chunk_landmarks
from kvpress.kernels.shadowkv_rebuild import shadowkv_rebuild

from ._shadowkv_select import tail_value_sums
from ._shadowkv_store import append_host, default_rank, low_rank, project, residual_table, to_host


@torch.no_grad()
def fold_generated(layer, f: int) -> None:
    """Move the oldest ``f`` generated tokens (whole chunks) into the store (see
    `ShadowKVPolicy.fold_size`).

    Each is placed on the chunk grid after the prompt (padded index ``n_chunks * chunk_size``
    on), so positions, chunk ids and tail groups continue the prompt's. Rows whose tokens up
    to the fold's end still fit the budget add them to their exact tokens; every row gets the
    chunk entries (the exact rows' not selectable) so the grid stays one for the batch.
    """
    p, cs = layer.policy, layer.policy.chunk_size
    k, v = layer.gen_k[:, :, :f], layer.gen_v[:, :, :f]  # (B, H, f, D)
    B, H, _, D = k.shape
    nf, start = f // cs, layer.n_chunks * cs
    stays_exact = layer.row_exact & (p.budget >= start + f - layer.rope_start)  # (B,)
    if bool(stays_exact.any()):
        add_exact(layer, k, v, stays_exact)
    if not bool(stays_exact.all()):
        add_chunks(layer, k, v, ~stays_exact)
    layer.row_exact, layer.exact_mode = stays_exact, bool(stays_exact.all())
    layer.n_chunks += nf
    keep = layer.gen_len - f  # new tensors (not a shift in place): an undo keeps the old ones
    cap = max(64, -(-keep // 64) * 64)
    gen_k, gen_v = k.new_zeros(B, H, cap, D), v.new_zeros(B, H, cap, D)
    gen_k[:, :, :keep] = layer.gen_k[:, :, f : layer.gen_len]
    gen_v[:, :, :keep] = layer.gen_v[:, :, f : layer.gen_len]
    layer.gen_k, layer.gen_v, layer.gen_len = gen_k, gen_v, keep

def add_exact(layer, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """Append ``k``/``v`` (B, H, f, D) to the exact tokens of ``rows`` (B,) bool."""
    B, H, f, D = k.shape
    cnt = layer.exact_cnt.long()  # (B, H)
    new_cnt = cnt + rows[:, None].long() * f
    E = int(new_cnt.max())
    slot = torch.where(rows[:, None, None], cnt[..., None] + torch.arange(f, device=k.device), E)  # spare: E
    out = []
    for old, new in ((layer.exact_k, k), (layer.exact_v, v)):
        t = new.new_zeros(B, H, E + 1, D)
        t[:, :, : old.shape[2]] = old
        out.append(t.scatter_(2, slot[..., None].expand(-1, -1, -1, D), new)[:, :, :E].contiguous())
    layer.exact_k, layer.exact_v = out
    slots = torch.arange(E, device=k.device)
    layer.exact_idx = torch.where(slots < new_cnt[..., None], slots, -1).to(torch.int32)
    layer.exact_cnt, layer.exact_max = new_cnt.to(torch.int32), E
    layer._exact_cnt_cpu = new_cnt.cpu()

def add_chunks(layer, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """Append ``k``/``v`` (B, H, f, D) as chunks (selectable for ``rows`` (B,) bool): factors on
    the layer's basis, landmarks, values to the host tier (and their tail group sums)."""
    p, adapter = layer.policy, layer.cache.adapter
    B, H, f, D = k.shape
    cs, dev = p.chunk_size, k.device
    nf, start, C0 = f // cs, layer.n_chunks * cs, layer.n_chunks
    pos = start + torch.arange(f, device=dev)[None, :] - layer.rope_start[:, None]  # (B, f) RoPE positions
    k_pre = adapter.invert_rope(k, pos[:, None, :], layer.layer_idx).float().permute(0, 2, 1, 3).reshape(B, f, H * D)
    if layer.factor is None:  # no chunks yet (every prompt fit the budget): empty entries for the prompt's
        rank = min(default_rank(H * D) if p.rank is None else p.rank, H * D)
        layer.factor = k.new_zeros(B, start, rank)
        layer.basis = k.new_zeros(B, rank, H, D)
        layer.landmarks = k.new_zeros(B, H, C0, D)
        layer.selectable = torch.zeros(B, H, C0, dtype=torch.bool, device=dev)
        layer.v_host = to_host(v.new_zeros(B, H, C0, cs, D))
        if p.fetch_keys:
            layer.k_host = to_host(k.new_zeros(B, H, C0, cs, D))
        if p.residual_bits:
            width = D * p.residual_bits // 8 + 4 * D // p.residual_group_for(D)
            layer.kr_host = to_host(torch.zeros(B, H, C0, cs, width, dtype=torch.uint8, device=dev))
        if p.tail_chunk:
            layer.tail_v_sum = tail_value_sums(v.new_zeros(B, H, C0, cs, D), layer.selectable, p.tail_chunk)
    R = layer.factor.shape[2]
    # factors on each row's basis (orthonormal rows from the SVD): (B, f, R)
    factor = project(k_pre, layer.basis, layer.key_weight).to(layer.factor.dtype)
    need = rows & ~layer.has_basis  # rows whose first chunks these are: factored on their own keys
    if bool(need.any()):
        idx = need.nonzero().squeeze(1)
        f_new, b_new = low_rank(k_pre[idx], torch.zeros(idx.numel(), dtype=torch.long, device=dev), R, H,
                                layer.factor.dtype, None if layer.key_weight is None else layer.key_weight[idx])
        factor[idx] = f_new
        layer.basis = layer.basis.index_copy(0, idx, b_new)  # a new tensor: an undo keeps the old one
        layer.has_basis = layer.has_basis | need
    layer.factor = torch.cat([layer.factor, factor], dim=1)
    selectable = rows[:, None, None].expand(B, H, nf)
    layer.landmarks = torch.cat([layer.landmarks, chunk_landmarks(k, cs)], dim=2)
    layer.selectable = torch.cat([layer.selectable, selectable], dim=2)
    layer.v_host = append_host(layer.v_host, v.reshape(B, H, nf, cs, D))
    if p.fetch_keys:
        layer.k_host = append_host(layer.k_host, k.reshape(B, H, nf, cs, D))
    if p.residual_bits:
        layer.kr_host = append_host(layer.kr_host, residual_rows(layer, k, C0).view(B, H, nf, cs, -1))
    if p.tail_chunk:  # fold_size is a multiple of tail_chunk: whole groups, aligned as the prompt's
        layer.tail_v_sum = torch.cat([layer.tail_v_sum, tail_value_sums(v.reshape(B, H, nf, cs, D), selectable,
                                                                      p.tail_chunk)], dim=2)
    sel_cnt = layer.selectable.sum(-1)
    layer._sel_cnt_cpu = sel_cnt.cpu()
    layer.max_selectable = int(layer._sel_cnt_cpu.max())


def residual_rows(layer, k: torch.Tensor, c0: int) -> torch.Tensor:
    """`residual_table` rows (B, H_kv, n, W) of the post-RoPE keys ``k`` (B, H_kv, n, D) of the
    whole chunks from chunk ``c0`` of the store's grid on, less their rebuild from the current
    factors and basis."""
    p, cs = layer.policy, layer.policy.chunk_size
    B, H, n, _ = k.shape
    ids = torch.arange(c0, c0 + n // cs, dtype=torch.int32, device=k.device).expand(B, H, -1).contiguous()
    rebuilt = shadowkv_rebuild(layer.factor, layer.basis, ids, layer._rope_inv_freq(k.device), layer.rope_start,
                               chunk_size=cs, backend=p.backend)
    return residual_table(k, rebuilt, p.residual_bits, p.residual_group_for(k.shape[-1]))
