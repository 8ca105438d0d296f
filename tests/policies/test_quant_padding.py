"""kivi / zipcache / gear on left-padded batches: each row generates what it generates alone.

Quantization is lossy, so a row equals its batch-1 run only if it is quantized the same way:
the same key groups, flush chunks, flush steps, saliency probes. Paddings that are and are not
multiples of the group and flush sizes (8 in the examples; 16 for the flush where noted).
"""
import pytest
import torch

import kvpress

from conftest import random_ids, tiny_model

NEW = 16
CONFIGS = {
    "kivi": ("kivi", {}),
    "kivi-2bit-nosink": ("kivi", {"bits": 2, "sink_tokens": 0}),
    "kivi-rotated-torch": ("kivi", {"rotate_values": True, "backend": "torch"}),
    "zipcache": ("zipcache", {}),
    "zipcache-refined-flush16": ("zipcache", {"refine_key_channels": 8, "flush_size": 16}),
    "zipcache-torch": ("zipcache", {"backend": "torch"}),
    "gear": ("gear", {}),
    "gear-flush16": ("gear", {"flush_size": 16, "backend": "torch"}),
}


@pytest.fixture(scope="module")
def model():
    """The tiny random Llama of the contract tests (2 layers, 4 heads, 2 KV heads, head_dim 16)."""
    return tiny_model("llama")


def _policy(model, config):
    name, overrides = CONFIGS[config]
    return kvpress.policy_class(name).example(kvpress.get_adapter(model)).replace(**overrides)


def run(model, policy, ids, mask=None, **kw):
    if kw.get("num_beams", 1) == 1:  # no EOS: a random model that picks its EOS would end a run early
        kw["eos_token_id"] = []
    with torch.no_grad(), kvpress.apply(model, policy):
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              return_dict_in_generate=True, output_scores=True, **kw)


_SINGLE: dict = {}


def run_single(model, config, ids):
    """Batch-1 run of ``ids`` under ``config`` (kept: several tests compare against the same row)."""
    key = (config, tuple(ids[0].tolist()))
    if key not in _SINGLE:
        _SINGLE[key] = run(model, _policy(model, config), ids)
    return _SINGLE[key]


def padded_batch(rows):
    """Left-pad ``rows`` (each (1, T_i)) to the longest: (ids, mask) (B, T)."""
    width = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - r.shape[1]:], mask[b, width - r.shape[1]:] = r[0], 1
    return ids, mask


def assert_rows_match(batch_out, singles, width):
    """Greedy tokens equal, logits within fp32 noise (1e-5 of the logits' scale)."""
    for b, (one, r_len) in enumerate(singles):
        assert torch.equal(batch_out.sequences[b, width:], one.sequences[0, r_len:]), b
        for step, (a, ref) in enumerate(zip(batch_out.scores, one.scores)):
            scale = ref.abs().max().item()
            torch.testing.assert_close(a[b], ref[0], atol=1e-5 * scale, rtol=0, msg=f"row {b}, step {step}")


@pytest.mark.parametrize("config,pad", [(c, 22) for c in CONFIGS] + [("kivi", 16), ("zipcache", 5), ("gear", 8),
                                                                     ("zipcache-refined-flush16", 16)])
def test_padded_row_equals_its_batch_1_run(model, config, pad):
    """A 53-token row and a shorter one left-padded by ``pad``: each row's tokens and logits
    over 16 decode steps (two flushes or more) are its batch-1 run's."""
    rows = [random_ids(53, seed=1), random_ids(53 - pad, seed=2)]
    ids, mask = padded_batch(rows)
    both = run(model, _policy(model, config), ids, mask)
    assert_rows_match(both, [(run_single(model, config, r), r.shape[1]) for r in rows], ids.shape[1])


@pytest.mark.parametrize("config", ["kivi", "zipcache", "gear"])
def test_three_rows_and_a_second_turn(model, config):
    """Three rows padded by 0 / 3 / 11, then a second turn of 9 tokens on the returned cache."""
    policy = _policy(model, config)
    rows = [random_ids(40, seed=3), random_ids(37, seed=4), random_ids(29, seed=5)]
    ids, mask = padded_batch(rows)
    first = run(model, policy, ids, mask)
    more = random_ids(9, batch=3, seed=6)
    turn = torch.cat([first.sequences, more], 1)
    turn_mask = torch.cat([mask, torch.ones(3, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    second = run(model, policy, turn, turn_mask, past_key_values=first.past_key_values)
    for b, r in enumerate(rows):
        one = run(model, policy, r)
        row_turn = torch.cat([one.sequences, more[b : b + 1]], 1)
        one2 = run(model, policy, row_turn, past_key_values=one.past_key_values)
        assert torch.equal(second.sequences[b, turn.shape[1]:], one2.sequences[0, row_turn.shape[1]:]), b
    assert kvpress.cache_stats(second.past_key_values).tokens == turn.shape[1] + NEW - 1


@pytest.mark.parametrize("config", ["kivi", "zipcache", "gear"])
def test_beam_search_on_a_padded_batch(model, config):
    """num_beams=2 duplicates and reorders the rows: each row's layer is copied, not shared."""
    policy = _policy(model, config)
    rows = [random_ids(40, seed=7), random_ids(27, seed=8)]
    ids, mask = padded_batch(rows)
    both = run(model, policy, ids, mask, num_beams=2).sequences
    for b, r in enumerate(rows):
        assert torch.equal(both[b, ids.shape[1]:], run(model, policy, r, num_beams=2).sequences[0, r.shape[1]:]), b


SMOL_TEXT = ("The lighthouse keeper wrote in his log every evening: the wind, the ships that passed, the colour "
             "of the sea, and the small events of the island. ")


@pytest.fixture(scope="module")
def smollm2():
    return kvpress.load_model("smollm2")


@pytest.mark.smollm2
@pytest.mark.parametrize("name", ["kivi", "zipcache", "gear"])
def test_smollm2_padded_batch_equals_batch_1(smollm2, name):
    """SmolLM2, default configurations: prompts of ~260 and ~237 tokens, batched (the short one
    left-padded) and alone; 24 greedy tokens equal, logits within fp32 noise."""
    model, tokenizer = smollm2
    ids = tokenizer(SMOL_TEXT * 12, return_tensors="pt").input_ids
    rows = [ids[:, :260], ids[:, 40:277]]
    assert rows[1].shape[1] == 237
    policy = kvpress.get_policy(name)
    batch, mask = padded_batch(rows)
    with torch.no_grad(), kvpress.apply(model, policy):
        kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=[], return_dict_in_generate=True,
                  output_scores=True)
        both = model.generate(batch, attention_mask=mask, **kw)
        singles = [(model.generate(r, **kw), r.shape[1]) for r in rows]
    assert_rows_match(both, singles, batch.shape[1])
