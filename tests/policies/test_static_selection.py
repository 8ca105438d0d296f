"""The selection policies' static decode step (``plan.static``) chooses what their eager step chooses.

`tests/test_static_decode.py` compiles each policy's example on unpadded prompts. Here the static
path runs without compiling (``torch.compiler.is_compiling`` patched to True for the decode
steps), over a left-padded batch and the configurations the examples leave out (GQA reductions,
4-bit labels, sinks, tail estimates, shared selections), fed the same token ids as the eager run
(no zero-embedding token: a query of zeros ties every score, and ties may break either way).
Each step's logits must match the eager step's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvpress
from kvpress.adapters import get_adapter
from kvpress.registry import policy_class

from conftest import tiny_model

STEPS = 48
CASES = [
    ("exact_topk", {}),
    ("exact_topk", {"group_reduction": "softmax_mean", "tail_chunk": 0}),
    ("exact_topk", {"group_reduction": "softmax_max", "tail_chunk": 4, "sink_tokens": 0}),
    ("quest", {}),
    ("quest", {"sink_tokens": 8, "budget": 40, "tail_chunk": 8, "score_reduction": "max"}),
    ("tidal", {}),
    ("tidal", {"score_reduction": "mean", "shared_selection": True, "tail_chunk": 8}),
    ("double_sparsity", {}),
    ("double_sparsity", {"rerank": 1, "label_bits": 4, "group_reduction": "softmax_max"}),
    ("double_sparsity", {"tail_chunk": 8, "sink_tokens": 0}),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (2, 30 + STEPS), generator=gen)  # token 0 embeds to zeros: ties
    ids[1, :12] = 0
    mask = torch.ones_like(ids)
    mask[1, :12] = 0
    return ids, mask


def _logits(model, policy, static: bool, monkeypatch) -> torch.Tensor:
    ids, mask = _batch(model.config.vocab_size)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    with torch.no_grad(), kvpress.apply(model, policy), monkeypatch.context() as patch:
        cache = kvpress.make_cache(model, policy)
        cache.plan_capacity(ids.shape[1])
        model(ids[:, :30], attention_mask=mask[:, :30], position_ids=positions[:, :30], past_key_values=cache,
              use_cache=True)
        if static:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
        for t in range(30, ids.shape[1]):
            logits = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                           past_key_values=cache, use_cache=True).logits
            out.append(logits[:, -1])
        assert cache.get_seq_length() == ids.shape[1]
    return torch.stack(out, dim=1)  # (B, STEPS, V)


@pytest.mark.parametrize("name,changes", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_static_step_matches_eager_on_a_padded_batch(model, name, changes, monkeypatch):
    policy = dataclasses.replace(policy_class(name).example(get_adapter(model)), **changes)
    eager = _logits(model, policy, False, monkeypatch)
    static = _logits(model, policy, True, monkeypatch)
    torch.testing.assert_close(static, eager, atol=2e-4, rtol=1e-4)
