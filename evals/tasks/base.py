"""Samples, prompt rendering, length fitting and scoring shared by every task.

A task turns ``(tokenizer, length, num_samples, seed)`` into :class:`Sample` objects whose
model input is ``length`` tokens long within a small tolerance. The input is rendered in one
of two formats (the task option ``prompt_format``):

* ``"chat"``: the user message under the tokenizer's chat template, followed by the answer
  prefix that opens the assistant turn (instruct models);
* ``"plain"``: a completion prompt for a base model -- the message, a newline, and the answer
  prefix the model continues, with the tokenizer's own special tokens (BOS);
* ``"auto"`` (default): ``"chat"`` when the tokenizer has a chat template, else ``"plain"``.

Answers are scored the same way in both. Lengths are measured with the tokenizer on the exact
text the model will see, never estimated from characters.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

# Fitting stops once the input is at most `length` tokens and at least this far below it.
FIT_TOLERANCE = 0.005
# The promise made to callers: inputs land within 2% of the requested length.
LENGTH_TOLERANCE = 0.02
MIN_LENGTH = 256
PROMPT_FORMATS = ("auto", "chat", "plain")


@dataclass(frozen=True)
class Sample:
    """One generated prompt with its reference answers.

    Attributes
    ----------
    task : str
        Task spec that made the sample, e.g. ``"niah_single:haystack=noise"``.
    prompt : str
        The user message (context and question), without chat-template markup.
    answers : list of str
        Every string a correct answer contains; never empty.
    max_new_tokens : int
        Generation budget that fits the expected answer.
    answer_prefix : str
        Text that opens the assistant turn (RULER-style), part of the model input.
    length : int
        Requested input length in tokens.
    num_tokens : int
        Measured input length, ``len(build_input_ids(tokenizer, sample))``.
    index, seed : int
        Position in the generated batch and the seed it was made under.
    depths : list of float
        Position of each inserted needle (or variable assignment) within the context, as a
        fraction of the context's tokens; empty for tasks without needles.
    metadata : dict
        Task-specific details (keys, counts, requested depth, ...), JSON-serialisable.
    prompt_format : {"chat", "plain", "auto"}
        How the input is rendered (see the module docstring); samples record the format they
        were made in (``"auto"`` only for samples built by hand).
    """

    task: str
    prompt: str
    answers: list[str]
    max_new_tokens: int
    answer_prefix: str = ""
    length: int = 0
    num_tokens: int = 0
    index: int = 0
    seed: int = 0
    depths: list[float] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_format: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for ``datasets.Dataset.from_list`` and JSON)."""
        return dataclasses.asdict(self)


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_prompt_format(tokenizer, prompt_format: str = "auto") -> str:
    """``"chat"`` or ``"plain"``: ``prompt_format`` itself, or for ``"auto"`` whether
    ``tokenizer`` has a chat template.

    Raises
    ------
    ValueError
        For a format outside :data:`PROMPT_FORMATS`, or ``"chat"`` with a tokenizer that has
        no chat template (a base model).
    """
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}; got {prompt_format!r}")
    if prompt_format == "auto":
        return "chat" if has_chat_template(tokenizer) else "plain"
    if prompt_format == "chat" and not has_chat_template(tokenizer):
        raise ValueError("prompt_format='chat' needs a tokenizer with a chat template; this one has none "
                         "(a base model): use 'plain' or 'auto'")
    return prompt_format


def render_input(tokenizer, prompt: str, answer_prefix: str = "", prompt_format: str = "auto") -> str:
    """Full model input text for a user ``prompt`` followed by ``answer_prefix``.

    In the chat format the prompt becomes the single user message
    (``add_generation_prompt=True``) and the prefix opens the assistant turn; in the plain
    format (a base model's completion prompt) the prompt and prefix are joined by a newline.
    ``prompt_format`` as in :func:`resolve_prompt_format`.
    """
    if resolve_prompt_format(tokenizer, prompt_format) == "chat":
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return text + answer_prefix
    return f"{prompt}\n{answer_prefix}" if answer_prefix else prompt


def encode_input(tokenizer, prompt: str, answer_prefix: str = "", prompt_format: str = "auto") -> list[int]:
    """Token ids of :func:`render_input`.

    A chat template writes its own special tokens, so the rendered text is encoded
    without adding more (as ``apply_chat_template(tokenize=True)`` does); plain text gets
    the tokenizer's usual special tokens (BOS where it has one).
    """
    chat = resolve_prompt_format(tokenizer, prompt_format) == "chat"
    text = render_input(tokenizer, prompt, answer_prefix, "chat" if chat else "plain")
    return list(tokenizer.encode(text, add_special_tokens=not chat))


def prompt_text(tokenizer, sample: Sample) -> str:
    """The exact text the model reads for ``sample`` (see :func:`render_input`)."""
    return render_input(tokenizer, sample.prompt, sample.answer_prefix, sample.prompt_format)


def build_input_ids(tokenizer, sample: Sample) -> list[int]:
    """Model input ids for ``sample``, in the format it was made in (:attr:`Sample.prompt_format`).

    Returns
    -------
    list of int
        ``(T,)`` ids, ``T == sample.num_tokens`` for the tokenizer the sample was made with.
    """
    return encode_input(tokenizer, sample.prompt, sample.answer_prefix, sample.prompt_format)


