"""SmolLM2 integration: eviction is real (a needle outside the window is lost) and memory is flat."""

import pytest
import torch

import kvpress
from kvpress.generation import timed_generate

pytestmark = pytest.mark.smollm2

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@pytest.fixture(scope="module")
def smollm2():
    return kvpress.load_model("smollm2")


def needle_prompt(tokenizer, position: str, key: str = "68142") -> torch.Tensor:
    """~1k-token chat prompt with the needle first ("start") or two sentences before the question."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    if position == "start":
        text = needle + FILLER * 40
    else:  # inside a 128-token window
        text = FILLER * 38 + needle + FILLER * 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": text + "What is the pass key?"}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def answer(model, tokenizer, ids, policy):
    res = timed_generate(model, ids, policy, max_new_tokens=10, eos_token_id=tokenizer.eos_token_id, keep_cache=True)
    return tokenizer.decode(res.tokens[0], skip_special_tokens=True), res


def test_needle_inside_window_is_found_outside_is_lost(smollm2):
    model, tokenizer = smollm2
    streaming = kvpress.get_policy("streaming", sink_tokens=4, window_size=124)
    near = needle_prompt(tokenizer, "end")
    far = needle_prompt(tokenizer, "start")
    assert far.shape[1] > 800
    assert "68142" in answer(model, tokenizer, far, kvpress.get_policy("full"))[0]
    assert "68142" in answer(model, tokenizer, near, kvpress.get_policy("full"))[0]
    assert "68142" in answer(model, tokenizer, near, streaming)[0]
    text, res = answer(model, tokenizer, far, streaming)
    assert "68142" not in text
    assert all(layer.stored_tokens() == 128 for layer in res.cache.layers)


def test_resident_bytes_stay_flat_while_generating(smollm2):
    model, tokenizer = smollm2
    ids = needle_prompt(tokenizer, "end")
    policy = kvpress.get_policy("streaming", sink_tokens=4, window_size=60)
    short = timed_generate(model, ids, policy, max_new_tokens=2, eos_token_id=[])
    long = timed_generate(model, ids, policy, max_new_tokens=24, eos_token_id=[])
    assert long.stats.tokens == short.stats.tokens + 22
    assert long.stats.resident_bytes == short.stats.resident_bytes
    full = timed_generate(model, ids, kvpress.get_policy("full"), max_new_tokens=2, eos_token_id=[])
    assert short.stats.resident_bytes < 0.1 * full.stats.resident_bytes
