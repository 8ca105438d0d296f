"""RULER's aggregation and tracing tasks: variable tracking, common and frequent words.

Answers are correct by construction: the generator decides every count and every
assignment, so the reference answer never depends on parsing the prompt back.

Reference: Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", COLM 2024 (arXiv:2404.06654).
"""

from __future__ import annotations

import functools
import math
import random
import string
from dataclasses import dataclass

from .base import Sample, Task, encode_input, fit_length, resolve_prompt_format
from .haystack import HAYSTACKS, prose_text, word_list
from .niah import check_choice, check_count, place_sentences


@dataclass(frozen=True)
class VariableTracking(Task):
    """Follow chains of assignments ``VAR B = VAR A`` back to a value.

    Chain ``c`` starts with ``VAR X0 = <5-digit value>`` and each of its ``num_hops``
    hops copies the previous variable; the statements sit in the haystack in chain
    order at random depths. The question gives chain 0's value and asks for every
    variable that holds it; the other chains are distractors.

    Parameters
    ----------
    haystack : {"noise", "prose"}
    num_chains : int
        Chains in the context (1..8).
    num_hops : int
        Copies per chain (1..16); the answer lists ``num_hops + 1`` variables.
    """

    name = "vt"
    haystack: str = "noise"
    num_chains: int = 1
    num_hops: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("haystack", self.haystack, HAYSTACKS)
        check_count("num_chains", self.num_chains, 1, 8)
        check_count("num_hops", self.num_hops, 1, 16)

    def make_sample(self, tokenizer, length, rng, index, num_samples, seed) -> Sample:
        text = prose_text() if self.haystack == "prose" else ""
        names: list[str] = []
        while len(names) < self.num_chains * (self.num_hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names and name not in text:
                names.append(name)
        values: list[str] = []
        while len(values) < self.num_chains:
            value = str(rng.randint(10_000, 99_999))
            if value not in values and value not in text:
                values.append(value)
        chains = [names[c * (self.num_hops + 1) : (c + 1) * (self.num_hops + 1)] for c in range(self.num_chains)]
        sentences, depths = [], []
        for chain, value in zip(chains, values):
            sentences.append(f"VAR {chain[0]} = {value}.")
            sentences += [f"VAR {new} = VAR {old}." for old, new in zip(chain, chain[1:])]
            depths += sorted(rng.random() for _ in chain)
        intro = "Memorize and track the chain(s) of variable assignments hidden in the following text."
        question = f"Question: Find all variables that are assigned the value {values[0]} in the text above."
        answer_prefix = (
            f"Answer: According to the chain(s) of variable assignments in the text above, "
            f"{len(chains[0])} variables are assigned the value {values[0]}, they are:"
        )
        prompt, prefix, num_tokens, measured, num_words = place_sentences(
            tokenizer, length, rng, self.haystack, sentences, depths,
            lambda context: (f"{intro}\n\n{context}\n\n{question}", answer_prefix), self.prompt_format,
        )
        return Sample(
            task=self.spec,
            prompt=prompt,
            answers=list(chains[0]),
            max_new_tokens=16 + 6 * len(chains[0]),
            answer_prefix=prefix,
            length=length,
            num_tokens=num_tokens,
            index=index,
            seed=seed,
            depths=measured,
            metadata={"chains": chains, "values": values, "haystack": self.haystack, "haystack_words": num_words},
            prompt_format=resolve_prompt_format(tokenizer, self.prompt_format),
        )


def _fit_list(tokenizer, length: int, render, per_entry: float, lower: int,
              prompt_format: str = "auto") -> tuple[int, str, str]:
    """Size a list task: ``render(n) -> (prompt, prefix)`` at ``length`` tokens in ``prompt_format``."""

    def measure(n: int) -> int:
        return len(encode_input(tokenizer, *render(n), prompt_format))

    n = fit_length(measure, length, lower=lower, upper=4 * length, per_unit=per_entry)
    return (n, *render(n))


_CWE_PROMPT_WORDS = frozenset("below numbered list words some appear more often than others memorize".split())


@functools.lru_cache(maxsize=None)
def _answer_words() -> tuple[str, ...]:
    """Words that are not part of any other listed word nor of the prompt's own text.

    String-match scoring would credit ``"art"`` to a prediction that says ``"party"``.
    """
    words = word_list()
    inner = {w[i:j] for w in words for i in range(len(w)) for j in range(i + 1, len(w) + 1) if j - i < len(w)}
    return tuple(w for w in words if w not in inner and w not in _CWE_PROMPT_WORDS)


@dataclass(frozen=True)
class CommonWords(Task):
    """Find the ``num_common`` words repeated most often in a numbered word list.

    The list has ``num_common`` words repeated ``c`` times each and many others
    repeated ``u < c`` times, shuffled. At 4k tokens and above ``c = 30, u = 3`` as in
    RULER; shorter lists scale ``c`` down (never below 2) and keep ``u = 1``, so the
    answer is never empty or ambiguous at any length.

    Parameters
    ----------
    num_common : int
        Words to find (1..20).
    """

    name = "cwe"
    num_common: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("num_common", self.num_common, 1, 20)

    def word_counts(self, num_entries: int) -> tuple[int, int, int]:
        """``(common repeats c, uncommon repeats u, number of uncommon words)`` for a list size."""
        common = min(30, max(2, num_entries // (3 * self.num_common)))
        uncommon = max(1, common // 10)
        num_uncommon = max(0, (num_entries - self.num_common * common) // uncommon)
        available = len(word_list()) - self.num_common
        if num_uncommon > available:
            # Past ~100k tokens the vocabulary runs out: repeat the uncommon words more.
            uncommon = math.ceil((num_entries - self.num_common * common) / available)
            num_uncommon = available
        if uncommon >= common:
            raise ValueError(f"cwe cannot make a list of {num_entries} entries (vocabulary too small)")
        return common, uncommon, num_uncommon

    def entries(self, rng: random.Random, num_entries: int) -> tuple[list[str], list[str], tuple[int, int]]:
        """Shuffled list entries, the common words, and ``(c, u)``."""
        common, uncommon, num_uncommon = self.word_counts(num_entries)
        answers = rng.sample(_answer_words(), self.num_common)
        others = rng.sample([w for w in word_list() if w not in answers], num_uncommon)
        listed = answers * common + others * uncommon
        rng.shuffle(listed)
        return listed, answers, (common, uncommon)

    def make_sample(self, tokenizer, length, rng, index, num_samples, seed) -> Sample:
        state = rng.getstate()
        k = self.num_common

        def render(n: int) -> tuple[str, str]:
            rng.setstate(state)
            listed, _, _ = self.entries(rng, n)
            context = " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed))
            return (
                "Below is a numbered list of words. Some of the words appear more often than "
                f"the others; memorize the ones that appear most often.\n\n{context}\n\n"
                f"Question: What are the {k} most common words in the list above?",
                f"Answer: The {k} words that appear most often in the list are:",
            )

        num_entries, prompt, prefix = _fit_list(tokenizer, length, render, 4.5, lower=2 * k,
                                                prompt_format=self.prompt_format)
        rng.setstate(state)
        listed, answers, (common, uncommon) = self.entries(rng, num_entries)
        return Sample(
            task=self.spec,
            prompt=prompt,
            answers=list(answers),
            max_new_tokens=16 + 8 * k,
            answer_prefix=prefix,
            length=length,
            num_tokens=len(encode_input(tokenizer, prompt, prefix, self.prompt_format)),
            prompt_format=resolve_prompt_format(tokenizer, self.prompt_format),
            index=index,
            seed=seed,
            metadata={"num_entries": len(listed), "common_repeats": common, "uncommon_repeats": uncommon},
        )


@dataclass(frozen=True)
class FrequentWords(Task):
    """Find the ``num_answers`` most frequent "coded words" in a stream of random words.

    Coded words are random 5-letter strings. Their counts follow a Zipf law: rank ``r``
    appears ``floor(C / r**alpha)`` times, ``C`` about a quarter of the stream, with the
    top ``num_answers`` counts strictly above the next; the rest of the stream is words
    that appear once.

    Parameters
    ----------
    num_answers : int
        Words to find (1..10).
    alpha : float
        Zipf exponent, > 1.
    """

    name = "fwe"
    num_answers: int = 3
    alpha: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("num_answers", self.num_answers, 1, 10)
        if not isinstance(self.alpha, (int, float)) or not 1.0 < self.alpha <= 4.0:
            raise ValueError(f"alpha must be a float in (1, 4]; got {self.alpha!r}")

    def head_counts(self, num_words: int) -> list[int]:
        """Counts of the words seen at least twice, by rank, for a stream of ``num_words``."""
        top = max(num_words // 4, 2)
        k = self.num_answers
        # The answers must stay strictly above rank k+1 after flooring, and above the
        # words seen once: raise the head count until they do.
        while int(top / k**self.alpha) < 2 or int(top / k**self.alpha) <= int(top / (k + 1) ** self.alpha):
            top += 1
        counts = []
        while (count := int(top / (len(counts) + 1) ** self.alpha)) >= 2:
            counts.append(count)
        return counts

    def counts(self, num_words: int) -> list[int]:
        """Per-rank counts (descending, summing to ``num_words``) for a stream of that size."""
        counts = self.head_counts(num_words)
        rest = num_words - sum(counts)
        if rest < 0:
            raise ValueError(f"fwe needs at least {sum(counts)} words; got {num_words}")
        return counts + [1] * rest

    def stream(self, rng: random.Random, num_words: int) -> tuple[list[str], list[str], list[int]]:
        """Shuffled stream, answers (most frequent first), per-rank counts."""
        counts = self.counts(num_words)
        vocab: list[str] = []
        seen: set[str] = set()
        while len(vocab) < len(counts):
            word = "".join(rng.choices(string.ascii_lowercase, k=5))
            if word not in seen:
                seen.add(word)
                vocab.append(word)
        stream = [w for w, c in zip(vocab, counts) for _ in range(c)]
        rng.shuffle(stream)
        return stream, vocab[: self.num_answers], counts

    def make_sample(self, tokenizer, length, rng, index, num_samples, seed) -> Sample:
        state = rng.getstate()
        k = self.num_answers

        def render(n: int) -> tuple[str, str]:
            rng.setstate(state)
            stream, _, _ = self.stream(rng, n)
            return (
                "Read the following coded text and track how often each coded word appears."
                f"\n\n{' '.join(stream)}\n\n"
                f"Question: What are the {k} most frequently appearing coded words in the coded text above?",
                f"Answer: According to the coded text above, the {k} most frequently appearing coded words are:",
            )

        lower = sum(self.head_counts(0)) + k
        num_words, prompt, prefix = _fit_list(tokenizer, length, render, 3.0, lower=lower,
                                                prompt_format=self.prompt_format)
        rng.setstate(state)
        stream, answers, counts = self.stream(rng, num_words)
        return Sample(
            task=self.spec,
            prompt=prompt,
            answers=list(answers),
            max_new_tokens=16 + 8 * k,
            answer_prefix=prefix,
            length=length,
            num_tokens=len(encode_input(tokenizer, prompt, prefix, self.prompt_format)),
            prompt_format=resolve_prompt_format(tokenizer, self.prompt_format),
            index=index,
            seed=seed,
            metadata={"num_words": len(stream), "top_counts": counts[: k + 1]},
        )