def count_tokens(tokenizer, text: str) -> int:
    """Number of tokens of ``text`` alone (no special tokens)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def score_prediction(prediction: str, answers: list[str]) -> float:
    """RULER's string-match-all: the fraction of ``answers`` contained in ``prediction``.

    Matching is case-insensitive substring search.

    Raises
    ------
    ValueError
        If ``answers`` is empty (a sample without answers cannot be scored).
    """
    if not answers:
        raise ValueError("cannot score against an empty answer list")
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def fit_length(
    measure: Callable[[int], int], length: int, lower: int, upper: int, per_unit: float
) -> int:
    """Find a size ``n`` in ``[lower, upper]`` whose input is ``length`` tokens or just under.

    ``measure(n)`` renders the input at size ``n`` (words of haystack, list entries ...)
    and returns its token count; it must be non-decreasing up to tokenizer noise. The
    search interpolates between a bracket and falls back to bisection.

    Parameters
    ----------
    measure : callable
        ``n -> tokens``.
    length : int
        Target number of tokens.
    lower, upper : int
        Allowed sizes.
    per_unit : float
        Rough tokens per unit, for the first guess.

    Returns
    -------
    int
        ``n`` with ``measure(n)`` in ``[length * (1 - LENGTH_TOLERANCE), length]``.

    Raises
    ------
    ValueError
        If even ``lower`` exceeds ``length`` or ``upper`` cannot reach it.
    """
    slack = max(4, int(length * FIT_TOLERANCE))
    lo, f_lo = lower, measure(lower)
    if f_lo > length:
        raise ValueError(
            f"length {length} is too short for this task: its smallest prompt has {f_lo} tokens"
        )
    base = f_lo
    hi, f_hi = upper + 1, None
    aim = length - slack / 2
    n = lower + round((aim - f_lo) / per_unit)
    for _ in range(40):
        n = min(max(n, lo + 1), hi - 1)
        if n <= lo:
            break
        f_n = measure(n)
        if length - slack <= f_n <= length:
            return n
        if f_n < length - slack:
            lo, f_lo = n, f_n
        else:
            hi, f_hi = n, f_n
        if f_hi is not None and f_hi > f_lo:
            n = lo + int((aim - f_lo) * (hi - lo) / (f_hi - f_lo))
        elif lo > lower:
            n = lo + max(1, round((aim - f_lo) * (lo - lower) / max(f_lo - base, 1)))
        else:
            n = lo + max(1, round((aim - f_lo) / per_unit))
        if f_hi is not None and hi - lo <= 1:
            break
    if lo == upper and f_lo < length * (1 - LENGTH_TOLERANCE):
        raise ValueError(f"length {length} is too long for this task (at most ~{f_lo} tokens)")
    if f_lo < length * (1 - LENGTH_TOLERANCE):
        raise RuntimeError(f"could not fit {length} tokens (closest below: {f_lo})")
    return lo


@dataclass(frozen=True)
class Task:
    """Base class of generation tasks: a frozen dataclass whose fields are the options.

    Subclasses set ``name`` and implement :meth:`make_sample`, rendering inputs with
    ``self.prompt_format``; options are validated in ``__post_init__`` (subclasses call the
    base's) with ``ValueError`` naming the allowed values.

    Parameters
    ----------
    prompt_format : {"auto", "chat", "plain"}
        How inputs are rendered (see the module docstring); every task takes it.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "generate"
    prompt_format: str = "auto"

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}; got {self.prompt_format!r}")

    @classmethod
    def option_names(cls) -> list[str]:
        """Names of the options ``get_task`` accepts for this task (``prompt_format`` last)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "prompt_format"]
        return names + ["prompt_format"]

    @property
    def spec(self) -> str:
        """``name:option=value,...`` with every option, the task's full identity.

        ``prompt_format`` is written last, and left out when ``"auto"`` (the model's tokenizer,
        part of every result's identity, decides it then)."""
        values = dataclasses.asdict(self)
        prompt_format = values.pop("prompt_format")
        if prompt_format != "auto":
            values["prompt_format"] = prompt_format
        options = ",".join(f"{k}={v}" for k, v in values.items())
        return f"{self.name}:{options}" if options else self.name

    def generate(self, tokenizer, length: int, num_samples: int = 10, seed: int = 0) -> list[Sample]:
        """Make ``num_samples`` samples of ``length`` input tokens, deterministic under ``seed``.

        Sample ``i`` depends only on ``(task spec, seed, length, i)``, so a sample does
        not change when more are requested.
        """
        if not isinstance(length, int) or length < MIN_LENGTH:
            raise ValueError(f"length must be an int >= {MIN_LENGTH}, got {length!r}")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        resolve_prompt_format(tokenizer, self.prompt_format)  # a chat format without a template: refused now
        samples = []
        for index in range(num_samples):
            rng = random.Random(f"{self.spec}|seed={seed}|length={length}|index={index}")
            samples.append(self.make_sample(tokenizer, length, rng, index, num_samples, seed))
        return samples

    def make_sample(self, tokenizer, length, rng, index, num_samples, seed) -> Sample:
        """Build sample ``index`` of ``num_samples`` from its own ``rng``."""
        raise NotImplementedError

    def score(self, prediction: str, sample: Sample) -> float:
        """Fraction of the sample's answers contained in ``prediction`` (case-insensitive)."""
        return score_prediction(prediction, sample.answers)
