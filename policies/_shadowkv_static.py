"""``shadowkv``'s static decode step: the layer's state in buffers sized to the cache's capacity,
one-token steps with fixed shapes, positions and counts on the device (see `StaticStore`)."""

from __future__ import annotations

import torch

from kvpress.buffers import KVBuffer
from kvpress.kernels import chunk_landmarks
from kvpress.kernels.merge import torch_merge_states
from kvpress.kernels.rows import torch_attend_rows
from kvpress.kernels.shadowkv_rebuild import torch_shadowkv_rebuild
from kvpress.kernels.triton_shadowkv_host import host_gather, host_scatter
from kvpress.plan import capacity_bucket, static_address

from ._shadowkv_select import chunk_scores, rerank, tail_estimate, tail_value_sums, top_chunks
from ._shadowkv_store import attended_keys, default_rank, low_rank, project, residual_table


class StaticStore:
    """A ShadowKV layer's decode state at fixed shapes, for steps `torch.compile` captures.

    Built from the layer's state after a prompt or a turn when the cache's capacity is planned (a
    traced step cannot build it), else at the first static step; `to_layer` gives the state back to
    the eager paths (whose folds also run here: a store built for one `fold`). The chunk grid, the
    exact and the generated tokens are preallocated for every token the capacity allows; counts live
    on the device. A step folds under a device condition with masked writes, selects a constant
    ``k_max`` chunks by top-k (the eager step's budget, shortlist and rerank decision as device
    masks), gathers their values from the host tier by device ids (`host_gather`), attends exact,
    chosen and generated tokens under one masked softmax and merges the ``tail_chunk`` estimate. It
    reuses no previous fetch and counts neither transfers nor ``max_attended``.
    """

    def __init__(self, layer, tokens: int | None = None):
        p, cs = layer.policy, layer.policy.chunk_size
        B, H, E0, D = layer.exact_k.shape
        dev, dtype = layer.exact_k.device, layer.exact_k.dtype
        self.policy, self.layer_idx, self.adapter = p, layer.layer_idx, layer.cache.adapter
        fold, lw, g0 = p.fold_tokens, p.local_window, layer.gen_len
        # tokens a step may fold: `fold`, more only right after a turn left many generated tokens
        self.fold_max = max(fold, (g0 - lw) // fold * fold) if fold else 0
        # tokens (seen) the buffers hold: the planned capacity, or ``tokens``
        self.tokens = tokens or max(layer.cache.capacity or 0, layer.seen + 1)
        future = self.tokens - layer.seen  # decode steps the buffers have room for
        n0 = layer.n_chunks
        self.group = p.tail_chunk // cs if p.tail_chunk else 1  # chunks per tail group
        self.offset = (-n0) % self.group  # groups align with the end of the prompt
        Cc = n0 + -(-(g0 + future) // cs) + self.fold_max // cs
        Cc += (-(Cc + self.offset)) % self.group
        self.k_max = min(p.budget // cs, Cc)  # chunks (tokens: groups of cs) a step may choose
        E = max(E0, p.budget if bool(layer.row_exact.any()) else 0)
        G = max(g0 + 1, lw + fold) if fold else g0 + future
        R = layer.factor.shape[2] if layer.factor is not None else min(
            default_rank(H * D, D) if p.rank is None else p.rank, H * D)

        self.pinned = dev.type == "cuda"  # the host tables are pinned memory

        def pad(t, dim, size, *empty, dtype=dtype, host=False):  # t (None: no entries, shape `empty`), zeros after
            if t is None:
                t = torch.zeros(*empty, dtype=dtype, device="cpu" if host else dev)
            return _padded(t, dim, size, host and self.pinned)

        self.gen_k = pad(None if layer.gen_k is None else layer.gen_k[:, :, :g0], 2, G, B, H, 0, D)
        self.gen_v = pad(None if layer.gen_v is None else layer.gen_v[:, :, :g0], 2, G, B, H, 0, D)
        self.gen_len = torch.full((1,), g0, dtype=torch.long, device=dev)
        self.n_chunks = torch.full((1,), n0, dtype=torch.long, device=dev)
        self.exact_k = pad(layer.exact_k, 2, E + 1)  # slot E: where masked writes go
        self.exact_v = pad(layer.exact_v, 2, E + 1)
        self.exact_cnt = layer.exact_cnt.long().clone()
        self.landmarks = pad(layer.landmarks, 2, Cc, B, H, 0, D)
        self.selectable = pad(layer.selectable, 2, Cc, B, H, 0, dtype=torch.bool)
        self.factor = pad(layer.factor, 1, Cc * cs, B, 0, R)
        self.basis = pad(layer.basis, 1, R, B, 0, H, D)
        self.v_host = pad(layer.v_host, 2, Cc, B, H, 0, cs, D, host=True)
        self.k_host = pad(layer.k_host, 2, Cc, B, H, 0, cs, D, host=True) if p.fetch_keys else None
        width = D * p.residual_bits // 8 + 4 * D // p.residual_group_for(D) if p.residual_bits else 0
        self.kr_host = pad(layer.kr_host, 2, Cc, B, H, 0, cs, width, dtype=torch.uint8,
                           host=True) if p.residual_bits else None
        self.tail_v_sum = pad(layer.tail_v_sum, 2, (Cc + self.offset) // self.group, B, H, 0, D,
                              dtype=torch.float32) if p.tail_chunk else None
        self.chunked = torch.full((1,), layer.landmarks is not None, device=dev)  # the eager layer's chunk entries
        self.row_exact = layer.row_exact.clone()
        self.has_basis = layer.has_basis.clone()
        self.rope_start, self.key_weight = layer.rope_start, layer.key_weight
        # a row without a basis factors its first chunks itself (an SVD in the step while any may)
        self.may_need_basis = not bool(self.has_basis.all())
        self.inv_freq = layer._rope_inv_freq(dev)
        static_address(self.gen_k, self.gen_v, self.gen_len, self.n_chunks, self.exact_k, self.exact_v,
                       self.exact_cnt, self.landmarks, self.selectable, self.factor, self.basis, self.tail_v_sum,
                       self.chunked, self.row_exact, self.has_basis)

    def device_tensors(self) -> dict:
        """Every tensor the store holds on the device (the RoPE table is the layer's)."""
        return {name: t for name, t in vars(self).items() if isinstance(t, torch.Tensor) and name != "inv_freq"
                and name not in ("v_host", "k_host", "kr_host")}

    # ------------------------------------------------------------------ the step
    def step(self, layer, q, k_new, v_new, scaling):
        """One decode token: fold, store, select, fetch, attend. Returns (B, H_q, 1, D)."""
        p, cs = self.policy, self.policy.chunk_size
        if layer.seen + 1 > self.tokens:  # past the planned capacity: the next bucket (new shapes, a recompile)
            self._grow(capacity_bucket(layer.seen + 1))
        if self.fold_max:
            self.fold()
        self.gen_k.index_copy_(2, self.gen_len, k_new)
        self.gen_v.index_copy_(2, self.gen_len, v_new)
        self.gen_len.add_(1)
        q0 = q[:, :, 0]  # (B, H_q, D)
        B, H, G, D = self.gen_k.shape
        sel_cnt = self.selectable.sum(-1)  # (B, H)
        # chunks each (row, KV head) may add, as the eager step counts them
        allow = torch.minimum(((p.budget - self.exact_cnt - self.gen_len) // cs).clamp(min=0), sel_cnt)
        sets = [(self.exact_k, self.exact_v, self.exact_cnt, self.exact_k.shape[2] - 1)]  # (the spare slot left out)
        ids = chosen_values = None
        tokens = p.select == "tokens"
        if self.k_max:
            ids, sel_keys = self._select(q0, allow, sel_cnt, scaling)
            sel_values, fetched = self._fetch(ids, tokens)
            keys = attended_keys(self, ids, fetched, sel_keys, backend="torch")
            sets.append((keys, sel_values, (ids >= 0).sum(-1) * (1 if tokens else cs), keys.shape[2]))
            chosen_values = sel_values if tokens else sel_values.view(B, H, self.k_max, cs, D)
        sets.append((self.gen_k, self.gen_v, self.gen_len.expand(B, H), G))
        out, lse = torch_attend_rows(q0, sets, scale=scaling)
        if p.tail_chunk:
            o, l = tail_estimate(q0, self.landmarks, self.selectable, self.tail_v_sum, ids, chosen_values,
                                 chunk_size=cs, tail_chunk=p.tail_chunk, scale=scaling, tokens=tokens)
            out, lse = torch_merge_states(out, lse, o, l)
        layer.count_static_step()
        return out.to(q.dtype)[:, :, None]

    def _grow(self, tokens: int) -> None:
        """Room for ``tokens`` tokens: every capacity axis extended with zeros (empty chunks, groups, slots)."""
        extra, cs = tokens - self.tokens, self.policy.chunk_size
        chunks = -(-extra // cs)
        chunks += (-chunks) % self.group  # whole tail groups: the grid stays aligned with them
        for name, dim, n in (("landmarks", 2, chunks), ("selectable", 2, chunks), ("factor", 1, chunks * cs),
                             ("v_host", 2, chunks), ("k_host", 2, chunks), ("kr_host", 2, chunks),
                             ("tail_v_sum", 2, chunks // self.group),
                             ("gen_k", 2, 0 if self.fold_max else extra), ("gen_v", 2, 0 if self.fold_max else extra)):
            t = getattr(self, name)
            if t is not None and n:
                setattr(self, name, _padded(t, dim, t.shape[dim] + n, t.device.type == "cpu" and self.pinned))
        self.k_max = min(self.policy.budget // cs, self.landmarks.shape[2])
        self.tokens = tokens

    def _select(self, q0, allow, sel_cnt, scaling):
        """The eager step's choice at a constant size ``k_max``: ids (B, H, k_max) (tokens: k_max * cs)
        ascending, -1 after, and their rebuilt keys (B, H, k_max * cs, D)."""
        p, cs, K = self.policy, self.policy.chunk_size, self.k_max
        C = self.landmarks.shape[2]
        scores = chunk_scores(q0, self.landmarks, self.selectable, scale=scaling, reduction=p.score_reduction)
        rebuild = lambda ids: torch_shadowkv_rebuild(self.factor, self.basis, ids, self.inv_freq,  # noqa: E731
                                                     self.rope_start, chunk_size=cs)
        tokens = p.select == "tokens"
        if not tokens and p.rerank == 1:
            ids = top_chunks(scores, K, allow)
            return ids, rebuild(ids)
        k_sel = allow.amax()  # the eager step's k
        shortlist = torch.maximum(torch.minimum(k_sel * p.rerank, sel_cnt.amax()), k_sel)  # its shortlist size
        ids, keys = rerank(q0, scores, rebuild, allow, shortlist.expand(allow.shape), k=K,
                           shortlist=min(K * p.rerank, C), chunk_size=cs, scale=scaling, reduction=p.score_reduction,
                           tokens=tokens)
        if tokens:
            return ids, keys
        plain = top_chunks(scores, K, allow)  # the eager step reranks only a shortlist longer than k
        reranked = shortlist > k_sel
        return torch.where(reranked, ids, plain), torch.where(reranked, keys, rebuild(plain))

    def _fetch(self, ids, tokens: bool):
        """Values (B, H, n, D) of the chosen ids from the host tier, zeros in empty slots, and with
        ``fetch_keys`` / ``residual_bits`` the rows of the key table beside them (else None)."""
        B, H, Cc, cs, D = self.v_host.shape
        unit = 1 if tokens else cs  # tokens per id
        per_row = Cc * cs // unit
        rows = (torch.arange(B * H, device=ids.device).view(B, H, 1) * per_row + ids.long().clamp(min=0)).view(-1)
        ok = (ids >= 0).repeat_interleave(unit, dim=-1)[..., None]  # (B, H, n, 1)

        def gather(table):
            width = table.shape[-1]
            got = host_gather(table.view(-1, unit * width), rows).view(B, H, -1, width)
            return got * ok.to(got.dtype)

        table = self.k_host if self.policy.fetch_keys else self.kr_host
        return gather(self.v_host), None if table is None else gather(table)

    def fold(self) -> None:
        """The fold (`ShadowKVPolicy.fold_size`) under a device condition: the oldest ``f``
        generated tokens (0 when the step folds none) join the exact tokens or the chunk grid."""
        p, cs, F = self.policy, self.policy.chunk_size, self.fold_max
        fold, lw = p.fold_tokens, p.local_window
        B, H, G, D = self.gen_k.shape
        dev = self.gen_k.device
        g = self.gen_len
        f = torch.where(g >= lw + fold, (g - lw) // fold * fold, 0)  # [1]
        do = f > 0
        tok = torch.arange(F, device=dev)
        live = tok < f  # (F,) the folded tokens among the F moved
        k, v = self.gen_k[:, :, :F], self.gen_v[:, :, :F]  # (B, H, F, D)
        start = self.n_chunks * cs  # [1] grid index of the first folded token
        fits = self.row_exact & (p.budget >= start + f - self.rope_start)  # (B,)
        stays, crow = fits & do, ~fits & do  # rows adding exact tokens / chunks
        # exact tokens: after each row's count; other slots write to the spare slot E
        E = self.exact_k.shape[2] - 1
        slot = torch.where(stays[:, None, None] & live, self.exact_cnt[..., None] + tok, E).clamp(max=E)
        slot = slot[..., None].expand(B, H, F, D)
        self.exact_k.scatter_(2, slot, k)
        self.exact_v.scatter_(2, slot, v)
        self.exact_cnt.add_(stays[:, None].long() * f)
        # chunks: written after the grid's end for every row (selectable for the chunk rows); what
        # lands past the grid when nothing folds is never read and is overwritten by the next fold
        pos = start + tok  # (F,)
        rel = pos[None, :] - self.rope_start[:, None]  # (B, F) RoPE positions
        k_pre = self.adapter.invert_rope(k, rel[:, None, :], self.layer_idx).float()
        k_pre = k_pre.permute(0, 2, 1, 3).reshape(B, F, H * D) * live[None, :, None]
        factor = project(k_pre, self.basis, self.key_weight).to(self.factor.dtype)  # (B, F, R)
        if self.may_need_basis:
            need = crow & ~self.has_basis
            f_svd, b_svd = low_rank(k_pre, None, self.factor.shape[2], H, self.factor.dtype, self.key_weight, count=f)
            factor = torch.where(need[:, None, None], f_svd, factor)
            self.basis.copy_(torch.where(need[:, None, None, None], b_svd, self.basis))
            self.has_basis.copy_(self.has_basis | need)
        self.factor.index_copy_(1, pos, factor)
        nf = F // cs
        chunk = self.n_chunks + torch.arange(nf, device=dev)  # (nf,)
        chunk_live = torch.arange(nf, device=dev) * cs < f
        selectable = (crow[:, None] & chunk_live).view(B, 1, nf).expand(B, H, nf)
        self.landmarks.index_copy_(2, chunk, chunk_landmarks(k, cs))
        self.selectable.index_copy_(2, chunk, selectable)
        Cc = self.v_host.shape[2]
        rows = (torch.arange(B * H, device=dev)[:, None] * Cc + chunk).view(-1)  # (B*H*nf,)
        written = do & crow.any()

        def put(table, x):  # x (B, H, F, W) into the host table's new chunks
            x, table = x.reshape(B * H * nf, -1).to(table.dtype), table.view(B * H * Cc, -1)
            if torch.compiler.is_compiling():
                host_scatter(table, rows, x, written)
            elif bool(written):  # an eager fold: the host copies the rows (no device access to the tier needed)
                table.index_copy_(0, rows.cpu(), x.cpu())

        put(self.v_host, v)
        if self.k_host is not None:
            put(self.k_host, k)
        if self.kr_host is not None:
            rebuilt = torch_shadowkv_rebuild(self.factor, self.basis, chunk.int().expand(B, H, nf), self.inv_freq,
                                             self.rope_start, chunk_size=cs)
            put(self.kr_host, residual_table(k, rebuilt, p.residual_bits, p.residual_group_for(D)))
        if self.tail_v_sum is not None:  # whole groups, aligned as the prompt's
            m = self.group
            sums = tail_value_sums(v.reshape(B, H, nf, cs, D), selectable, p.tail_chunk)
            group = (self.n_chunks + self.offset) // m + torch.arange(nf // m, device=dev)
            self.tail_v_sum.index_copy_(2, group, sums)
        self.row_exact.copy_(torch.where(do, fits, self.row_exact))
        self.chunked.copy_(self.chunked | written)
        self.n_chunks.add_(f // cs)
        # the generated tokens left: shifted to the front (zeros after)
        src = torch.arange(G, device=dev) + f  # (G,)
        keep = (src < G).view(1, 1, G, 1)
        src = src.clamp(max=G - 1).view(1, 1, G, 1).expand(B, H, G, D)
        self.gen_k.copy_(torch.gather(self.gen_k, 2, src) * keep)
        self.gen_v.copy_(torch.gather(self.gen_v, 2, src) * keep)
        self.gen_len.sub_(f)

    # ------------------------------------------------------------------ back to the eager paths
    def to_layer(self, layer) -> None:
        """Give the state back to ``layer``'s eager attributes (host counts read once; new tensors, so
        state held elsewhere, such as a recorded forward's snapshot, keeps the old ones)."""
        cs = self.policy.chunk_size
        n = int(self.n_chunks)
        layer.gen = KVBuffer(64)
        layer.gen.k, layer.gen.v, layer.gen.length = self.gen_k, self.gen_v, int(self.gen_len)
        cnt = self.exact_cnt
        E = int(cnt.max()) if cnt.numel() else 0
        layer.exact_k = self.exact_k[:, :, :E].contiguous()
        layer.exact_v = self.exact_v[:, :, :E].contiguous()
        layer.exact_cnt, layer.exact_max, layer._exact_cnt_cpu = cnt.to(torch.int32), E, cnt.cpu()
        layer.n_chunks = n
        layer.row_exact, layer.has_basis = self.row_exact, self.has_basis
        if not bool(self.chunked):
            return
        layer.landmarks = self.landmarks[:, :, :n].contiguous()
        layer.selectable = self.selectable[:, :, :n].contiguous()
        layer.factor = self.factor[:, : n * cs].contiguous()
        layer.basis = self.basis

        def host(t):  # the first n chunks, contiguous (pinned for a CUDA layer, as `to_host` makes them)
            return None if t is None else torch.empty(t[:, :, :n].shape, dtype=t.dtype,
                                                      pin_memory=self.pinned).copy_(t[:, :, :n])

        layer.v_host, layer.k_host, layer.kr_host = host(self.v_host), host(self.k_host), host(self.kr_host)
        if self.tail_v_sum is not None:
            layer.tail_v_sum = self.tail_v_sum[:, :, : (n + self.offset) // self.group].contiguous()
        sel_cnt = layer.selectable.sum(-1).cpu()
        layer._sel_cnt_cpu, layer.max_selectable = sel_cnt, int(sel_cnt.max()) if sel_cnt.numel() else 0


def _padded(t: torch.Tensor, dim: int, size: int, pinned: bool = False) -> torch.Tensor:
    """A new tensor of ``size`` entries along ``dim``: ``t``'s, then zeros (in pinned memory with ``pinned``)."""
    shape = list(t.shape)
    shape[dim] = size
    out = torch.zeros(shape, dtype=t.dtype, device=t.device, pin_memory=pinned)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out
