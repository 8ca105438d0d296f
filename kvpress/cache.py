"""The policy cache's layers: a transformers ``Cache`` (:class:`PolicyCache`, in
``kvpress.policy_cache`` and re-exported here) whose per-layer objects are the policy's.

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
``removable() -> int`` / ``remove_latest(n)`` (optional: a layer that sets ``croppable = True``)
    How many of the latest tokens the layer can take back now, and taking them back
    (transformers' ``crop``, which assisted decoding calls after each draft verification). A
    layer that keeps every token truncates; a layer that evicts or compresses as tokens arrive
    records its state before each forward once ``activate_past_recording`` was called
    (:class:`RecordingLayer`) and rolls the latest forward back.
``end_prompt()`` (optional)
    A prompt given in several forwards is complete (:meth:`PolicyCache.prompt`, which
    ``generate(prefill_chunk_size=...)`` opens under ``apply``). While ``cache.prompt_open`` is
    set, every forward continues the prompt; a layer that compresses the whole prompt at once
    (SnapKV's selection, ShadowKV's factorisation) holds it in a :class:`PromptStage` until then.
"""

from __future__ import annotations

from .buffers import KVBuffer, PromptStage  # noqa: F401  (re-exported: the layers' storage)
from .cache_layer import (PROMPT_CROP_TOKENS, CacheLayer, RecordingLayer, crop_count,  # noqa: F401
                          restore_value, snapshot_value)
from .policy_cache import PolicyCache, left_padding  # noqa: F401
