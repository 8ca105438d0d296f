"""Reading a model's config as the commands name it, without loading weights (``kvpress check``,
and the checks ``generate`` / ``demo`` / ``eval`` run before they load anything). Standard library at
import time; transformers only inside the functions."""

from __future__ import annotations

import sys


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (a line ending in ':' runs into the next, others join with '; ')."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    text = lines[0]
    for line in lines[1:]:
        text += (" " if text.endswith(":") else "; ") + line
    return text


def model_config(name: str):
    """The transformers config of a model as the commands name it, read without loading any weights.

    ``name`` is a kvpress alias (``smollm2``), a ``random-*`` shape of the benchmarks
    (:mod:`kvpress.evals.models`), a local model folder, a ``config.json`` (any file name) or
    ``.gguf`` file, or a hub id ``org/name`` (from the local Hugging Face cache, or downloaded).

    Raises
    ------
    ValueError
        A path that does not exist, a folder without ``config.json``, an unknown name, or a config
        transformers cannot read; the message says which forms are allowed.
    """
    from pathlib import Path

    from kvpress.models import _HUB_ID_RE, MODEL_ALIASES, _looks_like_path, resolve_alias

    allowed = (f"a local model folder, its config.json, a .gguf file, a hub id 'org/name', or a kvpress alias "
               f"({', '.join(sorted(MODEL_ALIASES))})")
    alias = resolve_alias(name)
    if alias == "smollm2":
        return _smollm2_config()
    if alias is not None:
        return _embedded_config(alias)
    if name.lower().startswith("random-"):
        from kvpress.evals.models import random_config

        return random_config(name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return _read_config(name, path.parent, gguf_file=path.name)
        return _read_config(name, path)  # a config .json under any name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{name}: the folder has no config.json; allowed: {allowed}")
        return _read_config(name, path)
    if path.suffix in (".json", ".gguf") or _looks_like_path(name) or not _HUB_ID_RE.match(name):
        raise ValueError(f"{name}: no such file or folder; allowed: {allowed}")
    return _read_config(name, name)


def _read_config(name: str, source, **kwargs):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{name}: cannot read its config: {one_line(exc)}") from exc


def _smollm2_config():
    """SmolLM2's config: from kvpress' converted folder when it exists, else from the GGUF's metadata."""
    from kvpress.model_cache import cache_dir_for
    from kvpress.smollm2_cache import SMOLLM2, smollm2_gguf_path

    folder = cache_dir_for(SMOLLM2)
    if (folder / "config.json").is_file():
        return _read_config("smollm2", folder)
    gguf = smollm2_gguf_path()
    return _read_config("smollm2", gguf.parent, gguf_file=gguf.name)


def _embedded_config(alias: str):
    """An embedded model's config from its converted folder; the first use converts it once (its GGUF
    ships in chunks that are assembled only for the conversion), which the message says."""
    from kvpress.model_cache import cache_dir_for
    from kvpress.models import EMBEDDED_MODELS, alias_config

    folder = cache_dir_for(EMBEDDED_MODELS[alias])
    if not (folder / "config.json").is_file():
        print(f"kvpress: converting {alias} once into {folder} (its config is read from the converted folder)",
              file=sys.stderr)
    return alias_config(alias)


def check_model_name(name: str, command: str) -> None:
    """Raise ValueError unless :func:`kvpress.load_model` can take ``name`` (checked before loading)."""
    from pathlib import Path

    from kvpress.models import _HUB_ID_RE, MODEL_ALIASES, _looks_like_path, resolve_alias

    allowed = (f"{', '.join(sorted(MODEL_ALIASES))}, a local model folder or .gguf file, or a hub id 'org/name'")
    if resolve_alias(name) or name.lower() in MODEL_ALIASES:
        return
    if name.lower().startswith("random-"):
        raise ValueError(f"--model {name}: random-weight models are for `kvpress eval` and `kvpress bench`; "
                         f"`kvpress {command}` needs a trained model: {allowed}")
    if Path(name).expanduser().exists():
        return
    if _looks_like_path(name) or not _HUB_ID_RE.match(name):
        raise ValueError(f"--model {name}: unknown model (no such file or folder); allowed: {allowed}")


def check_lengths(model: str, lengths, option: str = "--lengths") -> None:
    """Raise ValueError when a length exceeds the model's context (``max_position_embeddings``)."""
    context = getattr(model_config(model), "max_position_embeddings", None)
    too_long = [n for n in lengths if context and n > context]
    if too_long:
        raise ValueError(f"{option} {too_long[0]}: longer than {model}'s context of {context} tokens "
                         f"(max_position_embeddings); allowed: up to {context}")
