"""Prefill once, decode many: hand one dense prefill to every policy whose prefill is full attention.

Besides each layer's keys and values, the dense prefill keeps the prompt's last
:data:`QUERY_TAIL` queries per layer: a policy that selects the prompt from its last queries
once it has attended densely (SnapKV's observation window) takes the prompt from them as it
would at the end of a prompt given in pieces (``CacheLayer.take_prompt``).
"""

from __future__ import annotations

import torch

from .buffers import PromptStage
from .compat import cache_kwargs, output_cache
from .window_layers import SlidingWindowLayer
from .patching import apply, make_cache
from .policy_cache import QUERY_TAIL
from .registry import Policy, get_policy


@torch.no_grad()
def dense_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Run the prompt once under ``full``; return (last-token logits [B, V], dense cache)."""
    full = get_policy("full")
    cache = make_cache(model, full)
    cache.query_tails = {}
    with apply(model, full):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1,
                    **cache_kwargs(model, cache))
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
        elif layer.stages_prompt and layer.prompt_queries > 0:  # selects the prompt from its last queries
            _take_dense_prompt(layer, dense, (dense_cache.query_tails or {}).get(layer.layer_idx))
        else:
            layer.ingest_prefill(dense.buffer.keys.clone(), dense.buffer.values.clone())
    cache.sync_positions(device=dense_cache.layers[0].device)
    return cache


def _take_dense_prompt(layer, dense, tail) -> None:
    """Hand a layer that selects a whole prompt from its last queries (``stages_prompt``) the dense
    prompt as a stage: its keys, values and last queries ``tail`` (queries, scaling), as a prompt
    given in pieces ends."""
    if tail is None or tail[0].shape[2] < min(layer.prompt_queries, dense.buffer.length):
        kept = 0 if tail is None else tail[0].shape[2]
        raise ValueError(f"{type(layer).__name__} needs the prompt's last {layer.prompt_queries} queries; the dense "
                         f"prefill kept {kept} (kvpress.prefill.QUERY_TAIL = {QUERY_TAIL})")
    q, scaling = tail
    if not layer.is_initialized:
        layer.lazy_initialization(dense.buffer.keys, dense.buffer.values)
    stage = PromptStage(keep_queries=layer.prompt_queries)
    stage.add(q, dense.buffer.keys, dense.buffer.values, scaling)
    layer.seen += dense.buffer.length
    layer.take_prompt(stage)
    layer.end_prompt()
