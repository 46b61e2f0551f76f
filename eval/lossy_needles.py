"""Synthetic needle-in-a-haystack prompts: a secret number hidden in Shakespeare text, asked for at the end.

Every prompt of a set has the same token length (the haystack is cut to fit and numbers always have five digits,
one token each), so prompts batch without padding. The question is identical for all prompts; only the number and
its depth change.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from hf_kvcompress.data import token_ids

NEEDLE = "\nRemember this: the secret number is {number}. The secret number is {number}.\n"
QUESTION = "\n\nQuestion: What is the secret number? Answer: The secret number is"


@dataclass
class NeedleSet:
    """``context`` ``[N, L]`` token ids (haystack with the needle), ``question`` ``[1, Q]`` and the expected
    ``answers`` (five-digit strings) and needle ``depths`` (fraction of the context)."""

    context: torch.Tensor
    question: torch.Tensor
    answers: list[str]
    depths: list[float]


def make_needles(tokenizer, count: int, context_tokens: int, *, split: str = "evaluation", seed: int = 0) -> NeedleSet:
    """``count`` prompts of ``context_tokens`` tokens each, haystacks from disjoint places of ``split``."""
    rng = random.Random(seed)
    pool = token_ids(tokenizer, count * context_tokens + 1, split=split, offset=40_000)[0]
    question = torch.tensor([tokenizer(QUESTION, add_special_tokens=False)["input_ids"]])
    contexts, answers, depths = [], [], []
    for i in range(count):
        number = str(rng.randrange(10_000, 100_000))
        needle = tokenizer(NEEDLE.format(number=number), add_special_tokens=False)["input_ids"]
        hay = pool[i * context_tokens : (i + 1) * context_tokens - len(needle)].tolist()
        depth = rng.uniform(0.1, 0.9)
        at = int(depth * len(hay))
        contexts.append(hay[:at] + needle + hay[at:])
        answers.append(number)
        depths.append(depth)
    return NeedleSet(torch.tensor(contexts), question, answers, depths)


def answer_correct(tokenizer, generated: torch.Tensor, answer: str) -> bool:
    """Whether the generated continuation starts with the five digits (spaces ignored)."""
    text = tokenizer.decode(generated, skip_special_tokens=True).replace(" ", "")
    return text.startswith(answer)
