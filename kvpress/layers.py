"""Reusable cache layers: dense storage, and sinks + recent window (StreamingLLM-style)."""

from __future__ import annotations

import torch

from .attention import dense_causal_attention, streaming_attention
from .cache import CacheLayer, KVBuffer


class DenseLayer(CacheLayer):
    """Keeps every token; attention is exact causal attention (the ``full`` reference)."""

    def __init__(self, cache, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.buffer = KVBuffer()

    def attend(self, q, k_new, v_new, scaling):
        q_start = self.seen
        self.buffer.append(k_new, v_new)
        self.seen += k_new.shape[2]
        return dense_causal_attention(
            q, self.buffer.keys, self.buffer.values, scaling, q_start=q_start, row_start=self.row_start
        )

    def ingest_prefill(self, k, v):
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        self.buffer.append(k, v)
        self.seen += k.shape[2]

    @property
    def keys(self):  # transformers' layer attribute, for code that inspects caches
        return None if self.buffer.k is None else self.buffer.keys

    @keys.setter
    def keys(self, value):
        if value is not None:
            raise AttributeError("kvpress dense layers manage their own storage")

    @property
    def values(self):
        return None if self.buffer.v is None else self.buffer.values

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("kvpress dense layers manage their own storage")

    def state_tensors(self):
        return {"k": self.buffer.k, "v": self.buffer.v}

    def batch_select(self, indices):
        if self.buffer.k is not None:
            self.buffer.k = self.buffer.k.index_select(0, indices.to(self.buffer.k.device))
            self.buffer.v = self.buffer.v.index_select(0, indices.to(self.buffer.v.device))

    def stored_tokens(self) -> int:
        return self.buffer.length

    def cached_elements(self) -> int:
        if self.buffer.k is None:
            return 0
        b, h, _, d = self.buffer.k.shape
        return 2 * b * h * self.buffer.length * d


class SinkWindowLayer(CacheLayer):
    """Keeps the first ``sinks`` real tokens of each row and the most recent ``window`` tokens.

    Every query attends exactly as if tokens had arrived one at a time into ``sinks + window``
    slots, during prefill too, so resident memory and per-token attention cost are bounded at
    any length. Storage per row: k/v [B, H_kv, <= sinks + window, D] plus their sequence
    indices ``pos`` [B, <= sinks + window] (-1 marks an empty slot of a short, padded row).

    With ``rerotate=True`` the sinks are scored at StreamingLLM's in-cache positions (right
    before the window) rather than at their true distance; see :func:`streaming_attention`.
    """

    def __init__(self, cache, layer_idx: int, sinks: int, window: int, rerotate: bool = False):
        super().__init__(cache, layer_idx)
        self.sinks = sinks
        self.window = window
        self.rerotate = rerotate
        self.k = self.v = self.pos = None

    def attend(self, q, k_new, v_new, scaling):
        batch, heads, n_new, dim = k_new.shape
        if self.k is None:
            self.k = k_new.new_empty(batch, heads, 0, dim)
            self.v = v_new.new_empty(batch, heads, 0, dim)
            self.pos = torch.empty(batch, 0, dtype=torch.long, device=k_new.device)
        row_start = self.row_start
        if row_start is None:
            row_start = torch.zeros(batch, dtype=torch.long, device=k_new.device)
        out = streaming_attention(
            q, self.k, self.v, self.pos, k_new, v_new, scaling,
            q_start=self.seen, row_start=row_start, sinks=self.sinks, window=self.window,
            sink_query_fn=self.cache.adapter.rotate if self.rerotate else None,
        )
        new_pos = torch.arange(self.seen, self.seen + n_new, device=k_new.device).expand(batch, -1)
        self.seen += n_new
        self._store(torch.cat([self.k, k_new], 2), torch.cat([self.v, v_new], 2), torch.cat([self.pos, new_pos], 1), row_start)
        return out

    def _store(self, k, v, pos, row_start) -> None:
        """Keep sinks + window of each row; drop padding and evicted tokens (their memory is freed)."""
        real = pos - row_start[:, None]
        keep = (pos >= 0) & (real >= 0) & ((real < self.sinks) | (pos >= self.seen - self.window))  # (B, T)
        if bool(keep.all()):
            self.k, self.v, self.pos = k, v, pos
            return
        count = int(keep.sum(dim=1).max())
        big = torch.iinfo(torch.long).max // 2
        order = torch.argsort(torch.where(keep, pos, pos + big), dim=1)[:, :count]  # (B, count) kept first, in order
        index = order[:, None, :, None].expand(k.shape[0], k.shape[1], count, k.shape[3])
        self.k = torch.gather(k, 2, index).contiguous()
        self.v = torch.gather(v, 2, index).contiguous()
        kept = torch.gather(keep, 1, order)
        self.pos = torch.where(kept, torch.gather(pos, 1, order), torch.full_like(order, -1))

    def state_tensors(self):
        return {"k": self.k, "v": self.v, "pos": self.pos}

    def stored_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def cached_elements(self) -> int:
        if self.k is None:
            return 0
        b, h, t, d = self.k.shape
        return 2 * b * h * t * d
