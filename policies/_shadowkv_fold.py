"""``shadowkv``'s tokens after the prompt folded into its store (`ShadowKVLayer` mixes it in):
the oldest generated tokens join the prompt's chunk grid as factors, landmarks, host-tier values
(and with ``fetch_keys`` / ``residual_bits`` their host key tables), see `ShadowKVPolicy.fold_size`."""

from __future__ import annotations

import torch

from kvpress.kernels import chunk_landmarks

from ._shadowkv_select import tail_value_sums
from ._shadowkv_store import append_host, default_rank, low_rank, project, to_host


class FoldedChunks:
    """Methods of `ShadowKVLayer` (its state: the generated tokens, the exact part, the chunk
    store and host tier; ``_residual_rows`` for ``residual_bits``)."""

    @torch.no_grad()
    def _fold(self, f: int) -> None:
        """Move the oldest ``f`` generated tokens (whole chunks) into the store (see
        `ShadowKVPolicy.fold_size`).

        Each is placed on the chunk grid after the prompt (padded index ``n_chunks * chunk_size``
        on), so positions, chunk ids and tail groups continue the prompt's. Rows whose tokens up
        to the fold's end still fit the budget add them to their exact tokens; every row gets the
        chunk entries (the exact rows' not selectable) so the grid stays one for the batch.
        """
        p, cs = self.policy, self.policy.chunk_size
        k, v = self.gen_k[:, :, :f], self.gen_v[:, :, :f]  # (B, H, f, D)
        B, H, _, D = k.shape
        nf, start = f // cs, self.n_chunks * cs
        stays_exact = self.row_exact & (p.budget >= start + f - self.rope_start)  # (B,)
        if bool(stays_exact.any()):
            self._add_exact(k, v, stays_exact)
        if not bool(stays_exact.all()):
            self._add_chunks(k, v, ~stays_exact)
        self.row_exact, self.exact_mode = stays_exact, bool(stays_exact.all())
        self.n_chunks += nf
        keep = self.gen_len - f  # new tensors (not a shift in place): an undo keeps the old ones
        cap = max(64, -(-keep // 64) * 64)
        gen_k, gen_v = k.new_zeros(B, H, cap, D), v.new_zeros(B, H, cap, D)
        gen_k[:, :, :keep] = self.gen_k[:, :, f : self.gen_len]
        gen_v[:, :, :keep] = self.gen_v[:, :, f : self.gen_len]
        self.gen_k, self.gen_v, self.gen_len = gen_k, gen_v, keep

    def _add_exact(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Append ``k``/``v`` (B, H, f, D) to the exact tokens of ``rows`` (B,) bool."""
        B, H, f, D = k.shape
        cnt = self.exact_cnt.long()  # (B, H)
        new_cnt = cnt + rows[:, None].long() * f
        E = int(new_cnt.max())
        slot = torch.where(rows[:, None, None], cnt[..., None] + torch.arange(f, device=k.device), E)  # spare: E
        out = []
        for old, new in ((self.exact_k, k), (self.exact_v, v)):
            t = new.new_zeros(B, H, E + 1, D)
            t[:, :, : old.shape[2]] = old
            out.append(t.scatter_(2, slot[..., None].expand(-1, -1, -1, D), new)[:, :, :E].contiguous())
        self.exact_k, self.exact_v = out
        slots = torch.arange(E, device=k.device)
        self.exact_idx = torch.where(slots < new_cnt[..., None], slots, -1).to(torch.int32)
        self.exact_cnt, self.exact_max = new_cnt.to(torch.int32), E
        self._exact_cnt_cpu = new_cnt.cpu()

    def _add_chunks(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Append ``k``/``v`` (B, H, f, D) as chunks (selectable for ``rows`` (B,) bool): factors on
        the layer's basis, landmarks, values to the host tier (and their tail group sums)."""
        p, adapter = self.policy, self.cache.adapter
        B, H, f, D = k.shape
        cs, dev = p.chunk_size, k.device
        nf, start, C0 = f // cs, self.n_chunks * cs, self.n_chunks
        pos = start + torch.arange(f, device=dev)[None, :] - self.rope_start[:, None]  # (B, f) RoPE positions
        k_pre = adapter.invert_rope(k, pos[:, None, :], self.layer_idx).float().permute(0, 2, 1, 3).reshape(B, f, H * D)
        if self.factor is None:  # no chunks yet (every prompt fit the budget): empty entries for the prompt's
            rank = min(default_rank(H * D) if p.rank is None else p.rank, H * D)
            self.factor = k.new_zeros(B, start, rank)
            self.basis = k.new_zeros(B, rank, H, D)
            self.landmarks = k.new_zeros(B, H, C0, D)
            self.selectable = torch.zeros(B, H, C0, dtype=torch.bool, device=dev)
            self.v_host = to_host(v.new_zeros(B, H, C0, cs, D))
            if p.fetch_keys:
                self.k_host = to_host(k.new_zeros(B, H, C0, cs, D))
            if p.residual_bits:
                width = D * p.residual_bits // 8 + 4 * D // p.residual_group_for(D)
                self.kr_host = to_host(torch.zeros(B, H, C0, cs, width, dtype=torch.uint8, device=dev))
            if p.tail_chunk:
                self.tail_v_sum = tail_value_sums(v.new_zeros(B, H, C0, cs, D), self.selectable, p.tail_chunk)
        R = self.factor.shape[2]
        # factors on each row's basis (orthonormal rows from the SVD): (B, f, R)
        factor = project(k_pre, self.basis, self.key_weight).to(self.factor.dtype)
        need = rows & ~self.has_basis  # rows whose first chunks these are: factored on their own keys
        if bool(need.any()):
            idx = need.nonzero().squeeze(1)
            f_new, b_new = low_rank(k_pre[idx], torch.zeros(idx.numel(), dtype=torch.long, device=dev), R, H,
                                    self.factor.dtype, None if self.key_weight is None else self.key_weight[idx])
            factor[idx] = f_new
            self.basis = self.basis.index_copy(0, idx, b_new)  # a new tensor: an undo keeps the old one
            self.has_basis = self.has_basis | need
        self.factor = torch.cat([self.factor, factor], dim=1)
        selectable = rows[:, None, None].expand(B, H, nf)
        self.landmarks = torch.cat([self.landmarks, chunk_landmarks(k, cs)], dim=2)
        self.selectable = torch.cat([self.selectable, selectable], dim=2)
        self.v_host = append_host(self.v_host, v.reshape(B, H, nf, cs, D))
        if p.fetch_keys:
            self.k_host = append_host(self.k_host, k.reshape(B, H, nf, cs, D))
        if p.residual_bits:
            self.kr_host = append_host(self.kr_host, self._residual_rows(k, C0).view(B, H, nf, cs, -1))
        if p.tail_chunk:  # fold_size is a multiple of tail_chunk: whole groups, aligned as the prompt's
            self.tail_v_sum = torch.cat([self.tail_v_sum, tail_value_sums(v.reshape(B, H, nf, cs, D), selectable,
                                                                          p.tail_chunk)], dim=2)
        sel_cnt = self.selectable.sum(-1)
        self._sel_cnt_cpu = sel_cnt.cpu()
        self.max_selectable = int(self._sel_cnt_cpu.max())
