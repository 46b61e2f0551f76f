"""A long-context suite generated offline and deterministically (issue 36): RULER-style tasks that need no download
(Hsieh et al. 2024, https://arxiv.org/abs/2404.06654), sized in the model's tokens, and their scorers.

Tasks (`TASKS`):
- ``passkey``: a pass key hidden at a depth of repeated filler text (Mohtashami and Jaggi 2023,
  https://arxiv.org/abs/2305.16300); answer the number;
- ``niah_single``: one "special magic number for <key>" in repeated filler; answer the number;
- ``niah_multikey``: the haystack is needles: many keys with their numbers; answer the number of one key;
- ``variable_tracking``: a value assigned to one variable, then copied along a chain of variables among filler;
  answer every variable that holds the value;
- ``niah_text``: our needle ("the secret number is ...", as `needles`) at a depth of real text (``text``: a window
  of it chosen by the seed); answer the number.

`make_sample(task, length, seed, count_tokens)` builds one sample from ``seed`` alone (a `random.Random`), filling to
about ``length`` tokens as ``count_tokens`` counts them (the model's tokenizer); `score` is RULER's
``string_match_all``: the share of the expected answers that appear in the prediction (case-insensitive).
`hf_kvcompress_eval.long_suite` runs them (``hf-kvcompress eval --suite long``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

TASKS: tuple[str, ...] = ("passkey", "niah_single", "niah_multikey", "variable_tracking", "niah_text")
#: the tasks whose haystack is real text (`make_sample`'s ``text``)
TEXT_TASKS: tuple[str, ...] = ("niah_text",)
#: characters a real-text haystack grows by (`_fill` counts these parts); a window is at most 8 characters per token
TEXT_PART, TEXT_CHARS_PER_TOKEN = 64, 8

#: the filler of the passkey test (Mohtashami and Jaggi 2023), repeated
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: keys of the needles: plain words, no digits (the answers are numbers)
WORDS: tuple[str, ...] = (
    "apple", "river", "candle", "mountain", "violet", "harbor", "meadow", "lantern", "falcon", "copper", "willow",
    "garden", "thunder", "marble", "orchid", "saddle", "pepper", "glacier", "compass", "velvet", "cobalt", "maple",
    "anchor", "ember", "quartz", "tulip", "beacon", "canyon", "feather", "island", "jasmine", "kettle", "lemon",
    "mirror", "nutmeg", "oyster", "pebble", "quiver", "ribbon", "spruce", "timber", "umbrella", "walnut", "yarrow",
)


@dataclass(frozen=True)
class Sample:
    """One test: ``context``, ``question`` and ``answer_prefix`` are the prompt (`prompt`); ``answers`` the strings a
    right answer contains."""

    task: str
    context: str
    question: str
    answers: tuple[str, ...]
    seed: int
    #: the start of the answer, given (RULER's answer prefixes: a small model then answers at once)
    answer_prefix: str = ""

    @property
    def asked(self) -> str:
        """What follows the context: the question and the start of the answer."""
        return f"\n{self.question}\nAnswer:" + (f" {self.answer_prefix}" if self.answer_prefix else "")

    @property
    def prompt(self) -> str:
        return self.context + self.asked


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _fill(parts: Callable[[int], str], length: int, count_tokens: Callable[[str], int]) -> str:
    """``parts(n)`` for the largest ``n`` whose text stays within ``length`` tokens (at least 1), by bisection."""
    low, high = 1, 1
    while count_tokens(parts(high)) <= length:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if count_tokens(parts(mid)) <= length else (low, mid)
    return parts(low)


def _needle_in_filler(needle: str, depth: float) -> Callable[[int], str]:
    def parts(n: int) -> str:
        at = round(depth * n)
        return FILLER * at + needle + " " + FILLER * (n - at)

    return parts


def _needle_in_text(text: str, start: int, needle: str, depth: float) -> Callable[[int], str]:
    def parts(n: int) -> str:
        window = text[start : start + n * TEXT_PART]
        at = window.find(" ", round(depth * len(window)))  # between two words
        at = len(window) if at < 0 else at
        return window[:at] + " " + needle + window[at:]

    return parts


def make_sample(task: str, length: int, seed: int, count_tokens: Callable[[str], int], text: str | None = None) -> Sample:
    """Sample ``seed`` of ``task``, its context about ``length`` tokens long (``count_tokens`` of the context);
    ``text``: the real text of `TEXT_TASKS` (at least ``2 * 8 * length`` characters)."""
    if task not in TASKS:
        raise ValueError(f"long-context task must be one of {list(TASKS)}, got {task!r}")
    if not isinstance(length, int) or length < 16:
        raise ValueError(f"long-context length must be an int >= 16 tokens, got {length!r}")
    rng = random.Random(f"{task}/{length}/{seed}")
    depth = rng.random()
    if task == "passkey":
        key = _number(rng)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        context = _fill(_needle_in_filler(needle, depth), length, count_tokens)
        return Sample(task, context, "What is the pass key?", (key,), seed, "The pass key is")
    if task == "niah_single":
        key, value = rng.choice(WORDS), _number(rng)
        needle = f"One of the special magic numbers for {key} is: {value}."
        context = _fill(_needle_in_filler(needle, depth), length, count_tokens)
        return Sample(task, context, f"What is the special magic number for {key}?", (value,), seed,
                      f"The special magic number for {key} is")
    if task == "niah_text":
        window = TEXT_CHARS_PER_TOKEN * length
        if text is None or len(text) < 2 * window:
            have = "no text" if text is None else f"a text of {len(text)} characters"
            raise ValueError(f"long-context task 'niah_text' at {length} tokens needs a text of at least {2 * window} "
                             f"characters (text=...), got {have}")
        key = _number(rng)
        needle = f"Remember this: the secret number is {key}. The secret number is {key}."
        start = text.find(" ", rng.randrange(len(text) - window)) + 1  # a word's start
        context = _fill(_needle_in_text(text, start, needle, depth), length, count_tokens)
        return Sample(task, context, "What is the secret number?", (key,), seed, "The secret number is")
    if task == "niah_multikey":
        keys = [f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{i}" for i in range(4096)]
        values = [_number(rng) for _ in keys]
        lines = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        context = _fill(lambda n: " ".join(lines[:n]), length, count_tokens)
        shown = context.count("special magic numbers for")
        asked = rng.randrange(shown)
        return Sample(task, context, f"What is the special magic number for {keys[asked]}?", (values[asked],), seed,
                      f"The special magic number for {keys[asked]} is")
    # variable tracking: one chain of five variables, each assignment at a spread position of the filler
    value = _number(rng)
    names: list[str] = []
    while len(names) < 5:
        name = "VAR" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(4))
        names += [] if name in names else [name]
    lines = [f"{names[0]} = {value}."] + [f"{b} = {a}." for a, b in pairwise(names)]

    def chain(n: int) -> str:
        out, at = [], 0
        for i, line in enumerate(lines):
            spot = (i + 1) * n // (len(lines) + 1)
            out.append(FILLER * (spot - at) + line + " ")
            at = spot
        return "".join(out) + FILLER * (n - at)

    context = _fill(chain, length, count_tokens)
    return Sample(task, context, f"Which variables are assigned the value {value}?", tuple(names), seed,
                  f"The variables assigned the value {value} are")


def score(sample: Sample, prediction: str) -> float:
    """RULER's ``string_match_all``: the share of ``sample.answers`` found in ``prediction`` (case-insensitive)."""
    text = prediction.lower()
    return sum(answer.lower() in text for answer in sample.answers) / len(sample.answers)
