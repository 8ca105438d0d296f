"""The wrappers :func:`kvpress.apply` puts on a model instance's generation methods (removed on exit).

* ``_prepare_cache_for_generation``: the empty cache ``generate`` makes becomes a ``PolicyCache``,
  planned for ``max_length`` tokens;
* ``prepare_inputs_for_generation``: the 2D padding mask reaches the policy cache (none for a decode
  step);
* ``get_compiled_call``: transformers' compiled forward with the host token counts advanced after
  each call;
* ``_prefill``: a prompt ``generate`` cuts into pieces runs inside :meth:`PolicyCache.prompt`;
* ``generate``: past recording ended on the caches it used;
* ``init_continuous_batching``: refused (its paged cache is not a policy's).

Also the model's position limit, which prompts are checked against before they run.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers.cache_utils import Cache

from .cache import PolicyCache


def _policy_cache_for_generate(session, prepare):
    """``generate``'s cache preparation, then its fresh empty cache swapped for a ``PolicyCache``."""

    def wrapped(generation_config, model_kwargs, *args, **kwargs):
        out = prepare(generation_config, model_kwargs, *args, **kwargs)
        for key in ("cache", "past_key_values"):
            past = model_kwargs.get(key)
            if isinstance(past, Cache) and not isinstance(past, PolicyCache) and past.get_seq_length() == 0:
                model_kwargs[key] = _session_cache(session)
                max_length = getattr(generation_config, "max_length", None)
                if isinstance(max_length, int) and max_length > 0:
                    model_kwargs[key].plan_capacity(max_length)
                asked = getattr(generation_config, "cache_implementation", None)
                if asked not in (None, "dynamic"):
                    warnings.warn(f"generate(cache_implementation={asked!r}) runs with the kvpress policy's cache "
                                  f"instead ({session.policy.name}); the requested cache is not used inside "
                                  "kvpress.apply", UserWarning, stacklevel=4)
        return out

    return wrapped


