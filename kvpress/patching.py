"""``kvpress.apply``: run a loaded model with a policy, and put everything back afterwards.

Integration points are transformers' own, and nothing is patched at import time:

* an attention function registered with ``AttentionInterface`` under the name ``"kvpress"`` and
  selected with ``model.set_attn_implementation`` (restored on exit);
* a forward pre-hook on the decoder stack (removed on exit) that gives every forward with
  ``use_cache`` a :class:`~kvpress.cache.PolicyCache` when the caller passed none (``generate``
  passes an empty ``DynamicCache``, which is replaced) and records the batch's left padding;
* for ``generate``, the model instance's ``_prepare_cache_for_generation`` wrapped (the instance
  attribute removed on exit) so the cache generate makes is a ``PolicyCache`` from the start:
  assisted decoding asks that cache to record its past before the first forward;
* and its ``_prefill`` wrapped the same way: with ``generate(prefill_chunk_size=N)`` the prompt's
  forwards run inside :meth:`PolicyCache.prompt`, so the cache ends as after one forward;
* and ``generate`` itself, to end the past recording assisted decoding leaves on in the cache it
  returns (:meth:`PolicyCache.end_past_recording`);
* and ``init_continuous_batching`` (behind ``generate_batch``), refused with a clear error: its
  paged cache is not a policy's;
* and an instance ``__deepcopy__``: ``copy.deepcopy(model)`` inside the block returns a copy as
  the model is outside it (its own attention implementation and config, no hook, no wrapper), a
  plain model inside the block and after it.

Attention modules are mapped to their session in a weak dictionary, so the attention function
finds the cache of the forward in flight without touching transformers' objects.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from typing import Iterator

import torch
from transformers.cache_utils import Cache

from .adapters import ModelAdapter, get_adapter
from .attention import dense_causal_attention, sliding_causal_attention
from .compat import cache_keyword
from .cache import PolicyCache, left_padding
from .generate_hooks import (_check_position_limit, _compiled_call_counts_on_host, _generate_ends_recording,
                             _inputs_keep_padding_mask, _no_continuous_batching, _policy_cache_for_generate,
                             _prompt_for_prefill, _session_cache, check_cache_fits, position_limit)
from .registry import Policy

ATTN_NAME = "kvpress"
_SESSIONS_BY_MODULE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SESSIONS_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Session:
    def __init__(self, model, adapter: ModelAdapter, policy: Policy):
        self.model = model
        self.adapter = adapter
        self.policy = policy
        self.active = False
        self.current_cache: PolicyCache | None = None
        self.row_start: torch.Tensor | None = None  # for forwards without a cache


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, kvpress_attention)
    try:  # transformers builds no mask for implementations absent from the mask registry
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    except ImportError:  # pragma: no cover - older transformers
        pass


def _no_mask(*args, **kwargs):
    # kvpress layers build their own masks from positions and the recorded left padding.
    return None


def kvpress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function: hands the step to the policy's cache layer.

    Shapes follow transformers: query [B, H_q, T, D], key/value [B, H_kv, T_new, D] (what the
    cache's ``update`` returned); returns ([B, T, H_q, D], None).
    """
    session = _SESSIONS_BY_MODULE.get(module)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if session is None or not session.active:
        raise RuntimeError(
            "the 'kvpress' attention implementation is selected on a model outside `kvpress.apply`; "
            "call model.set_attn_implementation('sdpa') or use the `with kvpress.apply(...)` block"
        )
    cache = session.current_cache
    if cache is None:  # use_cache=False: plain causal attention, no policy state to keep
        row_start = session.row_start
        row_start = None if row_start is None else row_start.to(query.device)
        out = _attend_without_cache(session.adapter, module.layer_idx, query, key, value, scaling, row_start)
    else:
        layer = cache.layers[module.layer_idx]
        k_new, v_new = layer.take_pending()
        out = cache.attend(layer, query, k_new, v_new, scaling)
    return out.transpose(1, 2).contiguous(), None


