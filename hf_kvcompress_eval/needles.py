"""Synthetic needle-in-a-haystack prompts: a secret number hidden in evaluation text, asked for at the end.

Every prompt of a set has the same token length (the haystack is cut around the needle to fit), so prompts batch
without padding. The question is the same for all prompts; only the number and its depth change.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

NEEDLE = "\nRemember this: the secret number is {number}. The secret number is {number}.\n"
QUESTION = "\n\nQuestion: What is the secret number? Answer: The secret number is"


@dataclass
class NeedleSet:
    """``context`` ``[N, L]`` token ids (haystack with the needle), ``question`` ``[1, Q]``, the expected
    ``answers`` (five-digit strings) and the needle ``depths`` (fraction of the context)."""

    context: torch.Tensor
    question: torch.Tensor
    answers: list[str]
    depths: list[float]

    def answer_tokens(self, tokenizer) -> int:
        """New tokens enough to read any answer back (the longest answer's tokens plus one)."""
        return 1 + max(len(tokenizer(" " + a, add_special_tokens=False)["input_ids"]) for a in self.answers)


def make_needles(tokenizer, haystack: torch.Tensor, count: int, context_tokens: int, *, seed: int = 0) -> NeedleSet:
    """``count`` prompts of ``context_tokens`` tokens; haystack ``i`` is ``haystack[i*L:(i+1)*L]`` (1-D ids)."""
    if haystack.numel() < count * context_tokens:
        raise ValueError(f"make_needles: need {count * context_tokens} haystack tokens, got {haystack.numel()}")
    rng = random.Random(seed)
    question = torch.tensor([tokenizer(QUESTION, add_special_tokens=False)["input_ids"]])
    contexts, answers, depths = [], [], []
    for i in range(count):
        number = str(rng.randrange(10_000, 100_000))
        needle = tokenizer(NEEDLE.format(number=number), add_special_tokens=False)["input_ids"]
        if len(needle) >= context_tokens:
            raise ValueError(f"make_needles: a context of {context_tokens} tokens cannot hold the {len(needle)}-token needle")
        hay = haystack[i * context_tokens : (i + 1) * context_tokens - len(needle)].tolist()
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
