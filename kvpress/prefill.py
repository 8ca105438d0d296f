"""Prefill once, decode many: hand one dense prefill to every policy whose prefill is full attention."""

from __future__ import annotations

import torch

from .compat import output_cache
from .window_layers import SlidingWindowLayer
from .patching import apply, make_cache
from .registry import Policy, get_policy


@torch.no_grad()
def dense_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Run the prompt once under ``full``; return (last-token logits [B, V], dense cache)."""
    full = get_policy("full")
    with apply(model, full):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], output_cache(out)


def cache_from_dense(model, policy: Policy, dense_cache, attention_mask: torch.Tensor | None = None,
                     capacity: int | None = None):
    """A fresh cache of ``policy`` holding the prompt of ``dense_cache`` (not modified); with
    ``capacity`` (prompt + new tokens) planned for that many tokens, as ``generate`` plans its cache.

    Raises ValueError for policies whose prefill is not plain full attention.
    """
    if not policy.prefills_densely():
        raise ValueError(f"policy {policy.name!r} runs its own prefill (its prefill is not plain dense attention)")
    cache = make_cache(model, policy)
    if capacity is not None:
        cache.plan_capacity(capacity)
    if attention_mask is not None:
        cache.begin_forward(attention_mask, attention_mask.shape[0], attention_mask.shape[1])
    for layer, dense in zip(cache.layers, dense_cache.layers):
        if isinstance(layer, SlidingWindowLayer):  # a layer the model slides: the same window in both caches
            layer.copy_from(dense)
        else:
            layer.ingest_prefill(dense.buffer.keys.clone(), dense.buffer.values.clone())
    cache.sync_positions(device=dense_cache.layers[0].device)
    return cache