def _attend_without_cache(adapter: ModelAdapter, layer_idx: int, query, key, value, scaling, row_start):
    """A forward without a cache: causal attention, or the model's window in a layer it slides."""
    window = adapter.sliding_window(layer_idx)
    if window is None:
        return dense_causal_attention(query, key, value, scaling, q_start=0, row_start=row_start)
    return sliding_causal_attention(query, key, value, scaling, window=window, row_start=row_start)


@contextlib.contextmanager
def selected_attention(model, name: str, attention) -> Iterator[None]:
    """Run ``model`` with ``attention`` registered with transformers' ``AttentionInterface`` under
    ``name`` (and no mask built for it: it makes its own) inside the block; the model's attention
    implementation is restored on exit, also after an exception."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_mask)
    attn_before = model.config._attn_implementation
    try:
        model.set_attn_implementation(name)
        yield
    finally:
        if model.config._attn_implementation != attn_before:
            model.set_attn_implementation(attn_before)


def make_cache(model, policy: Policy) -> PolicyCache:
    """Build a fresh :class:`PolicyCache` for ``model`` and ``policy``.

    For callers who pass ``past_key_values`` themselves; the cache attends only inside
    ``kvpress.apply(model, policy)`` (outside it, ``update`` raises instead of computing a wrong
    answer). The policy is checked against the model first.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"expected a kvpress policy (see kvpress.get_policy), got {type(policy).__name__}")
    adapter = get_adapter(model)
    policy.check_model(adapter)
    cache = PolicyCache(policy, adapter)
    session = _SESSIONS_BY_MODEL.get(model)
    if session is not None and session.policy is policy:
        cache._session = session
    return cache


