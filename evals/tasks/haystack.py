"""Haystacks (noise sentences, natural prose) and the random keys, values and words.

Both haystacks are a sequence of words, each with the separator that follows it, plus
the word positions where a sentence starts: needles go only between sentences, and a
haystack of ``n`` words is the first ``n`` words of that sequence. Sizing by words and
measuring with the tokenizer (``base.fit_length``) lands any length to a few tokens.
"""

from __future__ import annotations

import bisect
import functools
import gzip
import random
import re
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
PROSE_FILE = DATA_DIR / "botchan.txt.gz"

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
HAYSTACKS = ("noise", "prose")
VALUE_TYPES = ("numbers", "words", "uuids")

# A sentence ends at . ! or ? (optionally closed by a quote or bracket) followed by
# a space and a capital or an opening quote -- except after a title or an initial.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(A-Z])")
_NOT_AN_END = re.compile(r"(?:\b(?:Mr|Mrs|Dr|St|Messrs)|\b[A-Z])\.[\"')\]]*$")


@functools.lru_cache(maxsize=None)
def prose_text() -> str:
    """The shipped public-domain book (see ``evals/data/README.md``), paragraphs blank-line separated."""
    with gzip.open(PROSE_FILE, "rt", encoding="utf-8") as handle:
        return handle.read()


def split_sentences(paragraph: str) -> list[str]:
    """Split a paragraph into sentences (regex rules good enough for the shipped book)."""
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(paragraph):
        if _NOT_AN_END.search(paragraph[: match.start()].rstrip()):
            continue
        sentences.append(paragraph[start : match.end()].strip())
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


@dataclass(frozen=True)
class Haystack:
    """Words with their trailing separators and the indices where sentences start.

    Attributes
    ----------
    words : tuple of str
        Each word followed by its separator (``" "`` or ``"\\n\\n"`` at a paragraph end).
    starts : tuple of int
        Sorted indices into ``words`` of the first word of each sentence.
    """

    words: tuple[str, ...]
    starts: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.words)

    def rotated(self, start_sentence: int, min_words: int) -> "Haystack":
        """The haystack read from sentence ``start_sentence``, wrapping, at least ``min_words`` long."""
        offset = self.starts[start_sentence % len(self.starts)]
        words = self.words[offset:] + self.words[:offset]
        starts = [s - offset for s in self.starts if s >= offset]
        starts += [s + len(self.words) - offset for s in self.starts if s < offset]
        reps = max(1, -(-min_words // len(words)))
        all_words = words * reps
        all_starts = [s + r * len(words) for r in range(reps) for s in starts]
        return Haystack(all_words, tuple(all_starts))

    def boundary(self, position: float, num_words: int) -> int:
        """The sentence start nearest ``position * num_words`` within the first ``num_words`` words.

        ``num_words`` itself (the end) counts as a boundary, so depth 1.0 is the end.
        """
        target = position * num_words
        limit = bisect.bisect_right(self.starts, num_words)
        candidates = list(self.starts[:limit]) + [num_words]
        i = bisect.bisect_left(candidates, target)
        return min(candidates[max(0, i - 1) : i + 1], key=lambda c: (abs(c - target), c))

    def render(self, num_words: int, inserts: list[tuple[int, str]] = ()) -> tuple[str, list[int]]:
        """Text of the first ``num_words`` words with ``(word_index, sentence)`` inserted.

        Returns
        -------
        text : str
            The haystack; inserted sentences sit between words, each followed by a space.
        positions : list of int
            Character offset of each insert in ``text``, in the order given.
        """
        order = sorted(range(len(inserts)), key=lambda j: (inserts[j][0], j))
        parts: list[str] = []
        size = 0
        cursor = 0
        positions = [0] * len(inserts)
        for j in order:
            at, sentence = inserts[j]
            chunk = "".join(self.words[cursor:at])
            parts.append(chunk)
            size += len(chunk)
            positions[j] = size
            parts.append(sentence + " ")
            size += len(sentence) + 1
            cursor = at
        parts.append("".join(self.words[cursor:num_words]))
        return "".join(parts).rstrip(), positions


def _haystack_from_sentences(paragraphs: list[list[str]], paragraph_break: str = "\n\n") -> Haystack:
    words: list[str] = []
    starts: list[int] = []
    for paragraph in paragraphs:
        for sentence in paragraph:
            starts.append(len(words))
            words.extend(word + " " for word in sentence.split())
        if words:
            words[-1] = words[-1].rstrip() + paragraph_break
    return Haystack(tuple(words), tuple(starts))


@functools.lru_cache(maxsize=None)
def prose_haystack() -> Haystack:
    """The shipped book as a haystack (~48k words, ~62k SmolLM2 tokens)."""
    paragraphs = [split_sentences(p) for p in prose_text().split("\n\n") if p.strip()]
    return _haystack_from_sentences(paragraphs)


@functools.lru_cache(maxsize=None)
def noise_haystack() -> Haystack:
    """RULER's repeated noise sentences as one paragraph (callers rotate/repeat it)."""
    return _haystack_from_sentences([list(NOISE_SENTENCES)], paragraph_break=" ")


def get_haystack(kind: str) -> Haystack:
    """``"noise"`` or ``"prose"`` haystack."""
    if kind == "noise":
        return noise_haystack()
    if kind == "prose":
        return prose_haystack()
    raise ValueError(f"unknown haystack {kind!r}; known: {', '.join(HAYSTACKS)}")


@functools.lru_cache(maxsize=None)
def _read_words(name: str) -> tuple[str, ...]:
    try:
        assets = resources.files("wonderwords") / "assets"
    except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the tasks need `wonderwords`: pip install 'kvpress-toolkit[eval]'") from err
    banned = set((assets / "profanitylist.txt").read_text(encoding="utf-8").split())
    words = (assets / name).read_text(encoding="utf-8").split()
    return tuple(sorted({w for w in words if re.fullmatch(r"[a-z]{3,}", w) and w not in banned}))


@functools.lru_cache(maxsize=None)
def word_list() -> tuple[str, ...]:
    """Sorted lowercase English nouns, adjectives and verbs from ``wonderwords`` (MIT).

    Profanity and words with non-letters are removed.
    """
    names = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    return tuple(sorted({word for name in names for word in _read_words(name)}))


def random_value(kind: str, rng: random.Random) -> str:
    """A random needle key or value: 7-digit number, ``adjective-noun`` word pair or UUID4."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        adjectives, nouns = _read_words("adjectivelist.txt"), _read_words("nounlist.txt")
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown value type {kind!r}; known: {', '.join(VALUE_TYPES)}")


def distinct_values(
    kind: str, count: int, rng: random.Random, avoid: tuple[str, ...] = (), text: str = ""
) -> list[str]:
    """``count`` random values, none equal to, or a substring of, another or of ``avoid``.

    Substring-free values keep string-match scoring exact (``"cat"`` would match
    ``"category"``); values found in ``text`` (the haystack's source) are redrawn so an
    answer occurs in the prompt only where a needle puts it.
    """
    values: list[str] = []
    taken = list(avoid)
    while len(values) < count:
        value = random_value(kind, rng)
        if value in text or any(value in other or other in value for other in taken):
            continue
        values.append(value)
        taken.append(value)
    return values
