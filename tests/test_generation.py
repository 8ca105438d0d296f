"""timed_generate and chunked_nll: equal to transformers' own paths for the full policy."""

import pytest
import torch

import kvpress
from kvpress.generation import chunked_nll, timed_generate

from conftest import random_ids


def test_timed_generate_equals_hf_generate(llama):
    ids = random_ids(30)
    with torch.no_grad():
        ref = llama.generate(ids, max_new_tokens=7, do_sample=False, eos_token_id=None)[0, 30:]
    for policy in (None, kvpress.get_policy("full")):
        res = timed_generate(llama, ids, policy, max_new_tokens=7, eos_token_id=[])
        assert torch.equal(res.tokens[0], ref)
        assert res.prefill_s > 0 and res.decode_ms_per_token > 0


def test_chunked_nll_full_equals_one_forward_and_window_differs(llama):
    ids = random_ids(90, seed=3)
    with torch.no_grad():
        logits = llama(ids).logits[0, :-1]
    ref = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    torch.testing.assert_close(chunked_nll(llama, ids, kvpress.get_policy("full"), chunk_size=16), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked_nll(llama, ids, None, chunk_size=16), ref, atol=1e-4, rtol=1e-4)
    small = chunked_nll(llama, ids, kvpress.get_policy("window", window_size=8), chunk_size=16)
    assert small.shape == ref.shape and not torch.allclose(small, ref, atol=1e-3)


def test_bad_arguments(llama):
    with pytest.raises(ValueError, match="max_new_tokens"):
        timed_generate(llama, random_ids(4), None, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        chunked_nll(llama, random_ids(4, batch=2), None)
