"""``full``: the reference policy — every token kept, exact attention."""

from dataclasses import dataclass

from kvpress.layers import DenseLayer
from kvpress.registry import Policy, register_policy


@register_policy
@dataclass(frozen=True)
class FullPolicy(Policy):
    """Dense KV cache and exact causal attention; what every other policy is compared with.

    Its logits equal the unpatched model's (the contract tests check max |diff| <= 1e-5 in fp32).
    """

    name = "full"
    description = "reference: keep every token, exact attention"
    paper = ""
    full_prefill = True
    keeps_full_cache = True
    croppable = True

    def make_layer(self, cache, layer_idx):
        return DenseLayer(cache, layer_idx)

    def with_budget(self, budget: int) -> "FullPolicy":
        return self  # the reference ignores budgets, so it can sit in any budget sweep
