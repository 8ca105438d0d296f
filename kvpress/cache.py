"""The policy cache: a transformers ``Cache`` whose per-layer objects are the policy's.

transformers calls ``cache.update(k, v, layer_idx)`` with the new post-RoPE keys/values, then the
attention function registered by :func:`kvpress.apply` calls ``layer.attend(q, scaling)``. A
layer therefore sees each step's (q, k, v) together and decides what to store, what to evict,
what to select and how to attend. All per-generation state lives in the layer objects, which
are created fresh for every cache.

Layer contract (subclass :class:`CacheLayer`):

``attend(q, k_new, v_new, scaling) -> out``
    Attention output [B, H_q, T, D] for the new queries over stored + new tokens; the layer
    stores the new tokens (compressing, evicting, offloading as it likes).
``state_tensors() -> dict[str, Tensor]`` / ``host_tensors()``
    Every tensor the layer keeps on the device / in the host tier; ``cache_stats`` sums their
    bytes, and batch reordering (beam search) index-selects them along dim 0.
``cached_elements() -> int``
    How many K/V scalar elements the stored state represents (for bits per element).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class CacheLayer(CacheLayerMixin):
    """Base class of policy cache layers (one per decoder layer)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: "PolicyCache", layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0  # tokens this layer has processed (left padding included)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.batch_size = 0

    # ------------------------------------------------------------ transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size = key_states.shape[0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Receive the step's new post-RoPE keys/values [B, H_kv, T, D]; stored in :meth:`attend`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise RuntimeError(
                "a kvpress cache layer received two updates without an attention call in between: "
                "run the model inside `with kvpress.apply(model, policy):`"
            )
        self._pending = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise RuntimeError("kvpress caches are built fresh for each generation; make a new one instead of reset()")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("kvpress caches cannot be cropped (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select(beam_idx)

    def batch_select(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (dim 0) of every state tensor (beam search, batch pruning)."""
        for name, tensor in {**self.state_tensors(), **self.host_tensors()}.items():
            if tensor is not None and tensor.dim() > 0:
                setattr(self, name, tensor.index_select(0, indices.to(tensor.device)))

    # ------------------------------------------------------------ policy API
    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is None:
            raise RuntimeError("kvpress attention ran without a cache update for this layer")
        k, v = self._pending
        self._pending = None
        return k, v

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scaling: float) -> torch.Tensor:
        raise NotImplementedError

    def ingest_prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a whole prompt's post-RoPE K/V [B, H_kv, T, D] whose attention already ran densely.

        Required for policies with ``full_prefill = True``: a runner prefills a context once with
        ``full`` and hands each such policy a copy, which must end in the same state as running
        that policy's own one-shot prefill.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot ingest a dense prefill")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Device-resident state, by attribute name."""
        return {}

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """Host-tier state (offloaded), by attribute name."""
        return {}

    def cached_elements(self) -> int:
        raise NotImplementedError

    def stored_tokens(self) -> int:
        """Tokens per row and KV head this layer keeps (max over heads/rows)."""
        raise NotImplementedError

    @property
    def row_start(self) -> torch.Tensor | None:
        return self.cache.row_start_on(self.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer_idx}, seen={self.seen})"


class KVBuffer:
    """Append-only K/V storage [B, H_kv, capacity, D] that grows in chunks.

    Capacity grows in fixed ``grow``-token steps, so a decode step copies the cache once every
    ``grow`` tokens instead of on every token (``torch.cat``), and the slack never exceeds
    ``grow`` tokens; the unused capacity is real memory and ``cache_stats`` counts it.
    """

    def __init__(self, grow: int = 128):
        self.grow = grow
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        if self.k is None:
            cap = _round_up(n, self.grow)
            # Zeroed, not empty: masked kernels multiply unused slots by 0, and 0 * NaN is NaN.
            self.k = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
            self.v = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
        elif self.length + n > self.k.shape[2]:
            cap = _round_up(self.length + n, self.grow)
            self.k = _grow(self.k, self.length, cap)
            self.v = _grow(self.v, self.length, cap)
        self.k[:, :, self.length : self.length + n] = k
        self.v[:, :, self.length : self.length + n] = v
        self.length += n

    @property
    def keys(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.length]


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def _grow(x: torch.Tensor, length: int, cap: int) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], x.shape[1], cap, x.shape[3])
    out[:, :, :length] = x[:, :, :length]
    return out


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """First real token per row [B] (long) of a 2D left-padded mask; None when nothing is padded.

    Raises ValueError for masks with holes or right padding.
    """
    mask = attention_mask.to(torch.bool)
    row_start = mask.shape[1] - mask.sum(dim=1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= row_start[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("kvpress supports left padding only: each mask row must be 0...0 1...1")
    return row_start.to(torch.long) if bool((row_start > 0).any()) else None


class PolicyCache(Cache):
    """A transformers ``Cache`` holding one policy layer per decoder layer.

    Build it with :func:`kvpress.make_cache` (or let :func:`kvpress.apply` build one per
    ``generate``/forward call). It tracks left padding for the batch from the 2D attention mask
    of the first forward; only left padding is supported.
    """

    def __init__(self, policy, adapter):
        self.policy = policy
        self.adapter = adapter
        self.shared: dict[str, Any] = {}  # cross-layer per-generation state (e.g. TidalDecode)
        self._row_start: torch.Tensor | None = None
        self._row_start_by_device: dict[torch.device, torch.Tensor] = {}
        self._min_row_start = self._max_row_start = 0
        self._session = None
        from .layers import SlidingWindowLayer  # kvpress.layers builds on this module

        # layers the model itself slides keep its window exactly; the policy runs the others
        layers = [policy.make_layer(self, i) if adapter.sliding_window(i) is None
                  else SlidingWindowLayer(self, i, adapter.sliding_window(i)) for i in range(adapter.num_layers)]
        super().__init__(layers=layers)

    # ------------------------------------------------------------ transformers' cache API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._session is None or not self._session.active:
            raise RuntimeError(
                "this kvpress cache is used outside `kvpress.apply(model, policy)`: its layers only attend "
                "through kvpress' attention function, so run the model inside the `with` block"
            )
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)
        if self._row_start is not None:
            self._set_row_start(self._row_start.index_select(0, beam_idx.to(self._row_start.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("kvpress caches cannot be cropped (assisted decoding is not supported)")

    def reset(self) -> None:
        raise RuntimeError("kvpress caches are built fresh for each generation; make a new one instead of reset()")

    # ------------------------------------------------------------ padding bookkeeping
    def begin_forward(self, attention_mask: torch.Tensor | None, batch: int, new_tokens: int) -> None:
        """Record the batch's left padding (first forward) and check later masks agree."""
        seen = self.get_seq_length()
        if attention_mask is None:
            if self._row_start is None:
                self._set_row_start(None)
            return
        if attention_mask.dim() != 2:
            raise ValueError(
                f"kvpress needs a 2D attention mask [batch, tokens] (left padding); got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape != (batch, seen + new_tokens):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({batch}, {seen + new_tokens}) "
                f"= (batch, cached tokens + new tokens)"
            )
        mask = attention_mask.to(torch.bool)
        if seen == 0:
            self._set_row_start(left_padding(mask))
        elif not bool(mask[:, seen:].all()):
            raise ValueError("new tokens after the prompt must not be padding (left padding only)")

    def _set_row_start(self, row_start: torch.Tensor | None) -> None:
        self._row_start = None if row_start is None else row_start.to(torch.long)
        self._row_start_by_device = {}
        self._min_row_start = 0 if row_start is None else int(self._row_start.min())
        self._max_row_start = 0 if row_start is None else int(self._row_start.max())

    def set_left_padding(self, row_start: torch.Tensor | None) -> None:
        """Declare each row's first real token [B] (long) — for callers that build caches by hand."""
        self._set_row_start(row_start)

    @property
    def min_row_start(self) -> int:
        """Smallest first-real-token index over the rows (0 without padding); no device sync."""
        return self._min_row_start

    @property
    def max_row_start(self) -> int:
        """Largest first-real-token index over the rows (0 without padding); no device sync."""
        return self._max_row_start

    def row_start_on(self, device) -> torch.Tensor | None:
        """First real token of each row [B] (long) on ``device``; None when nothing is padded."""
        if self._row_start is None:
            return None
        key = torch.device(device)
        if key not in self._row_start_by_device:
            self._row_start_by_device[key] = self._row_start.to(key)
        return self._row_start_by_device[key]

    def __repr__(self) -> str:
        return f"PolicyCache(policy={self.policy.name!r}, layers={len(self.layers)}, seen={self.get_seq_length()})"
