"""Running per-chunk key / value sums standing for tokens a step does not attend exactly.

`ChunkTail` serves the selection policies' ``tail_chunk`` (the tokens a step leaves out) and
`kvpress.window_layers.SinkWindowLayer`'s (the tokens its window evicted).
"""

from __future__ import annotations

import torch

from .buffers import KVBuffer
from .kernels import SparseIndex, sparse_decode_tail


class ChunkTail:
    """Running fp32 key / value sums per ``chunk_size``-token chunk, for the tail estimate.

    Chunk ``c`` of row ``b`` covers sequence indices ``row_start[b] + [c * chunk_size,
    (c + 1) * chunk_size)`` (as `PageStats` counts pages), so a left-padded row is chunked as
    if it ran alone; padding is never summed (``count`` holds real tokens per row and chunk).
    A decode step adds its token to one chunk in place, so upkeep is O(D) per head and step. :meth:`attend`
    attends a `SparseIndex` exactly and adds the estimate of the tokens it leaves out
    (`kvpress.kernels.sparse_decode_tail`; RetroInfer's estimation zone, arXiv 2505.02922).
    Resident bytes: ``4 / chunk_size`` per cached K or V element (fp32 sums), i.e. 1/32 of a
    bf16 cache's bytes at ``chunk_size = 64``; they are counted in ``cache_stats``.

    ``skip``: the first ``skip`` real tokens of each row are never summed (a `SinkWindowLayer`
    keeps them exactly: its sinks); chunks are still counted from the row's first real token.
    """

    def __init__(self, chunk_size: int, grow_chunks: int = 16, skip: int = 0):
        self.chunk_size = chunk_size
        self.grow_chunks = grow_chunks
        self.skip = skip
        self.tail_k_sum: torch.Tensor | None = None  # (B, H_kv, N_cap, D) fp32
        self.tail_v_sum: torch.Tensor | None = None
        self.tail_count: torch.Tensor | None = None  # (B, N_cap) fp32
        self._chunks = 0  # chunks summed by `append` / `truncate`
        self._counted = 0  # the store's length as the last static step counted it (`count_stored`)

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int, row_start: torch.Tensor | None,
               from_chunk: int = 0) -> None:
        """Add keys / values [B, H_kv, n, D] at sequence indices ``start ..`` to their chunks
        (only to chunks ``>= from_chunk``: `truncate` re-sums the chunks it cleared)."""
        B, H, n, D = k.shape
        if n == 0:
            return
        cs = self.chunk_size
        self.chunks = max(self.chunks, -(-(start + n) // cs))  # (groups of rows may append out of order)
        self._ensure(B, H, D, self.chunks, k.device)
        if from_chunk:
            row_start = torch.zeros(B, dtype=torch.long, device=k.device) if row_start is None else row_start
        if n == 1 and row_start is None:  # a decode step without padding: one chunk, in place
            if start < self.skip:
                return
            c = start // cs
            self.tail_k_sum[:, :, c] += k[:, :, 0].float()
            self.tail_v_sum[:, :, c] += v[:, :, 0].float()
            self.tail_count[:, c] += 1.0
            return
        idx = torch.arange(start, start + n, device=k.device)  # (n,)
        if row_start is None and start >= self.skip:
            chunk = idx // cs
            self.tail_k_sum.index_add_(2, chunk, k.float())
            self.tail_v_sum.index_add_(2, chunk, v.float())
            self.tail_count.index_add_(1, chunk, k.new_ones(B, n, dtype=torch.float32))
            return
        rel = idx[None, :] - (0 if row_start is None else row_start[:, None])  # (B, n) or (1, n)
        chunk = (rel.clamp(min=0) // cs).expand(B, n)  # (B, n)
        real = (rel >= self.skip).expand(B, n) & (chunk >= from_chunk)
        w = real.float()
        at = chunk[:, None, :, None].expand(B, H, n, D)
        self.tail_k_sum.scatter_add_(2, at, k.float() * w[:, None, :, None])
        self.tail_v_sum.scatter_add_(2, at, v.float() * w[:, None, :, None])
        self.tail_count.scatter_add_(1, chunk, w)

    @property
    def chunks(self) -> int:
        """Chunks holding at least one stored token."""
        return max(self._chunks, -(-self._counted // self.chunk_size))

    @chunks.setter
    def chunks(self, n: int) -> None:
        self._chunks, self._counted = n, 0

    def count_stored(self, length: int) -> None:
        """The store holds ``length`` tokens (a static step's token, counted on the host afterwards):
        chunks up to it are in use. Only written here: a compiled step that read the chunk count
        would guard on it and compile again whenever a new chunk starts."""
        self._counted = length

    def reserve(self, capacity: int, like: torch.Tensor) -> None:
        """Hold the sums of every chunk of a ``capacity``-token store ``like`` [B, H_kv, capacity, D],
        so that a static decode step's sums keep their shape."""
        B, H, _, D = like.shape
        self._ensure(B, H, D, -(-capacity // self.chunk_size), like.device)

    def static_append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, row_start: torch.Tensor | None,
                      capacity: int) -> None:
        """Add one decode token per row k / v [B, H_kv, 1, D] at the device position ``pos`` ([1]
        long) without reading it on the host (a static decode step); the sums hold every chunk of a
        ``capacity``-token store. The caller counts the token (:meth:`count_stored`)."""
        B, H, _, D = k.shape
        self._ensure(B, H, D, -(-capacity // self.chunk_size), k.device)
        rel = (pos if row_start is None else pos - row_start).expand(B)  # (B,)
        chunk = rel.clamp(min=0) // self.chunk_size
        w = (rel >= self.skip).float()  # (B,)
        at = chunk.view(B, 1, 1, 1).expand(B, H, 1, D)
        self.tail_k_sum.scatter_add_(2, at, k.float() * w.view(B, 1, 1, 1))
        self.tail_v_sum.scatter_add_(2, at, v.float() * w.view(B, 1, 1, 1))
        self.tail_count.scatter_add_(1, chunk.view(B, 1), w.view(B, 1))

    def static_attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                      scaling: float, row_start: torch.Tensor | None) -> torch.Tensor:
        """:meth:`attend` for a static decode step: the exactly attended tokens are a mask.

        q [B, H_q, 1, D]; k_cache / v_cache [B, H_kv, C, D]; ``visible`` bool (B, H_kv, C) marks the
        attended slots (real tokens only). The chunk sums, less the attended tokens of each chunk,
        stand for the rest; one fp32 softmax runs over both (the math of
        `kvpress.kernels.sparse_decode_tail`, over the whole capacity). Returns [B, H_q, 1, D].
        """
        B, H_q, _, D = q.shape
        H, C = k_cache.shape[1], k_cache.shape[2]
        G, N = H_q // H, self.tail_k_sum.shape[2]
        qg = q.float().view(B, H, G, D) * scaling
        s = qg @ k_cache.float().transpose(-1, -2)  # (B, H_kv, G, C)
        slot = torch.arange(C, device=q.device)
        rel = slot[None, :] if row_start is None else slot[None, :] - row_start[:, None]  # (B or 1, C)
        chunk = (rel.clamp(min=0) // self.chunk_size).clamp(max=N - 1).expand(B, C)
        att = visible.float()  # (B, H_kv, C)
        # the attended tokens' scores, counts and values per chunk, taken out of the chunk sums
        at = chunk[:, None, None, :].expand(B, H, G, C)
        removed_s = s.new_zeros(B, H, G, N).scatter_add_(3, at, s * att[:, :, None])
        removed_n = att.new_zeros(B, H, N).scatter_add_(2, chunk[:, None, :].expand(B, H, C), att)
        removed_v = att.new_zeros(B, H, N, D).scatter_add_(
            2, chunk[:, None, :, None].expand(B, H, C, D), v_cache.float() * att[..., None])
        n_rest = self.tail_count[:, None, :] - removed_n  # (B, H_kv, N)
        inv = 1.0 / n_rest.clamp(min=1)
        s_chunk = (qg @ self.tail_k_sum.transpose(-1, -2) - removed_s) * inv[:, :, None]  # (B, H_kv, G, N)
        s_chunk = (s_chunk + n_rest.clamp(min=1).log()[:, :, None]).masked_fill((n_rest < 0.5)[:, :, None],
                                                                              float("-inf"))
        s_att = s.masked_fill(~visible[:, :, None], float("-inf"))
        p = torch.softmax(torch.cat([s_att, s_chunk], dim=-1), dim=-1)  # (B, H_kv, G, C + N)
        v_rest = (self.tail_v_sum - removed_v) * inv[..., None]  # (B, H_kv, N, D) mean of the rest
        out = p[..., :C] @ v_cache.float() + p[..., C:] @ v_rest  # (B, H_kv, G, D)
        return out.view(B, H_q, 1, D).to(q.dtype)

    def truncate(self, buffer: KVBuffer, row_start: torch.Tensor | None, cache) -> None:
        """Forget the tokens after the ``buffer``'s (a crop truncated it): the chunks that held a
        removed token are summed again from the kept keys / values."""
        if self.tail_k_sum is None:
            return
        k, v = buffer.keys, buffer.values
        min_row_start, length, cs = cache.min_row_start, k.shape[2], self.chunk_size
        first = max(0, length - cache.max_row_start) // cs  # first chunk (of any row) that held a removed token
        self.tail_k_sum[:, :, first:] = 0
        self.tail_v_sum[:, :, first:] = 0
        self.tail_count[:, first:] = 0
        start = min(length, min_row_start + first * cs)  # no row's chunk `first` starts earlier
        self.append(k[:, :, start:], v[:, :, start:], start, row_start, from_chunk=first)
        self.chunks = -(-length // cs)

    def _ensure(self, B: int, H: int, D: int, chunks: int, device) -> None:
        if self.tail_k_sum is not None and self.tail_k_sum.shape[2] >= chunks:
            return
        cap = -(-chunks // self.grow_chunks) * self.grow_chunks
        ks = torch.zeros(B, H, cap, D, dtype=torch.float32, device=device)
        vs, cnt = torch.zeros_like(ks), torch.zeros(B, cap, dtype=torch.float32, device=device)
        if self.tail_k_sum is not None:
            old = self.tail_k_sum.shape[2]
            ks[:, :, :old], vs[:, :, :old], cnt[:, :old] = self.tail_k_sum, self.tail_v_sum, self.tail_count
        self.tail_k_sum, self.tail_v_sum, self.tail_count = ks, vs, cnt

    def attend(self, q: torch.Tensor, buffer, index: SparseIndex, scaling: float, *, backend: str = "auto",
               validate_index: bool = True) -> torch.Tensor:
        """Exact attention of q (B, H_q, D) over ``index`` merged with the estimate of the rest (B, H_q, D).

        One pass (`kvpress.kernels.sparse_decode_tail`): the attended rows serve both parts.
        """
        n = self.chunks
        out, _ = sparse_decode_tail(q, buffer.k, buffer.v, index, self.tail_k_sum[:, :, :n], self.tail_v_sum[:, :, :n],
                                    self.tail_count[:, :n], chunk_size=self.chunk_size, scale=scaling,
                                    seq_len=buffer.length, backend=backend, validate_index=validate_index)
        return out

    def means(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-chunk mean key / value ``(B, H_kv, N, D)`` and token count ``(B, N)`` (fp32) of the
        ``N = chunks`` chunks summed so far (a chunk with count 0 holds nothing)."""
        n = self.chunks
        count = self.tail_count[:, :n]
        div = count.clamp(min=1)[:, None, :, None]
        return self.tail_k_sum[:, :, :n] / div, self.tail_v_sum[:, :, :n] / div, count

    def state_tensors(self) -> dict:
        return {"tail_k_sum": self.tail_k_sum, "tail_v_sum": self.tail_v_sum, "tail_count": self.tail_count}

    def snapshot(self) -> dict:
        """Copies of the sums (for a layer that records its state before a forward)."""
        return {"chunks": self.chunks, **{name: None if t is None else t.clone() for name, t in self.state_tensors().items()}}

    def restore(self, saved: dict) -> None:
        for name, value in saved.items():
            setattr(self, name, value)

    def merge_rows(self, rows: torch.Tensor, full: dict, batch: int) -> None:
        """Put this tail, which holds the ``rows`` of a batch of ``batch`` rows (taken out of ``full``,
        the batch's `state_tensors`), back into the batch's tensors, grown to the larger capacity."""
        sub = self.state_tensors()
        if sub["tail_k_sum"] is None:  # the rows summed nothing
            for name, t in full.items():
                setattr(self, name, t)
            return
        for name, part in sub.items():
            dim = 2 if part.dim() == 4 else 1  # the chunk dimension of the sums / of the counts
            whole = full[name]
            cap = part.shape[dim] if whole is None else max(part.shape[dim], whole.shape[dim])
            if whole is None or whole.shape[dim] < cap:
                shape = list(part.shape)
                shape[0], shape[dim] = batch, cap
                grown = part.new_zeros(shape)
                if whole is not None:
                    grown.narrow(dim, 0, whole.shape[dim]).copy_(whole)
                whole = grown
            whole.narrow(dim, 0, part.shape[dim]).index_copy_(0, rows, part)
            setattr(self, name, whole)

    def batch_select(self, indices: torch.Tensor) -> None:
        for name, t in self.state_tensors().items():
            if t is not None:
                setattr(self, name, t.index_select(0, indices.to(t.device)))
