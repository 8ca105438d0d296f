"""Reusable cache layers: dense storage here; sinks + recent window (StreamingLLM-style) and the
model's own sliding window in ``kvpress.window_layers``, re-exported with ``ChunkTail``."""

from __future__ import annotations

from .attention import dense_causal_attention, static_decode_attention
from .buffers import KVBuffer
from .cache_layer import CacheLayer
from .chunk_tail import ChunkTail
from .window_layers import SinkWindowLayer, SlidingWindowLayer, slot_index

__all__ = ["ChunkTail", "DenseLayer", "SinkWindowLayer", "SlidingWindowLayer", "slot_index"]


class DenseLayer(CacheLayer):
    """Keeps every token; attention is exact causal attention (the ``full`` reference).

    Croppable: any number of the latest tokens can be taken back (``rollback = "truncate"``: the
    core truncates the buffer; subclasses rebuild their metadata in :meth:`after_truncate`).
    """

    step_ints = ("seen", "buffer.length")
    rollback = "truncate"
    rollback_state = ("buffer",)

    def __init__(self, cache, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.buffer = KVBuffer()

    @property
    def static_decode(self) -> bool:
        """This class's decode step is static; a subclass with its own ``attend`` says so itself."""
        return type(self).attend is DenseLayer.attend

    def attend(self, q, k_new, v_new, scaling):
        plan = self.cache.plan
        if plan is not None and plan.static:
            return self.static_step(q, k_new, v_new, scaling)
        q_start = self.seen
        if self.buffer.k is None and self.cache.capacity:
            self.buffer.reserve(self.cache.capacity, k_new, v_new, exact=True)
        self.buffer.append(k_new, v_new)
        self.seen += k_new.shape[2]
        return dense_causal_attention(
            q, self.buffer.keys, self.buffer.values, scaling, q_start=q_start, row_start=self.row_start
        )

    def static_step(self, q, k_new, v_new, scaling):
        """One decode token at the plan's device position, attended over the whole capacity (the
        slots past the position masked): the same shapes every step of a capacity bucket."""
        plan = self.static_write(k_new, v_new)
        self.count_static_step()
        return static_decode_attention(q, self.buffer.k, self.buffer.v, scaling, end=plan.end,
                                       row_start=self.row_start)

    def static_write(self, k_new, v_new):
        """A static step's store: the token at the plan's device position (the buffer grows to the
        next bucket first if it is full: a new shape). Returns the plan."""
        if self.buffer.length + 1 > self.buffer.capacity:
            self.buffer.reserve(self.buffer.length + 1, k_new, v_new)
        plan = self.cache.plan
        self.buffer.write_at(plan.start, k_new, v_new)
        return plan

    def count_tokens(self, n: int) -> None:
        self.seen += n
        self.buffer.length += n

    def ingest_prefill(self, k, v):
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        if self.buffer.k is None and self.cache.capacity:
            self.buffer.reserve(self.cache.capacity, k, v, exact=True)
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
