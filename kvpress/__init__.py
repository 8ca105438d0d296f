"""kvpress: KV-cache compression and sparse decoding for Hugging Face transformers models.

Not NVIDIA's package of the same name; the two must not share an environment.

>>> import kvpress
>>> model, tok = kvpress.load_model("smollm2")
>>> ids = tok("A long document ... and a question?", return_tensors="pt").input_ids
>>> with kvpress.apply(model, kvpress.get_policy("kivi-4bit")):  # a preset, a policy name or a spec
...     out = model.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
>>> kvpress.cache_stats(out)
"""

__version__ = "0.1.0"

from .adapters import ModelAdapter, get_adapter
from .cache import CacheLayer, PolicyCache
from .patching import apply, make_cache
from .registry import Policy, get_policy, list_policies, parse_policy_spec, policy_class, register_policy
from .stats import CacheStats, cache_stats


def load_model(name_or_path: str = "smollm2", **kwargs):
    """Load ``(model, tokenizer)``; see :func:`kvpress.models.load_model`."""
    from .models import load_model as _load

    return _load(name_or_path, **kwargs)


__all__ = [
    "CacheLayer",
    "CacheStats",
    "ModelAdapter",
    "Policy",
    "PolicyCache",
    "apply",
    "cache_stats",
    "get_adapter",
    "get_policy",
    "parse_policy_spec",
    "list_policies",
    "load_model",
    "make_cache",
    "policy_class",
    "register_policy",
]
