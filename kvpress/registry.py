"""Policy base class and the name -> policy registry.

A policy is a frozen, validated dataclass: its fields are the configuration, its class
attributes describe it (name, paper, capabilities), and :meth:`Policy.make_layer` builds the
per-layer cache objects that hold the state of one generation. Policies register themselves
with :func:`register_policy`; ``kvpress.policies`` imports every module in its folder, so
adding a policy touches one file.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from typing import Any, ClassVar

_REGISTRY: dict[str, type["Policy"]] = {}
_LOADED = False


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class of every policy config.

    Subclasses are ``@dataclass(frozen=True)`` and set the class attributes below. Field values
    are checked in :meth:`validate` (called from ``__post_init__``), which raises ``ValueError``
    naming the allowed range. Every int field has a range with an upper bound: token counts
    (budgets, windows, sinks, chunk, flush and fold sizes) at most `MAX_TOKENS` = 2**24 (16M
    tokens), layer counts and indices at most `MAX_LAYERS`, channel counts at most `MAX_CHANNELS`,
    seeds in ``0 .. MAX_SEED`` (2**31 - 1); a policy that leaves an int field unbounded still gets
    ``|value| <= MAX_SEED`` from ``__post_init__``, so no field reaches the kernels as a value
    that overflows or allocates without limit.

    Capability flags (class attributes, read by the runner/CLI instead of type checks):

    ``full_prefill``
        Prefill attention is plain full causal attention, so a runner may prefill a context once
        and hand a copy of the dense cache to each such policy (:meth:`CacheLayer.ingest_prefill`).
        This is the class default; :meth:`prefills_densely` answers for one configured policy
        (``duo`` with ``prefill="dense"`` says yes although the class says no).
    ``keeps_full_cache``
        The whole KV cache stays resident (selection policies); eviction/quantization set False.
    ``needs_artifact``
        The policy reads a calibration artifact (DuoAttention, Double Sparsity).
    ``croppable``
        The cache can take back the tokens of its latest forward (transformers' ``Cache.crop``),
        which assisted decoding (``generate(assistant_model=...)``,
        ``generate(prompt_lookup_num_tokens=...)``) does after every draft verification; see
        :meth:`kvpress.cache.CacheLayer.crop`. The contract tests check the layers agree.
    ``verifies_as_decoding``
        With past recording on, a forward of several tokens after the prompt (assisted decoding's
        verification) attends as that many decode steps would, so assisted decoding keeps plain
        decoding's greedy tokens (`tests/test_crop.py`). True for every registered policy (the
        quantizers flush inside a verification where decode steps would and take the flush back at
        the crop); a policy that cannot says False.
    ``chunked_prompt_exact``
        A prompt given in several forwards (``generate(prefill_chunk_size=N)``, or
        :meth:`kvpress.cache.PolicyCache.prompt`) leaves the cache and outputs one forward of the
        whole prompt would (up to float rounding). False for the quantizers: each piece attends
        to the earlier pieces as stored, quantized beyond the full-precision window, as decode
        steps and chunked prefill in serving systems read a quantized cache.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    full_prefill: ClassVar[bool] = True
    keeps_full_cache: ClassVar[bool] = True
    needs_artifact: ClassVar[bool] = False
    croppable: ClassVar[bool] = False
    verifies_as_decoding: ClassVar[bool] = True
    chunked_prompt_exact: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_field_types(self)
        self.validate()
        _check_int_fields(self)

    def prefills_densely(self) -> bool:
        """Whether this configured policy's prefill is plain dense attention (see ``full_prefill``)."""
        return type(self).full_prefill

    # ----------------------------------------------------------------- hooks for subclasses
    def validate(self) -> None:
        """Raise ValueError when a field is out of range. Called on construction."""

    def check_model(self, adapter) -> None:
        """Raise ValueError when the policy cannot run on this model (head counts, artifacts)."""

    def make_layer(self, cache, layer_idx: int):
        """Return the :class:`kvpress.cache.CacheLayer` that holds layer ``layer_idx``'s state."""
        raise NotImplementedError(f"policy {self.name!r} does not implement make_layer")

    def with_budget(self, budget: int) -> "Policy":
        """Return a copy whose per-step attended tokens per KV head equal ``budget``.

        The eval runner sweeps budgets through this method; policies without a budget raise.
        """
        if "budget" in {f.name for f in dataclasses.fields(self)}:
            return dataclasses.replace(self, budget=int(budget))
        raise ValueError(f"policy {self.name!r} has no token budget")

    @classmethod
    def example(cls, adapter) -> "Policy":
        """A small valid instance for ``adapter``'s model, used by the contract tests.

        Policies that read calibration artifacts override this to build a synthetic artifact for
        the (tiny, random) test model; budgets are kept small so compression really happens.
        """
        policy = cls()
        try:
            return policy.with_budget(24)
        except ValueError:
            return policy

    # ----------------------------------------------------------------- helpers
    def replace(self, **overrides: Any) -> "Policy":
        """A validated copy with some fields changed (unknown fields: ValueError)."""
        _check_field_names(type(self), overrides)
        return dataclasses.replace(self, **_coerce_overrides(type(self), overrides))

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-friendly dict, with the policy name under ``"policy"``."""
        out: dict[str, Any] = {"policy": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


# --------------------------------------------------------------------- validation helpers
MAX_TOKENS = 2**24  # 16M tokens: far beyond any context a model here runs, far below an overflow
MAX_LAYERS = 2**12
MAX_CHANNELS = 2**16
MAX_SEED = 2**31 - 1


def check_tokens(name: str, value: int, low: int = 0) -> None:
    """Raise ValueError unless ``low <= value <= MAX_TOKENS`` (a token count)."""
    check_int(name, value, low, MAX_TOKENS)


def check_int(name: str, value: int, low: int | None = None, high: int | None = None) -> None:
    """Raise ValueError unless ``low <= value <= high`` (either bound may be None)."""
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else str(low)
        hi = "inf" if high is None else str(high)
        raise ValueError(f"{name}={value!r} is out of range; allowed: {lo} <= {name} <= {hi}")


def _check_int_fields(policy: Policy) -> None:
    """The bound every int field keeps even where a policy's `validate` sets none."""
    for name, tp in _field_types(type(policy)).items():
        value = getattr(policy, name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SEED:
            raise ValueError(f"{name}={value!r} is out of range; allowed: |{name}| <= {MAX_SEED}")


def check_choice(name: str, value: Any, allowed) -> None:
    """Raise ValueError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {sorted(allowed)}")


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _accepts(tp, value) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple)
    return isinstance(value, origin or tp)


def _check_field_types(policy: Policy) -> None:
    for name, tp in _field_types(type(policy)).items():
        value = getattr(policy, name)
        if not _accepts(tp, value):
            raise TypeError(
                f"{type(policy).__name__}.{name} must be {_type_name(tp)}, got {type(value).__name__} ({value!r})"
            )


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(tp, value):
    """Convert CLI/eval strings ("256", "true", "none") to the field's type; leave others alone."""
    if not isinstance(value, str):
        return value
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if type(None) in args and value.lower() in ("none", "null", ""):
        return None
    for arg in args:
        try:
            if arg is bool:
                if value.lower() in ("true", "1", "yes"):
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
            elif arg is int:
                return int(value)
            elif arg is float:
                return float(value)
            elif arg is str:
                return value
        except ValueError:
            continue
    return value


def _check_field_names(cls, overrides: dict) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"policy {cls.name!r} has no field(s) {unknown}; its fields are: {known}")


