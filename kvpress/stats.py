"""``cache_stats``: memory of a policy cache, summed from the tensors that exist."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class LayerStats:
    layer: int
    resident_bytes: int
    offloaded_bytes: int
    stored_tokens: int
    cached_elements: int


@dataclass(frozen=True)
class CacheStats:
    """Memory of one policy cache.

    Attributes
    ----------
    resident_bytes : int
        Bytes of every state tensor on the model's device(s) (codes, scales, factors, labels,
        positions, buffer slack: whatever storage the cache holds).
    offloaded_bytes : int
        Bytes held in the host tier.
    dense_bytes : int
        What the model's own cache of the same tokens takes in its dtype (the reference): every
        token in a full-attention layer, at most the window in a layer the model itself slides
        (Gemma 3, hybrid Qwen), where the unpatched model keeps no more either.
    tokens : int
        Tokens the sequence has seen, left padding included.
    bits_per_element : float
        All stored bits (resident + offloaded) over all cached K/V scalar elements.
    layers : list[LayerStats]
    """

    policy: str
    resident_bytes: int
    offloaded_bytes: int
    dense_bytes: int
    tokens: int
    bits_per_element: float
    layers: list = field(default_factory=list)

    def __getitem__(self, key):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        mib = 2.0**20
        return (
            f"{self.policy}: resident {self.resident_bytes / mib:.2f} MiB, offloaded {self.offloaded_bytes / mib:.2f} MiB, "
            f"dense {self.dense_bytes / mib:.2f} MiB, {self.tokens} tokens, {self.bits_per_element:.2f} bits/element"
        )


def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def cache_stats(cache) -> CacheStats:
    """Memory and size of a :class:`kvpress.cache.PolicyCache`.

    Parameters
    ----------
    cache : PolicyCache, or a model / ``generate(..., return_dict_in_generate=True)`` output holding one
        E.g. ``kvpress.cache_stats(model.generate(..., return_dict_in_generate=True))`` under apply.

    Returns
    -------
    CacheStats
        ``resident_bytes``, ``offloaded_bytes``, ``dense_bytes``, ``tokens``,
        ``bits_per_element`` and a per-layer breakdown.
    """
    from .cache import PolicyCache
    from .compat import output_cache

    if not isinstance(cache, PolicyCache) and hasattr(type(cache), "__dataclass_fields__"):
        cache = output_cache(cache)  # a model output: its cache field (named per transformers version)
    if not isinstance(cache, PolicyCache):
        raise TypeError(f"cache_stats expects a kvpress PolicyCache, got {type(cache).__name__}")
    adapter = cache.adapter
    layers = []
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            layers.append(LayerStats(i, 0, 0, 0, 0))
            continue
        stage = getattr(layer, "prompt_stage", None)  # an open prompt's pieces the core holds for the layer
        staged = () if stage is None else stage.state_tensors().values()
        layers.append(
            LayerStats(
                layer=i,
                resident_bytes=tensor_bytes([*layer.state_tensors().values(), *staged]),
                offloaded_bytes=tensor_bytes(layer.host_tensors().values()),
                stored_tokens=int(layer.stored_tokens()) + (0 if stage is None else stage.length),
                cached_elements=int(layer.cached_elements()) + (0 if stage is None else stage.cached_elements()),
            )
        )
    resident = sum(s.resident_bytes for s in layers)
    offloaded = sum(s.offloaded_bytes for s in layers)
    elements = sum(s.cached_elements for s in layers)
    tokens = cache.get_seq_length()
    batch = max((layer.batch_size for layer in cache.layers), default=0)
    dense = dense_kv_bytes(adapter, tokens, batch)
    return CacheStats(
        policy=cache.policy.name,
        resident_bytes=resident,
        offloaded_bytes=offloaded,
        dense_bytes=dense,
        tokens=tokens,
        bits_per_element=(8.0 * (resident + offloaded) / elements) if elements else 0.0,
        layers=layers,
    )


def dense_kv_bytes(adapter, tokens: int, batch: int) -> int:
    """Bytes of the keys and values the model's own cache holds for ``batch`` rows of ``tokens``
    tokens (a layer the model slides: its window), in the model's dtype."""
    itemsize = torch.empty((), dtype=adapter.model.dtype).element_size()
    windows = (adapter.sliding_window(i) for i in range(adapter.num_layers))
    kept = sum(tokens if w is None else min(tokens, w) for w in windows)  # tokens the model's own layers hold
    return 2 * kept * batch * adapter.num_kv_heads * adapter.head_dim * itemsize


def planned_dense_bytes(cache, batch: int) -> int | None:
    """The fewest bytes the planned cache of a policy that keeps every token on the device holds
    once it has stored anything (``full`` and the selection policies, whose metadata comes on top):
    keys and values of ``batch`` rows at the planned capacity in each layer (a layer the model
    slides: its window). None when the cache is not planned or a layer keeps fewer tokens (a
    compressing policy: its bytes are known only once it runs)."""
    from .layers import DenseLayer
    from .window_layers import SlidingWindowLayer

    if not cache.capacity:
        return None
    for i, layer in enumerate(cache.layers):  # (DenseLayer: the selection policies' layers too)
        slides = isinstance(layer, SlidingWindowLayer) and cache.adapter.sliding_window(i) is not None
        if not (slides or isinstance(layer, DenseLayer)):
            return None
    return dense_kv_bytes(cache.adapter, cache.capacity, batch)
