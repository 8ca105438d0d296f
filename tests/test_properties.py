"""Property-based check of every registered policy (hypothesis, derandomized).

Every registered policy, its ``example()`` with some fields perturbed at random, two prompts of
random lengths batched (the shorter one left-padded), fp32 or bf16 weights, on a tiny random
Llama. For every example:

* the policy is refused with a clear ``ValueError`` (a field out of range, a model it cannot run
  on) or it generates;
* the model is untouched afterwards: its logits are bit-identical to those before the block;
* each row of the padded batch generates the greedy tokens of its batch-1 run. Two runs may part
  only at a near-tie: a step whose batch-1 top-two logits are closer than the dtype's noise.
"""
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpress

from conftest import tiny_model

NEW = 5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the top-two logit margin, relative to the logits' scale, below which greedy decoding may part
# between a batch and a batch-1 run: fp32 rounding, or bf16 rounding of every activation
NEAR_TIE = {"fp32": 1e-4, "bf16": 3e-2}
_MODELS: dict = {}


def model_in(dtype: str):
    """The tiny random Llama of the contract tests, one per dtype (hypothesis reruns a test body
    many times, so a function-scoped fixture does not fit)."""
    if dtype not in _MODELS:
        _MODELS[dtype] = tiny_model("llama").to(DTYPES[dtype])
    return _MODELS[dtype]


def _perturbed(value, draw):
    """A nearby value of one config field: ints halved, doubled, moved by one; bools flipped;
    fractions moved; anything else (choices, paths, tuples) kept."""
    if isinstance(value, bool):
        return draw(st.booleans())
    if isinstance(value, int):
        return draw(st.sampled_from([value, value // 2, 2 * value, value + 1, max(0, value - 1)]))
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return draw(st.sampled_from([value, value / 2, min(1.0, 2 * value), 0.0, 1.0]))
    return value


@st.composite
def perturbations(draw, name: str):
    """Fields of policy ``name``'s example to change, with their new values."""
    example = kvpress.policy_class(name).example(kvpress.get_adapter(model_in("fp32")))
    fields = [f.name for f in dataclasses.fields(example)]
    chosen = draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)) if fields else []
    return {f: _perturbed(getattr(example, f), draw) for f in chosen}


def greedy(model, ids, mask=None):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=[],
                         return_dict_in_generate=True, output_scores=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1).float()  # (B, NEW), (B, NEW, V)


def assert_same_tokens(tokens, ref_tokens, ref_scores, dtype: str, what: str):
    """Equal greedy tokens up to the first step where the reference's choice was a near-tie."""
    for t in range(NEW):
        if tokens[t] != ref_tokens[t]:
            top = ref_scores[t].topk(2).values
            margin, scale = (top[0] - top[1]).item(), ref_scores[t].abs().max().item()
            assert margin < NEAR_TIE[dtype] * scale, f"{what}: step {t} chose {tokens[t]} over {ref_tokens[t]} " \
                                                     f"(batch-1 margin {margin:.3g}, logit scale {scale:.3g})"
            return


@pytest.mark.parametrize("name", kvpress.list_policies())
@settings(max_examples=3, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), length=st.integers(16, 48), pad=st.integers(1, 40), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**16))
def test_policy_keeps_model_and_padded_rows_equal_batch_1(name, data, length, pad, dtype, seed):
    fields = data.draw(perturbations(name), label="fields")
    lengths = (length, max(8, length - pad))  # the second row left-padded by pad (fewer if short)
    model = model_in(dtype)
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows = [torch.randint(3, 250, (1, n), generator=gen) for n in lengths]
    for b, row in enumerate(rows):
        ids[b, width - row.shape[1]:], mask[b, width - row.shape[1]:] = row[0], 1
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    refused = None
    try:
        policy = kvpress.policy_class(name).example(kvpress.get_adapter(model)).replace(**fields)
        with torch.no_grad(), kvpress.apply(model, policy):
            tokens, _ = greedy(model, ids, mask)
            singles = [greedy(model, row) for row in rows]
    except ValueError as exc:  # a clear refusal names what is allowed; nothing else may escape
        refused = str(exc)
        assert len(refused) > 10, refused
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(before, after), "the model changed after the block"
    if refused is None:
        for b, (ref_tokens, ref_scores) in enumerate(singles):
            assert_same_tokens(tokens[b].tolist(), ref_tokens[0].tolist(), ref_scores[0], dtype,
                               f"{name} {fields} row {b} (left padding {width - lengths[b]}, {dtype})")

