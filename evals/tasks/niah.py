"""Needle-in-a-haystack tasks (RULER's four NIAH kinds).

Each needle is one sentence, "One of the special magic numbers for KEY is: VALUE.",
placed between two sentences of the haystack. The first needle goes at a controlled
depth (the ``depth`` option, or a sweep over 0..1 across the samples); the others go
at random depths.

Reference: Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", COLM 2024 (arXiv:2404.06654).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Sample, Task, count_tokens, encode_input, fit_length, resolve_prompt_format
from .haystack import HAYSTACKS, VALUE_TYPES, distinct_values, get_haystack, prose_text

# (singular, plural) as the prompt says them.
_KIND_NAMES = {"numbers": ("number", "numbers"), "words": ("word", "words"), "uuids": ("UUID", "UUIDs")}
# Rough generation cost of one value, in tokens, for max_new_tokens.
_VALUE_TOKENS = {"numbers": 12, "words": 16, "uuids": 32}
# Tokens per haystack word, for the first guess of the size search.
_TOKENS_PER_WORD = 1.3


def check_choice(option: str, value, allowed) -> None:
    """Raise ``ValueError`` naming ``allowed`` unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"{option} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def check_count(option: str, value, low: int, high: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int in ``[low, high]``."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{option} must be an int in [{low}, {high}]; got {value!r}")


def sweep_depth(depth: float | None, index: int) -> float:
    """``depth`` when given, else point ``index`` of a depth sweep over [0, 1].

    The sweep is 0, 1, 1/2, 1/4, 3/4, 1/8, 5/8 ... (van der Corput after the two ends):
    any first ``2**k + 1`` samples are the even grid, and sample ``index`` keeps its depth
    however many samples are asked for.
    """
    if depth is not None:
        return float(depth)
    if index < 2:
        return float(index)
    n, base, point = index - 1, 0.5, 0.0
    while n:
        point += base * (n & 1)
        n, base = n >> 1, base / 2
    return point


def place_sentences(tokenizer, length: int, rng, haystack: str, sentences, depths, build_prompt,
                    prompt_format: str = "auto"):
    """Fit a haystack around ``sentences`` inserted at ``depths`` (fractions of the context).

    ``build_prompt(context)`` returns ``(prompt, answer_prefix)``; the haystack grows
    until that prompt's model input, rendered in ``prompt_format``, is ``length`` tokens
    (see ``base.fit_length``).

    Returns
    -------
    prompt, answer_prefix : str
    num_tokens : int
        Measured model-input length.
    measured_depths : list of float
        Token position of each sentence in the context over the context's token count.
    num_words : int
        Haystack words used.
    """
    base = get_haystack(haystack)
    hay = base.rotated(rng.randrange(len(base.starts)), min_words=length + 1)

    def context_at(num_words: int):
        inserts = [(hay.boundary(d, num_words), s) for d, s in zip(depths, sentences)]
        return hay.render(num_words, inserts)

    def measure(num_words: int) -> int:
        prompt, prefix = build_prompt(context_at(num_words)[0])
        return len(encode_input(tokenizer, prompt, prefix, prompt_format))

    num_words = fit_length(measure, length, lower=0, upper=length, per_unit=_TOKENS_PER_WORD)
    context, positions = context_at(num_words)
    prompt, prefix = build_prompt(context)
    total = max(count_tokens(tokenizer, context), 1)
    measured = [round(count_tokens(tokenizer, context[:p]) / total, 4) for p in positions]
    return prompt, prefix, len(encode_input(tokenizer, prompt, prefix, prompt_format)), measured, num_words