def _coerce_overrides(cls, overrides: dict) -> dict:
    types_ = _field_types(cls)
    return {k: _coerce(types_[k], v) for k, v in overrides.items()}


# --------------------------------------------------------------------- registry
def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: add a policy class to the registry under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError("register_policy expects a Policy subclass")
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a policy named {cls.name!r} is already registered ({_REGISTRY[cls.name].__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def _ensure_loaded() -> None:
    global _LOADED
    if not _LOADED:
        importlib.import_module("kvpress.policies")
        _LOADED = True


def list_policies() -> list[str]:
    """Names of every registered policy, sorted."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The registered class for ``name`` (ValueError listing the known names otherwise)."""
    _ensure_loaded()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def parse_policy_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split a policy spec ``name[:field=value[:field=value...]]`` into name and field overrides.

    The form every command line takes (``kivi:bits=4``, ``duo:random_heads_seed=0``); values stay
    strings, which :func:`get_policy` converts to the field types.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a policy spec is a string, got {type(spec).__name__}")
    name, *parts = spec.split(":")
    fields: dict[str, str] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"policy spec {spec!r}: expected name:field=value[:field=value...], got {part!r}")
        if key in fields:
            raise ValueError(f"policy spec {spec!r} sets {key!r} twice")
        fields[key] = value.strip()
    return name.strip(), fields


def get_policy(name: str, **overrides: Any) -> Policy:
    """Build the policy ``name`` with its defaults, changed by ``overrides``.

    Parameters
    ----------
    name : str
        A registered name (see :func:`list_policies`), a preset (``kvpress.presets``), or a spec
        with fields as the command lines take them: ``get_policy("kivi:bits=4:residual_length=64")`` is
        ``get_policy("kivi", bits=4, residual_length=64)`` (:func:`parse_policy_spec`).
    **overrides
        Field values; strings are converted to the field's type (so CLI values work).

    Raises
    ------
    ValueError
        Unknown name (lists the known ones), unknown field (lists the fields), or a value out of
        its allowed range.
    TypeError
        A value of the wrong type.
    """
    from .presets import is_preset, preset_spec

    if is_preset(name):  # a preset's fields are defaults that keyword overrides replace
        name, fields = parse_policy_spec(preset_spec(name))
        overrides = {**fields, **overrides}
    elif isinstance(name, str) and ":" in name:
        spec = name
        name, fields = parse_policy_spec(spec)
        both = sorted(set(fields) & set(overrides))
        if both:
            raise ValueError(f"policy spec {spec!r} and keyword arguments both set {both}; set each once")
        overrides = {**fields, **overrides}
    cls = policy_class(name)
    _check_field_names(cls, overrides)
    return cls(**_coerce_overrides(cls, overrides))
