"""Greedy decision margins (``kvpress.evals.margins``)."""

import math

import pytest
import torch

import kvpress
from kvpress.evals.margins import answer_steps, parse_samples, sample_margin
from kvpress.evals.tasks import get_task


def test_parse_samples_ranges_and_errors():
    assert parse_samples("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_samples("5") == [5]
    for bad in ("a", "-1", "1-x"):
        with pytest.raises(ValueError, match="--samples"):
            parse_samples(bad)


def test_answer_steps_stop_at_the_step_completing_every_answer():
    pieces = [" ", "12", "34", ".", " more"]
    assert answer_steps(pieces, ["1234"]) == 3
    assert answer_steps(pieces, ["1234", "more"]) == 5
    assert answer_steps(pieces, ["999"]) == 5  # never found: every step counts


@pytest.mark.smollm2
def test_margin_is_the_smallest_top1_top2_gap_and_matches_the_scores():
    model, tokenizer = kvpress.load_model("smollm2")
    task = get_task("niah_single")
    sample = task.generate(tokenizer, 512, 1, 0)[0]
    m = sample_margin(model, tokenizer, task, sample, 0)
    assert m.score == task.score(m.prediction, sample)
    assert m.min_margin >= 0 and not math.isnan(m.min_margin)
    assert m.content_margin >= m.min_margin  # a minimum over a subset of the same steps
    # Recompute the margin at the reported step by teacher forcing the greedy tokens.
    from kvpress.evals.tasks.base import build_input_ids

    prompt = build_input_ids(tokenizer, sample)
    gen = tokenizer.encode(m.prediction, add_special_tokens=False)
    ids = torch.tensor([prompt + gen])
    with torch.no_grad():
        logp = model(ids).logits[0, len(prompt) - 1 + m.step].float().log_softmax(-1)
    top = logp.topk(2).values
    assert float(top[0] - top[1]) == pytest.approx(m.min_margin, abs=0.05)