@dataclass(frozen=True)
class NiahTask(Task):
    """Shared options and sample assembly of the NIAH tasks.

    Parameters
    ----------
    haystack : {"prose", "noise"}
        Natural prose (the shipped public-domain book) or repeated noise sentences.
    key_type, value_type : {"words", "numbers", "uuids"}
        What keys and values look like: ``adjective-noun`` pairs, 7-digit numbers, UUID4s.
    depth : float or None
        Depth in [0, 1] of the first needle; ``None`` sweeps 0..1 across the samples
        (see :func:`sweep_depth`).
    """

    haystack: str = "prose"
    key_type: str = "words"
    value_type: str = "numbers"
    depth: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("haystack", self.haystack, HAYSTACKS)
        check_choice("key_type", self.key_type, VALUE_TYPES)
        check_choice("value_type", self.value_type, VALUE_TYPES)
        if self.depth is not None and not (isinstance(self.depth, (int, float)) and 0 <= self.depth <= 1):
            raise ValueError(f"depth must be None or a float in [0, 1]; got {self.depth!r}")

    def plan(self, keys: list[str], values: list[str]):
        """Return ``(needle (key, value) pairs, queried keys, answers)``; subclasses override."""
        raise NotImplementedError

    def counts(self) -> tuple[int, int]:
        """``(number of keys, number of values)`` the task draws."""
        return 1, 1

    def question(self, queried: list[str], multiple: bool) -> tuple[str, str]:
        singular, plural = _KIND_NAMES[self.value_type]
        keys = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + " and " + queried[-1]
        if multiple:
            return (
                f"What are all the special magic {plural} for {keys} mentioned in the text above?",
                f"The special magic {plural} for {keys} mentioned in the text above are",
            )
        return (
            f"What is the special magic {singular} for {keys} mentioned in the text above?",
            f"The special magic {singular} for {keys} mentioned in the text above is",
        )

    def make_sample(self, tokenizer, length, rng, index, num_samples, seed) -> Sample:
        num_keys, num_values = self.counts()
        text = prose_text() if self.haystack == "prose" else ""
        keys = distinct_values(self.key_type, num_keys, rng, text=text)
        values = distinct_values(self.value_type, num_values, rng, avoid=tuple(keys), text=text)
        needles, queried, answers = self.plan(keys, values)
        _, plural = _KIND_NAMES[self.value_type]
        sentences = [f"One of the special magic {plural} for {k} is: {v}." for k, v in needles]
        first = sweep_depth(self.depth, index)
        depths = [first] + [rng.random() for _ in needles[1:]]
        question, prefix = self.question(queried, multiple=len(answers) > 1)
        intro = (
            f"Some special magic {plural} are hidden inside the following text. "
            f"Make sure to memorize them; you will be asked about them afterwards."
        )
        prompt, prefix, num_tokens, measured, num_words = place_sentences(
            tokenizer, length, rng, self.haystack, sentences, depths,
            lambda context: (f"{intro}\n\n{context}\n\n{question}", prefix), self.prompt_format,
        )
        return Sample(
            task=self.spec,
            prompt=prompt,
            answers=answers,
            max_new_tokens=16 + _VALUE_TOKENS[self.value_type] * len(answers),
            answer_prefix=prefix,
            length=length,
            num_tokens=num_tokens,
            index=index,
            seed=seed,
            depths=measured,
            metadata={
                "requested_depth": first,
                "keys": [k for k, _ in needles],
                "values": [v for _, v in needles],
                "queried_keys": queried,
                "haystack": self.haystack,
                "haystack_words": num_words,
            },
            prompt_format=resolve_prompt_format(tokenizer, self.prompt_format),
        )


@dataclass(frozen=True)
class NiahSingle(NiahTask):
    """One needle; asks for its value."""

    name = "niah_single"

    def plan(self, keys, values):
        return [(keys[0], values[0])], [keys[0]], [values[0]]


@dataclass(frozen=True)
class NiahMultikey(NiahTask):
    """``num_keys`` needles with different keys; asks for the first key's value.

    The other needles are distractors of the same form.
    """

    name = "niah_multikey"
    num_keys: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("num_keys", self.num_keys, 2, 64)

    def counts(self):
        return self.num_keys, self.num_keys

    def plan(self, keys, values):
        return list(zip(keys, values)), [keys[0]], [values[0]]


@dataclass(frozen=True)
class NiahMultivalue(NiahTask):
    """``num_values`` needles sharing one key; asks for all its values."""

    name = "niah_multivalue"
    num_values: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("num_values", self.num_values, 2, 16)

    def counts(self):
        return 1, self.num_values

    def plan(self, keys, values):
        return [(keys[0], v) for v in values], [keys[0]], list(values)


@dataclass(frozen=True)
class NiahMultiquery(NiahTask):
    """``num_queries`` needles with different keys; asks for every key's value."""

    name = "niah_multiquery"
    num_queries: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("num_queries", self.num_queries, 2, 16)

    def counts(self):
        return self.num_queries, self.num_queries

    def plan(self, keys, values):
        return list(zip(keys, values)), list(keys), list(values)
