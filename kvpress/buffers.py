"""Token storage the cache layers share: :class:`KVBuffer` (append-only K/V growing in steps) and
:class:`PromptStage` (a prompt held densely while it arrives in several forwards)."""

from __future__ import annotations

import torch

from .plan import capacity_bucket, static_address


def doubled_slots(tokens: int, limit: int, step: int = 128) -> int:
    """Slots of storage that holds at most ``limit`` tokens, for ``tokens`` of them: ``step`` doubled
    until they fit, at most ``limit`` (a bounded part that grows with the tokens actually seen)."""
    if tokens >= limit:
        return limit
    slots = step
    while slots < tokens:
        slots *= 2
    return min(slots, limit)


class KVBuffer:
    """Append-only K/V storage [B, H_kv, capacity, D] that grows in buckets.

    Capacity is a bucket of :func:`kvpress.plan.capacity_bucket` (a multiple of ``grow`` and of an
    eighth of the power of two below the length, so the slack stays under ~12.5% past ``8 * grow``
    tokens and a growing buffer reallocates a logarithmic number of times), or what
    :meth:`reserve` asked for: a cache planned for a generation's whole length never reallocates
    while it decodes. The unused capacity is real memory and ``cache_stats`` counts it.
    """

    def __init__(self, grow: int = 128):
        self.grow = grow
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def reserve(self, tokens: int, like_k: torch.Tensor, like_v: torch.Tensor, exact: bool = False) -> None:
        """Make room for ``tokens`` tokens in all: rounded up to a bucket while growing, or, with
        ``exact`` (a planned capacity, already a multiple of ``grow``), just that; ``like_k`` /
        ``like_v`` give the batch, heads, head size, dtype and device of a first allocation."""
        if tokens <= self.capacity:
            return
        cap = -(-tokens // self.grow) * self.grow if exact else capacity_bucket(tokens, self.grow)
        if self.k is None:
            # Zeroed, not empty: masked kernels multiply unused slots by 0, and 0 * NaN is NaN.
            self.k = like_k.new_zeros(like_k.shape[0], like_k.shape[1], cap, like_k.shape[3])
            self.v = like_v.new_zeros(like_v.shape[0], like_v.shape[1], cap, like_v.shape[3])
        else:
            self.k = _grow(self.k, self.length, cap)
            self.v = _grow(self.v, self.length, cap)
        static_address(self.k, self.v)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        if self.length + n > self.capacity:
            self.reserve(self.length + n, k, v)
        self.k[:, :, self.length : self.length + n] = k
        self.v[:, :, self.length : self.length + n] = v
        self.length += n

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (the freed slots zeroed; the capacity stays)."""
        if self.k is not None and length < self.length:
            self.k[:, :, length : self.length] = 0
            self.v[:, :, length : self.length] = 0
        self.length = min(self.length, length)

    def snapshot(self) -> int:
        """What a recorded forward must keep to undo its appends: the length (the buffer only appends)."""
        return self.length

    def restore(self, length: int) -> None:
        self.truncate(length)

    def write_at(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one token per row ``k`` / ``v`` [B, H_kv, 1, D] at the index held by the device
        tensor ``pos`` ([1] long; a static decode step). The caller has made room and counts it
        (``length``)."""
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)

    @property
    def keys(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.length]


def _grow(x: torch.Tensor, length: int, cap: int) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], x.shape[1], cap, x.shape[3])
    out[:, :, :length] = x[:, :, :length]
    return out


class PromptStage:
    """A prompt's K/V (and its latest queries) while it arrives in several forwards.

    For layers that compress a prompt as a whole: each piece attends densely to everything
    staged so far (as one forward of the whole prompt would), and ``end_prompt`` hands the
    layer the whole prompt. Growing in ``grow``-token steps, it costs one dense copy of the
    layer's prompt until then (counted by ``cache_stats`` through the layer's state).
    """

    def __init__(self, keep_queries: int = 0, grow: int = 1024):
        self.buffer = KVBuffer(grow)
        self.keep_queries = keep_queries
        self.queries: torch.Tensor | None = None  # the latest ``keep_queries`` queries [B, H_q, <=n, D]
        self.scaling: float | None = None

    @property
    def length(self) -> int:
        return self.buffer.length

    def add(self, q, k_new, v_new, scaling: float) -> int:
        """Stage ``k_new``/``v_new`` (and keep the latest queries); returns the piece's first index."""
        q_start = self.buffer.length
        self.buffer.append(k_new, v_new)
        self.scaling = scaling
        if self.keep_queries:
            q_all = q if self.queries is None else torch.cat([self.queries, q], dim=2)
            self.queries = q_all[:, :, max(0, q_all.shape[2] - self.keep_queries):]
        return q_start

    def attend(self, q, k_new, v_new, scaling: float, row_start) -> torch.Tensor:
        """Stage ``k_new``/``v_new`` and return the causal attention of ``q`` over the staged prompt."""
        from .attention import dense_causal_attention  # kvpress.attention imports the kernels

        q_start = self.add(q, k_new, v_new, scaling)
        return dense_causal_attention(q, self.buffer.keys, self.buffer.values, scaling, q_start=q_start,
                                      row_start=row_start)

    def window_queries(self, n: int) -> torch.Tensor:
        """The last ``n`` staged queries (fewer when fewer were staged)."""
        return self.queries[:, :, max(0, self.queries.shape[2] - n):]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The held tensors, named for a layer's ``state_tensors`` (counted by ``cache_stats``)."""
        return {"_stage_k": self.buffer.k, "_stage_v": self.buffer.v, "_stage_q": self.queries}

    def cached_elements(self) -> int:
        """K+V scalar elements of the prompt held so far."""
        b, h, _, d = self.buffer.k.shape
        return 2 * b * h * self.length * d
