"""``window``: keep only the most recent tokens (the sliding-window baseline)."""

from dataclasses import dataclass, replace

from kvpress.layers import SinkWindowLayer
from kvpress.registry import Policy, check_tokens, register_policy


@register_policy
@dataclass(frozen=True)
class WindowPolicy(Policy):
    """Sliding-window attention over the last ``window_size`` tokens (current token included).

    The baseline StreamingLLM (arXiv 2309.17453) improves on: without attention sinks, quality
    collapses once the first tokens leave the window. Prefill uses the same window for every
    query, so memory stays bounded at any prompt length; it grows with the tokens seen, up to the
    window (`kvpress.window_layers.SinkWindowLayer`). ``window_size``: 1 .. 2**24 tokens.
    """

    window_size: int = 256

    name = "window"
    description = "sliding window of the most recent tokens"
    paper = "baseline of StreamingLLM, arXiv 2309.17453"
    full_prefill = False
    keeps_full_cache = False
    croppable = True

    def validate(self):
        check_tokens("window_size", self.window_size, 1)

    def make_layer(self, cache, layer_idx):
        return SinkWindowLayer(cache, layer_idx, sinks=0, window=self.window_size)

    def with_budget(self, budget: int) -> "WindowPolicy":
        return replace(self, window_size=int(budget))
