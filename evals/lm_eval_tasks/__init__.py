"""lm-eval task configs for the kvpress long-context tasks.

Use the folder with lm-eval's ``--include_path`` (or ``TaskManager(include_path=INCLUDE_PATH)``)::

    lm_eval --include_path "$(python -c 'import kvpress.evals.lm_eval_tasks as t; print(t.INCLUDE_PATH)')" \
        --tasks kvpress_niah_single --model ... \
        --metadata '{"tokenizer": "smollm2", "max_seq_lengths": [4096]}' --apply_chat_template

Every generation task is tagged ``kvpress_ruler``; ``kvpress_ppl`` is the long-document
perplexity task. Prompts are sized for the chat template: pass ``--apply_chat_template``
when the model has one (without it, inputs are shorter by the template's tokens).
"""

from pathlib import Path

INCLUDE_PATH = Path(__file__).resolve().parent

__all__ = ["INCLUDE_PATH"]
