"""kvpress: KV-cache compression and sparse decoding for Hugging Face transformers models.

Not NVIDIA's package of the same name; the two must not share an environment (importing this
package where NVIDIA's ``kvpress`` distribution is also installed raises ImportError).

>>> import kvpress
>>> model, tok = kvpress.load_model("smollm2")
>>> ids = tok("A long document ... and a question?", return_tensors="pt").input_ids
>>> with kvpress.apply(model, kvpress.get_policy("kivi-4bit")):  # a preset, a policy name or a spec
...     out = model.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
>>> kvpress.cache_stats(out)

The names that need torch (``apply``, ``PolicyCache``, ``get_adapter``, ...) are imported on
first use, so ``import kvpress`` and the command line's ``--help`` stay fast.
"""

__version__ = "0.1.0"


def _refuse_nvidia_kvpress() -> None:
    """Raise ImportError when NVIDIA's ``kvpress`` distribution is installed in this environment.

    Both distributions write their code into the same ``kvpress/`` folder, so whichever was
    installed last has overwritten files of the other: neither works reliably.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution("kvpress")
    except metadata.PackageNotFoundError:
        return
    if any(str(path).replace("\\", "/") == "kvpress/__init__.py" for path in dist.files or ()):
        raise ImportError(
            f"NVIDIA's kvpress (distribution 'kvpress' {dist.version}) is installed in this environment, and "
            "kvpress-toolkit (this package) shares its kvpress/ folder; keep one: pip uninstall kvpress "
            "kvpress-toolkit, then pip install kvpress-toolkit (or NVIDIA's kvpress) in a separate environment"
        )


_refuse_nvidia_kvpress()

from .registry import Policy, get_policy, list_policies, parse_policy_spec, policy_class, register_policy  # noqa: E402

# public name -> submodule that defines it, imported on first access (these pull in torch)
_LAZY = {
    "ModelAdapter": "adapters",
    "get_adapter": "adapters",
    "CacheLayer": "cache",
    "PolicyCache": "cache",
    "apply": "patching",
    "make_cache": "patching",
    "CacheStats": "stats",
    "cache_stats": "stats",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):  # a submodule not imported yet: kvpress.evals, kvpress.attention, ...
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
