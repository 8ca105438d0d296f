"""The policy cache's layers: a transformers ``Cache`` (:class:`PolicyCache`, in
``kvpress.policy_cache`` and re-exported here) whose per-layer objects are the policy's.

transformers calls ``cache.update(k, v, layer_idx)`` with the new post-RoPE keys/values, then the
attention function registered by :func:`kvpress.apply` calls ``cache.attend(layer, q, k, v,
scaling)``, which runs ``layer.attend``. A layer therefore sees each step's (q, k, v) together and
decides what to store, what to evict, what to select and how to attend. All per-generation state
lives in the layer objects, which are created fresh for every cache.

Layer contract (subclass :class:`CacheLayer`):

``attend(q, k_new, v_new, scaling) -> out``
    Attention output [B, H_q, T, D] for the new queries over stored + new tokens; the layer
    stores the new tokens (compressing, evicting, offloading as it likes).
``state_tensors() -> dict[str, Tensor]`` / ``host_tensors()``
    Every tensor the layer keeps on the device / in the host tier; ``cache_stats`` sums their
    bytes, and batch reordering (beam search) index-selects them along dim 0.
``cached_elements() -> int``
    How many K/V scalar elements the stored state represents (for bits per element).
``rollback`` / ``rollback_state`` (optional: a croppable layer)
    How the layer takes its latest tokens back (transformers' ``crop``, which assisted decoding
    calls after each draft verification), run by :class:`CacheLayer`: ``"truncate"`` (it keeps
    every token; the named buffers are truncated, then ``after_truncate()``) or ``"record"``
    (bounded state: the named attributes are copied before each forward once
    ``activate_past_recording`` was called; a crop restores them and hands the kept tokens to
    ``store_again(k, v)``). A truncating layer that keeps only its latest tokens whole says how
    many in ``truncatable()``; ``end_record()`` runs after every crop. Layers that take tokens
    back their own way set ``croppable = True`` and implement ``removable()`` / ``remove_latest(n)``.
``verify_as_steps`` (optional)
    A verification (several tokens while the cache records its past) attends as one-token
    decode steps: :meth:`PolicyCache.attend` runs it so, each step under a DECODE plan.
``stages_prompt`` / ``prompt_queries`` / ``take_prompt(stage)`` (optional)
    The layer compresses a prompt given in several forwards (:meth:`PolicyCache.prompt`, which
    ``generate(prefill_chunk_size=...)`` opens under ``apply``) as a whole: the core holds the
    pieces in a :class:`PromptStage`, attends them through ``attend_staged`` and hands the stage
    over when the prompt ends.
``end_prompt()`` (optional)
    The prompt given in several forwards is complete (for layers that hold state of their own
    while it is open).
"""

from __future__ import annotations

from .buffers import KVBuffer, PromptStage
from .cache_layer import PROMPT_CROP_TOKENS, CacheLayer, RecordingLayer, crop_count, restore_value, snapshot_value
from .policy_cache import PolicyCache, left_padding

__all__ = ["PROMPT_CROP_TOKENS", "CacheLayer", "KVBuffer", "PolicyCache", "PromptStage", "RecordingLayer",
           "crop_count", "left_padding", "restore_value", "snapshot_value"]
