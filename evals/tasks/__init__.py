"""Offline long-context tasks (RULER-style) and a long-document perplexity task.

>>> from kvpress.evals.tasks import get_task, build_input_ids
>>> task = get_task("niah_single", haystack="noise", value_type="uuids")
>>> samples = task.generate(tokenizer, length=4096, num_samples=10, seed=0)
>>> ids = build_input_ids(tokenizer, samples[0])      # chat template applied if it has one, ~4096 ids
>>> task.score(prediction_text, samples[0])            # in [0, 1]

A task may also be named with its options inline, ``"niah_single:haystack=noise,depth=0.5"``
(the form :attr:`Task.spec` writes), which is what command lines pass around. Every task takes
``prompt_format`` (``auto``, ``chat``, ``plain``): ``"niah_single:prompt_format=plain"`` gives an
instruct model the completion prompt a base model gets (see :mod:`kvpress.evals.tasks.base`).
"""

from __future__ import annotations

import dataclasses

from .base import (
    PROMPT_FORMATS,
    Sample,
    Task,
    build_input_ids,
    count_tokens,
    encode_input,
    prompt_text,
    render_input,
    resolve_prompt_format,
    score_prediction,
)
from .haystack import HAYSTACKS, NOISE_SENTENCES, VALUE_TYPES, prose_text
from .niah import NiahMultikey, NiahMultiquery, NiahMultivalue, NiahSingle
from .perplexity import DEFAULT_PPL_TOKENS, LongDocumentPerplexity, PerplexityWindow, perplexity_windows
from .synthetic import CommonWords, FrequentWords, VariableTracking

TASKS = {
    cls.name: cls
    for cls in (
        NiahSingle,
        NiahMultikey,
        NiahMultivalue,
        NiahMultiquery,
        VariableTracking,
        CommonWords,
        FrequentWords,
        LongDocumentPerplexity,
    )
}

__all__ = [
    "DEFAULT_PPL_TOKENS",
    "HAYSTACKS",
    "NOISE_SENTENCES",
    "PROMPT_FORMATS",
    "TASKS",
    "VALUE_TYPES",
    "PerplexityWindow",
    "Sample",
    "Task",
    "build_input_ids",
    "count_tokens",
    "encode_input",
    "get_task",
    "list_tasks",
    "parse_task_spec",
    "perplexity_windows",
    "prompt_text",
    "prose_text",
    "render_input",
    "resolve_prompt_format",
    "score_prediction",
]


def list_tasks() -> list[str]:
    """Names of every task, generation tasks first, ``"ppl"`` last."""
    return list(TASKS)


def parse_task_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:key=value,key=value"`` into the name and raw string options.

    Raises
    ------
    ValueError
        On an option without ``=``.
    """
    name, _, rest = spec.partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"task option {item!r} in {spec!r} is not of the form key=value")
        options[key.strip()] = value.strip()
    return name.strip(), options


def _convert(cls, option: str, value):
    """Parse a string option to the type of the field's default (int, float, str, None)."""
    if not isinstance(value, str):
        return value
    default = next(f.default for f in dataclasses.fields(cls) if f.name == option)
    try:
        if default is None or isinstance(default, float):
            return None if value.lower() == "none" else float(value)
        if isinstance(default, bool):
            return value.lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(value)
    except ValueError:
        raise ValueError(f"option {option} of task {cls.name} got {value!r}, not a number") from None
    return value


def get_task(name: str, **options):
    """The task ``name`` (optionally ``"name:opt=value,..."``) configured with ``options``.

    Parameters
    ----------
    name : str
        One of :func:`list_tasks`, possibly with inline options.
    **options
        Task options (``haystack``, ``value_type``, ``depth``, ``num_keys`` ...); keyword
        options override inline ones.

    Returns
    -------
    Task or LongDocumentPerplexity
        Generation tasks have ``generate`` and ``score``; ``kind == "perplexity"`` for ``ppl``.

    Raises
    ------
    ValueError
        For an unknown task or option, or an option value out of range; the message
        lists what is allowed.
    """
    base, inline = parse_task_spec(name)
    if base not in TASKS:
        raise ValueError(f"unknown task {base!r}; known tasks: {', '.join(TASKS)}")
    cls = TASKS[base]
    merged = {**inline, **options}
    allowed = cls.option_names()
    unknown = sorted(set(merged) - set(allowed))
    if unknown:
        known = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for task {base!r}; its options: {known}")
    return cls(**{key: _convert(cls, key, value) for key, value in merged.items()})