@contextlib.contextmanager
def apply(model, policy: Policy) -> Iterator[ModelAdapter]:
    """Run ``model`` with ``policy`` inside a ``with`` block.

    Inside the block, ``model.generate(...)`` and ``model(input_ids, use_cache=True)`` use a fresh
    policy cache per call, with no other argument. On exit (normal or by exception) the
    attention implementation, config, hooks and attributes are restored, so logits are
    bit-identical to a run before ``apply``. Nesting ``apply`` on one model is refused, and so is
    a prompt longer than the model's position limit (``ValueError``, before its forward runs).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A loaded causal LM of a supported family (``kvpress.adapters.SUPPORTED_FAMILIES``).
    policy : Policy
        From :func:`kvpress.get_policy`.

    Yields
    ------
    ModelAdapter
        What kvpress knows about the model (layers, heads, RoPE).
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"expected a kvpress policy (see kvpress.get_policy), got {type(policy).__name__}")
    adapter = get_adapter(model)
    if model in _SESSIONS_BY_MODEL:
        raise RuntimeError("kvpress.apply is already active on this model; nested apply is not supported")
    policy.check_model(adapter)
    _register_attention()

    session = _Session(model, adapter, policy)
    config_before = dict(model.config.__dict__)
    attn_before = model.config._attn_implementation
    base = adapter.base_model
    handle = base.register_forward_pre_hook(_make_pre_hook(session, base), with_kwargs=True)
    modules = adapter.attention_modules()
    wrappers = {"_prepare_cache_for_generation": lambda f: _policy_cache_for_generate(session, f),
                "prepare_inputs_for_generation": _inputs_keep_padding_mask,
                "get_compiled_call": _compiled_call_counts_on_host,
                "_prefill": _prompt_for_prefill,
                "generate": lambda f: _generate_ends_recording(session, f),
                "init_continuous_batching": _no_continuous_batching}
    own_before = {name: vars(model)[name] for name in (*wrappers, "__deepcopy__") if name in vars(model)}
    try:
        for name, wrap in wrappers.items():
            if hasattr(model, name):
                setattr(model, name, wrap(getattr(model, name)))
        # (copy.deepcopy looks __deepcopy__ up on the instance, so an attribute is enough)
        vars(model)["__deepcopy__"] = _copy_outside_apply(model, base, handle, (*wrappers, "__deepcopy__"),
                                                          own_before, config_before, attn_before)
        _SESSIONS_BY_MODEL[model] = session
        for module in modules:
            _SESSIONS_BY_MODULE[module] = session
        model.set_attn_implementation(ATTN_NAME)
        session.active = True
        yield adapter
    finally:
        session.active = False
        session.current_cache = None
        handle.remove()
        for name in (*wrappers, "__deepcopy__"):
            if name in own_before:
                setattr(model, name, own_before[name])
            else:
                vars(model).pop(name, None)
        for module in modules:
            _SESSIONS_BY_MODULE.pop(module, None)
        _SESSIONS_BY_MODEL.pop(model, None)
        if model.config._attn_implementation != attn_before:
            model.set_attn_implementation(attn_before)
        _restore_config(model.config, config_before)


def _copy_outside_apply(model, base, handle, attributes, own_before: dict, config_before: dict, attn_before: str):
    """The model's ``__deepcopy__`` inside ``apply``: a deep copy, then undone in the copy what
    ``apply`` did to the model (the attributes it set, the pre-hook, the attention implementation
    and config), so the copy runs as the model does outside the block."""

    def deepcopy(memo):
        mine = vars(model).pop("__deepcopy__")
        try:
            clone = copy.deepcopy(model, memo)
        finally:
            vars(model)["__deepcopy__"] = mine
        for name in attributes:
            vars(clone).pop(name, None)
            if name in own_before:
                vars(clone)[name] = copy.deepcopy(own_before[name], memo)
        clone_base = memo.get(id(base), clone)
        for hooks in (clone_base._forward_pre_hooks, clone_base._forward_pre_hooks_with_kwargs):
            hooks.pop(handle.id, None)
        if clone.config._attn_implementation != attn_before:
            clone.set_attn_implementation(attn_before)
        _restore_config(clone.config, copy.deepcopy(config_before, memo))
        return clone

    return deepcopy


def _restore_config(config, before: dict) -> None:
    after = config.__dict__
    for key in list(after):
        if key not in before:
            del after[key]
    for key, value in before.items():
        if after.get(key, _MISSING) is not value:
            after[key] = value


_MISSING = object()


def _make_pre_hook(session: _Session, base):
    params = list(inspect.signature(base.forward).parameters)
    # transformers >= 5.24 names the decoder stack's cache argument ``cache`` (see kvpress.compat);
    # the model classes above the stack still accept, and rename, ``past_key_values``
    cache_arg = cache_keyword(type(base).forward)
    limit = position_limit(session.model.config)

    def hook(module, args, kwargs):
        if args:  # positional call of the decoder stack: name the arguments
            kwargs = {**dict(zip(params, args)), **kwargs}
            args = ()
        if cache_arg != "past_key_values" and "past_key_values" in kwargs:  # the old name, straight to the stack
            kwargs[cache_arg] = kwargs.pop("past_key_values")
        past = kwargs.get(cache_arg)
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(session.model.config, "use_cache", True)
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if inputs is None:
            raise ValueError("kvpress: the forward received neither input_ids nor inputs_embeds")
        batch, new_tokens = inputs.shape[0], inputs.shape[1]
        mask = kwargs.get("attention_mask")

        if isinstance(past, PolicyCache):
            if past.policy is not session.policy and past._session is not session:
                raise ValueError("this kvpress cache was built for another policy than the one applied")
            past._session = session
        elif past is None and not use_cache:
            _check_position_limit(limit, 0, new_tokens)
            session.current_cache = None
            session.row_start = _row_start_from_mask(mask, batch, new_tokens)
            return args, kwargs
        elif past is None or (isinstance(past, Cache) and past.get_seq_length() == 0):
            past = kwargs[cache_arg] = _session_cache(session)
        else:
            raise ValueError(
                f"kvpress.apply got a pre-filled {type(past).__name__}; pass a cache from kvpress.make_cache "
                "or none at all"
            )
        if past.get_seq_length() == 0 or past.prompt_open:
            _check_position_limit(limit, past.get_seq_length(), new_tokens)
        if past.get_seq_length() == 0:  # (before the prompt's first forward, pieces too)
            check_cache_fits(past, batch, inputs.device)
        if new_tokens > 1:  # (a one-token step is not checked: no host sync per decode step)
            _check_positions(past, kwargs.get("position_ids"), kwargs.get("cache_position"))
        past.begin_forward(mask, batch, new_tokens, device=inputs.device)
        session.current_cache = past
        return args, kwargs

    return hook


def _check_positions(cache: PolicyCache, position_ids, cache_position) -> None:
    """Refuse a forward after the prompt whose positions do not continue the cache.

    transformers' assisted generation (``prompt_lookup_num_tokens``, ``assistant_model``; seen in
    5.24) feeds the whole sequence again, from position 0, when ``generate`` gets a cache that
    already holds tokens: every earlier token would be stored a second time, after itself, at
    positions that overlap. The unpatched model does that silently; kvpress refuses it.
    """
    seen = cache.get_seq_length()
    if seen == 0 or cache.prompt_open:  # (inside a prompt block, rows may still be all padding)
        return
    if cache_position is not None and cache_position.numel():
        got, want = cache_position.reshape(-1)[:1].cpu(), torch.tensor([seen])
    elif position_ids is not None and position_ids.dim() == 2:
        got = position_ids[:, 0].cpu()  # (one host sync, for forwards of several tokens only)
        row_start = cache.row_start_on(got.device)
        want = torch.full_like(got, seen) - (0 if row_start is None else row_start)
    else:
        return
    if not torch.equal(got, want):
        raise ValueError(
            f"kvpress: this forward's positions start at {got.tolist()}, but the cache already holds {seen} tokens "
            f"(expected {want.tolist()}): its tokens would not continue the cache. transformers' assisted generation "
            "(prompt_lookup_num_tokens / assistant_model) feeds the whole sequence again when generate is given a "
            "cache that holds tokens; continue a conversation without assisted decoding, or start a fresh cache"
        )


def _row_start_from_mask(mask, batch, new_tokens):
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape != (batch, new_tokens):
        raise ValueError(f"kvpress needs a 2D attention mask of shape ({batch}, {new_tokens}); got {tuple(mask.shape)}")
    return left_padding(mask)


OBSERVE_NAME = "kvpress_observe"


@contextlib.contextmanager
def observed_attention(model, observe) -> Iterator[ModelAdapter]:
    """Run ``model`` without a cache inside the block, showing every attention call to ``observe``.

    ``observe(layer_idx, query, key)`` receives what the model hands its attention function:
    post-RoPE queries [B, H_q, T, D] and keys [B, H_kv, T, D], after whatever the family does
    before (q/k norms, fused projections, multipliers). Each layer then attends as kvpress does
    without a cache (causal; the model's window in a layer it slides), which equals the model's
    own attention (``tests/test_adapters.py``). For calibrations that need the model's real q and
    k (``kvpress calibrate double_sparsity``). Forwards must not use a cache or padding; the
    attention implementation is restored on exit.
    """
    adapter = get_adapter(model)
    if model in _SESSIONS_BY_MODEL:
        raise RuntimeError("observed_attention inside kvpress.apply on the same model is not supported")

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if key.shape[2] != query.shape[2]:
            raise RuntimeError("observed_attention runs forwards without a cache (use_cache=False)")
        observe(module.layer_idx, query, key)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = _attend_without_cache(adapter, module.layer_idx, query, key, value, scale, None)
        return out.transpose(1, 2).contiguous(), None

    with selected_attention(model, OBSERVE_NAME, attention):
        yield adapter
