"""lm-eval task configs for the kvpress long-context tasks.

Use the folder with lm-eval's ``--include_path`` (or ``TaskManager(include_path=INCLUDE_PATH)``)::

    lm_eval --include_path "$(python -c 'import kvpress.evals.lm_eval_tasks as t; print(t.INCLUDE_PATH)')" \
        --tasks kvpress_niah_single --model ... \
        --metadata '{"tokenizer": "smollm2", "max_seq_lengths": [4096]}' --apply_chat_template

Every generation task is tagged ``kvpress_ruler``; ``kvpress_ppl`` is the long-document
perplexity task. Prompts are sized in the metadata's ``prompt_format`` (default ``auto``): for a
tokenizer with a chat template, the chat format, so pass ``--apply_chat_template``; for a base
model's tokenizer (e.g. ``gemma3-270m``), the plain format, so run without it. The ``kvpress``
model type checks every prompt's length against the size its task gave it.
"""

from pathlib import Path

INCLUDE_PATH = Path(__file__).resolve().parent

__all__ = ["INCLUDE_PATH"]
