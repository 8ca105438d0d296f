"""Long-document perplexity over the shipped public-domain book.

The document is *Botchan* (see ``evals/data/README.md``) read from the first chapter:
about 60k SmolLM2 tokens, enough for 16k-32k-token streaming experiments on a model
whose context is 8k. :func:`perplexity_windows` cuts a token sequence into (possibly
overlapping) windows that score every token exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .haystack import prose_text

DEFAULT_PPL_TOKENS = 16384
_FIRST_CHAPTER = "CHAPTER I\n"


@dataclass(frozen=True)
class PerplexityWindow:
    """One forward pass of a strided perplexity evaluation.

    Feed ``ids[start:end]``; the logits at positions ``t - 1`` score the tokens
    ``ids[t]`` for ``t`` in ``range(score_start, end)``, with ``start < score_start``.
    """

    start: int
    end: int
    score_start: int

    @property
    def num_scored(self) -> int:
        """Tokens this window scores."""
        return self.end - self.score_start


def perplexity_windows(num_tokens: int, window: int, stride: int | None = None) -> list[PerplexityWindow]:
    """Windows of ``window`` tokens every ``stride`` tokens, scoring each token once.

    Token 0 has no context and is never scored; every token ``1 .. num_tokens - 1`` is
    scored by exactly one window, always with at least ``window - stride`` tokens of
    context once the first window is past (the usual Hugging Face strided perplexity).

    Parameters
    ----------
    num_tokens : int
        Length of the document, >= 2.
    window : int
        Tokens per forward pass, >= 2.
    stride : int, optional
        Step between window starts, ``1 <= stride < window``; default ``window // 2``.

    Raises
    ------
    ValueError
        On sizes outside those ranges.
    """
    if not isinstance(num_tokens, int) or num_tokens < 2:
        raise ValueError(f"num_tokens must be an int >= 2; got {num_tokens!r}")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2; got {window!r}")
    stride = window // 2 if stride is None else stride
    if not isinstance(stride, int) or not 1 <= stride < window:
        raise ValueError(f"stride must be an int in [1, window - 1] = [1, {window - 1}]; got {stride!r}")
    windows = []
    scored_until = 1
    start = 0
    while scored_until < num_tokens:
        end = min(start + window, num_tokens)
        windows.append(PerplexityWindow(start, end, scored_until))
        scored_until = end
        start += stride
    return windows


@dataclass(frozen=True)
class LongDocumentPerplexity:
    """The ``ppl`` task: token ids of a long natural-text document.

    Not a generation task (``kind == "perplexity"``): the runner reads
    :meth:`token_ids` and scores it with :func:`perplexity_windows` or by streaming
    the whole sequence through a compressed cache.
    """

    name: ClassVar[str] = "ppl"
    kind: ClassVar[str] = "perplexity"

    @classmethod
    def option_names(cls) -> list[str]:
        """The task has no options."""
        return []

    @property
    def spec(self) -> str:
        return self.name

    def text(self) -> str:
        """The document: the book from its first chapter heading to the end."""
        book = prose_text()
        return book[book.index(_FIRST_CHAPTER) :]

    def token_ids(self, tokenizer, num_tokens: int = DEFAULT_PPL_TOKENS) -> list[int]:
        """The first ``num_tokens`` ids of the document (tokenizer's special tokens included).

        Raises
        ------
        ValueError
            If the document is shorter than ``num_tokens`` under this tokenizer.
        """
        if not isinstance(num_tokens, int) or num_tokens < 2:
            raise ValueError(f"num_tokens must be an int >= 2; got {num_tokens!r}")
        ids = list(tokenizer.encode(self.text(), add_special_tokens=True))
        if len(ids) < num_tokens:
            raise ValueError(f"the ppl document has {len(ids)} tokens under this tokenizer; asked for {num_tokens}")
        return ids[:num_tokens]

    def text_of_length(self, tokenizer, num_tokens: int = DEFAULT_PPL_TOKENS) -> str:
        """The shortest run of whole paragraphs from the start with at least ``num_tokens`` tokens."""
        paragraphs = self.text().split("\n\n")
        lengths = [len(tokenizer.encode(p + "\n\n", add_special_tokens=False)) for p in paragraphs]
        total = 0
        for i, n in enumerate(lengths):
            total += n
            if total >= num_tokens:
                return "\n\n".join(paragraphs[: i + 1])
        raise ValueError(f"the ppl document has ~{total} tokens under this tokenizer; asked for {num_tokens}")