def _inputs_keep_padding_mask(prepare):
    """``generate``'s per-forward input preparation, with the 2D padding mask handed to a policy
    cache's forward as it is: transformers turns it into the 4D mask of a compileable cache, which
    carries no left padding for kvpress (it builds its own masks). A decode step gets no mask at
    all: the cache knows the rows' padding from the prompt, and a mask that grows by a column every
    step would give a compiled step a new input shape every step."""
    signature = inspect.signature(prepare)  # once: binding per step is cheap, building it is not
    takes_mask = "attention_mask" in signature.parameters

    def wrapped(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        cache = inputs.get("cache", inputs.get("past_key_values"))
        if not isinstance(cache, PolicyCache) or not takes_mask:
            return inputs
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else \
            signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
        tokens = inputs.get("input_ids")
        if tokens is None:
            tokens = inputs.get("inputs_embeds")
        decode = (tokens is not None and tokens.shape[1] == 1 and cache.get_seq_length() > 0
                  and not cache.prompt_open)
        inputs["attention_mask"] = None if decode or mask is None or mask.dim() != 2 else mask
        return inputs

    return wrapped


def _compiled_call_counts_on_host(get_compiled_call):
    """transformers' compiled forward (``generate``'s decode on a compileable cache), called with a
    policy cache's host token counts deferred to after each call: the compiled step then reads no
    host integer that changes every step (one graph; no per-step input a CUDA graph would re-record
    for), and the counts are advanced here, outside the graph. Before the call the cache's state is
    tagged static (`PolicyCache.before_static_step`) and the integers its layers advance are named
    dynamic to dynamo (`PolicyCache.dynamic_sources`), so the first trace is the only one."""

    def wrapped(*args, **kwargs):
        compiled = get_compiled_call(*args, **kwargs)

        def call(*c_args, **c_kwargs):
            cache = c_kwargs.get("cache", c_kwargs.get("past_key_values"))
            if not isinstance(cache, PolicyCache):
                return compiled(*c_args, **c_kwargs)
            cache.before_static_step()
            cache.step_shared.clear()  # a step's cross-layer scratch: each compiled step finds it empty
            cache.defer_counts = True
            config = torch.compiler.config
            user_sources = getattr(config, "dynamic_sources", None)  # (torch >= 2.7)
            if user_sources is not None:
                config.dynamic_sources = ",".join(s for s in (user_sources, cache.dynamic_sources()) if s)
            try:
                return compiled(*c_args, **c_kwargs)
            finally:
                if user_sources is not None:
                    config.dynamic_sources = user_sources
                cache.defer_counts = False
                cache.count_deferred()

        return call

    return wrapped


def _generate_ends_recording(session, generate):
    """``generate``, then past recording ended on the policy caches it used (given or made), also
    when it raised: assisted decoding turns recording on and leaves it on (transformers 5.24)."""

    def wrapped(*args, **kwargs):
        given = [kwargs.get(key) for key in ("cache", "past_key_values")]
        try:
            return generate(*args, **kwargs)
        except torch.cuda.OutOfMemoryError as exc:
            if str(exc).startswith("kvpress:"):
                raise
            cache = next((c for c in given if isinstance(c, PolicyCache)), session.current_cache)
            raise _out_of_memory(session, cache, exc) from exc
        finally:
            used = {id(c): c for c in given + [session.current_cache] if isinstance(c, PolicyCache)}
            for cache in used.values():
                cache.end_past_recording()

    return wrapped


def _no_continuous_batching(init):
    """transformers' continuous batching (``generate_batch``, ``init_continuous_batching``) runs its
    own paged cache and attention: refused inside ``apply`` rather than run without the policy."""

    def refused(*args, **kwargs):
        raise NotImplementedError(
            "continuous batching (generate_batch / init_continuous_batching) keeps its own paged KV cache, "
            "which kvpress policies do not manage; inside kvpress.apply use model.generate (left-padded "
            "batches are supported), or leave the block to use continuous batching without a policy")

    return refused


def _prompt_for_prefill(prefill):
    """``generate``'s prefill; a prompt it cuts into several forwards (``prefill_chunk_size``) on a
    policy cache (empty, or holding an earlier turn) runs inside :meth:`PolicyCache.prompt`."""

    def wrapped(input_ids, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        chunk = getattr(generation_config, "prefill_chunk_size", None)
        if isinstance(cache, PolicyCache) and chunk is not None:  # a long prompt: refused before its first piece
            _check_position_limit(position_limit(cache.adapter.model.config), 0, input_ids.shape[-1])
        pieces = (isinstance(cache, PolicyCache) and chunk is not None and input_ids.shape[-1] > chunk
                  and cache.prompt_refusal() is None)
        if not pieces:
            return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        with cache.prompt():
            return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)

    return wrapped


def _session_cache(session) -> PolicyCache:
    cache = PolicyCache(session.policy, session.adapter)
    cache._session = session
    return cache


def position_limit(config) -> int | None:
    """The positions ``config``'s model was built for: ``max_position_embeddings``, or what a
    scaled RoPE (``factor`` x the original length) reaches when that is more; None when unnamed."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    for params in [rope] + [v for v in rope.values() if isinstance(v, dict)] if isinstance(rope, dict) else []:
        factor = params.get("factor")
        if params.get("rope_type", params.get("type")) != "default" and isinstance(factor, (int, float)):
            limit = max(limit, int(factor * (params.get("original_max_position_embeddings") or limit)))
    return limit


GIB = 2**30


def check_cache_fits(cache: PolicyCache, batch: int, device, free_bytes: int | None = None) -> None:
    """Refuse, before the prompt's forward, a planned cache that cannot fit: for a policy that keeps
    every token on the device (:func:`kvpress.stats.planned_dense_bytes`), the bytes its cache
    needs against the device's free memory (on CUDA; ``free_bytes`` given: those). Raises
    ``torch.cuda.OutOfMemoryError`` naming both; a compressing policy's bytes are not known here."""
    from .stats import planned_dense_bytes

    needed = planned_dense_bytes(cache, batch)
    if needed is None:
        return
    total = None
    if free_bytes is None:
        device = torch.device(device)
        if device.type != "cuda":
            return
        free_bytes, total = torch.cuda.mem_get_info(device)
        free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if needed > free_bytes:
        of = f" of {total / GIB:.2f} GiB" if total else ""
        raise torch.cuda.OutOfMemoryError(
            f"kvpress: {cache.policy.name}'s cache needs at least {needed / GIB:.2f} GiB for {batch} x "
            f"{cache.capacity} tokens (keys and values of every token it plans for), and {free_bytes / GIB:.2f} "
            f"GiB{of} is free on {device}; use a smaller batch or max_new_tokens, or a policy that keeps less "
            "(a quantizer, an eviction policy or shadowkv's host tier)")


def _out_of_memory(session, cache, exc: BaseException) -> torch.cuda.OutOfMemoryError:
    """The device ran out of memory inside ``generate``: the same error, naming the policy, its
    cache's size when it failed and the device's memory."""
    from .stats import cache_stats

    where = ""
    if isinstance(cache, PolicyCache):
        held = cache_stats(cache)
        where = (f" with its cache holding {held.resident_bytes / GIB:.2f} GiB on the device for {held.tokens} "
                 f"tokens ({cache.capacity or 'no'} planned)")
    memory = ""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        memory = f"; {free / GIB:.2f} GiB of {total / GIB:.2f} GiB free now"
    return torch.cuda.OutOfMemoryError(
        f"kvpress: out of device memory in generate under {session.policy.name}{where}{memory}. A smaller batch, "
        f"max_new_tokens or prompt pieces (prefill_chunk_size) need less; so does a policy that keeps less. "
        f"The error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


def _check_position_limit(limit: int | None, seen: int, new_tokens: int) -> None:
    """Refuse a prompt that ends past the model's position limit, before its forward runs.

    Checked on a cache's first forward and on every piece of a prompt given in several forwards
    (and on forwards without a cache); later forwards may continue past the limit (decode steps,
    streaming a long text through a policy that bounds what it keeps), as the caller chooses.
    """
    if limit is not None and seen + new_tokens > limit:
        total = f"{seen} cached + {new_tokens} new = {seen + new_tokens}" if seen else f"{new_tokens}"
        raise ValueError(
            f"kvpress: the prompt has {total} tokens, beyond this model's position limit of {limit} "
            f"(config.max_position_embeddings); give it at most {limit} tokens (with left padding, the "
            "longest row counts)"
        )
