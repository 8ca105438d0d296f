"""``streaming``: StreamingLLM attention sinks + recent window."""

from dataclasses import dataclass, replace

from kvpress.layers import SinkWindowLayer
from kvpress.registry import Policy, check_tokens, register_policy


@register_policy
@dataclass(frozen=True)
class StreamingPolicy(Policy):
    """StreamingLLM: keep ``sink_tokens`` first tokens plus the ``window_size`` most recent.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
    The first tokens absorb attention mass ("attention sinks"); keeping them makes a bounded
    cache behave far better than a plain window. Budget = ``sink_tokens + window_size``
    (``sink_tokens`` 0 .. 2**24, ``window_size`` 1 .. 2**24; the storage grows with the tokens
    seen, up to the budget).

    ``rerotate=True`` gives the sinks in-cache positions, as the paper does, so the model never
    sees a relative distance beyond ``sink_tokens + window_size`` and stays fluent past its
    trained context. Implementation note: RoPE scores depend only on relative distance and the
    window is contiguous, so window keys are already at their in-cache distance; only the sink
    scores change. We therefore keep post-RoPE keys and rotate the *query* (exactly, by the
    adapter's RoPE) to its in-cache slot for the sink scores — the same scores as re-rotating
    stored pre-RoPE keys every step, for one rotation per query instead of ``budget`` per step.
    """

    sink_tokens: int = 4
    window_size: int = 252
    rerotate: bool = False

    name = "streaming"
    description = "attention sinks + recent window (StreamingLLM)"
    paper = "arXiv 2309.17453"
    full_prefill = False
    keeps_full_cache = False
    croppable = True

    def validate(self):
        check_tokens("sink_tokens", self.sink_tokens, 0)
        check_tokens("window_size", self.window_size, 1)

    def make_layer(self, cache, layer_idx):
        return SinkWindowLayer(cache, layer_idx, sinks=self.sink_tokens, window=self.window_size, rerotate=self.rerotate)

    def with_budget(self, budget: int) -> "StreamingPolicy":
        if budget <= self.sink_tokens:
            raise ValueError(
                f"budget={budget} must exceed sink_tokens={self.sink_tokens} (budget = sink_tokens + window_size)"
            )
        return replace(self, window_size=int(budget) - self.sink_tokens)
