"""What differs between the transformers versions kvpress supports (5.x).

transformers 5.24 renamed the cache argument of every model's ``forward`` and of the decoder
stack from ``past_key_values`` to ``cache``, and the output field with it (the old names still
work with a deprecation warning, to be removed in a later release). Code in kvpress that calls a
model itself names the argument through :func:`cache_kwargs` and reads the cache back through
:func:`output_cache`, so it runs warning-free on both sides of the rename.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

_NEW, _OLD = "cache", "past_key_values"


@lru_cache(maxsize=64)
def _keyword_of(forward) -> str:
    params = inspect.signature(forward).parameters
    return _NEW if _NEW in params and _OLD not in params else _OLD


def cache_keyword(forward) -> str:
    """``"cache"`` if ``forward`` (a model's or decoder stack's forward) takes it, else ``"past_key_values"``."""
    return _keyword_of(getattr(forward, "__func__", forward))


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for ``model(...)``, with the cache argument's name in this transformers version."""
    return {cache_keyword(type(model).forward): cache}


def output_cache(out):
    """The cache returned in a model or ``generate`` output (field ``cache`` or ``past_key_values``)."""
    fields = getattr(type(out), "__dataclass_fields__", {})
    if _NEW in fields:
        return getattr(out, _NEW)
    if _OLD in fields:
        return getattr(out, _OLD)
    raise TypeError(f"{type(out).__name__} holds no cache (expected a field {_NEW!r} or {_OLD!r})")
