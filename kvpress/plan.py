"""The plan of one forward: what kind of forward it is, decided once by the cache for every layer.

A cache layer's ``attend`` used to work out for itself whether the tokens it is handed are a
prompt, a piece of a prompt, a new turn, a verification of draft tokens or one decode step. The
:class:`~kvpress.cache.PolicyCache` now classifies each forward once, in ``begin_forward``, and
every layer reads :attr:`PolicyCache.plan`:

========================  ===============================================================
``ForwardKind.PROMPT``     the first forward of an empty cache, not inside ``cache.prompt()``
``ForwardKind.PIECE``      a piece of a prompt given in several forwards (``cache.prompt()``)
``ForwardKind.TURN``       several tokens after the prompt without past recording (a new turn)
``ForwardKind.VERIFY``     several tokens after the prompt while the cache records its past
                           (assisted decoding's verification of draft tokens)
``ForwardKind.DECODE``     one token per row after the prompt
========================  ===============================================================

The plan also carries the forward's position on the device (``start`` / ``end``: sequence index
of its first token and one past its last, long tensors of shape [1]). They are advanced in place,
so a compiled decode step reads its position from a tensor rather than from a Python integer
that changes every step (which would make every step a new graph).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardKind(enum.Enum):
    PROMPT = "prompt"
    PIECE = "piece"
    TURN = "turn"
    VERIFY = "verify"
    DECODE = "decode"


@dataclass
class ForwardPlan:
    """What the cache decided about the forward in flight (see the module docstring).

    ``static`` is True for a decode step traced by ``torch.compile``: layers that support it then
    write and attend at the device positions ``start`` / ``end`` over their whole preallocated
    capacity (fixed shapes, no host integer in any tensor operation). With ``defer_counts`` they
    also leave their host token counts alone and mark themselves (``CacheLayer.counts_deferred``);
    the code that called the compiled step advances them (:meth:`PolicyCache.count_deferred`).
    """

    kind: ForwardKind
    new_tokens: int
    start: torch.Tensor  # [1] long: sequence index of the forward's first token
    end: torch.Tensor  # [1] long: start + new_tokens
    static: bool = False
    # the caller advances the host counts after the step (``PolicyCache.count_deferred``): a compiled
    # step then reads and writes no host integer at all
    defer_counts: bool = False
    # a DECODE plan the core made for one token of a VERIFY forward run as steps: the token's index in
    # that forward (0 for every other plan)
    step: int = 0
    _steps: list | None = field(default=None, repr=False, compare=False)

    @property
    def is_decode(self) -> bool:
        return self.kind is ForwardKind.DECODE

    def decode_steps(self) -> list["ForwardPlan"]:
        """One DECODE plan per token of this forward, in order (made once, shared by the layers that
        attend a verification as steps: :meth:`kvpress.cache.PolicyCache.attend`)."""
        if self._steps is None:
            self._steps = [ForwardPlan(ForwardKind.DECODE, 1, self.start + t, self.start + t + 1, step=t)
                           for t in range(self.new_tokens)]
        return self._steps


def classify(*, seen: int, new_tokens: int, prompt_open: bool, recording: bool) -> ForwardKind:
    """The kind of a forward of ``new_tokens`` tokens on a cache that holds ``seen`` tokens."""
    if prompt_open:
        return ForwardKind.PIECE
    if seen == 0:
        return ForwardKind.PROMPT
    if new_tokens == 1:
        return ForwardKind.DECODE
    return ForwardKind.VERIFY if recording else ForwardKind.TURN


def capacity_bucket(tokens: int, minimum: int = 128) -> int:
    """The preallocated capacity for ``tokens`` tokens: a multiple of ``minimum`` and of an eighth
    of the power of two below ``tokens``, so the slack stays under 12.5% (past ``8 * minimum``
    tokens) while a growing cache reallocates a logarithmic number of times, each time a new
    shape for a compiled step (one recompile per bucket)."""
    if tokens < 1:
        return minimum
    step = max(minimum, 1 << max(0, tokens.bit_length() - 4))
    return -(-tokens // step) * step


def static_address(*tensors: torch.Tensor | None) -> None:
    """Tag state tensors that a static decode step mutates in place as living at a fixed address,
    so a compiled step captured in a CUDA graph writes them where they are (no copy in and out,
    no skipped capture). Not while tracing (prefill is never the compiled part)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_static_address(t)
