"""Generation helpers shared by the CLI, the eval harness and the tests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList


class ProgressCriteria(StoppingCriteria):
    """Never stops generation; ticks a progress bar once per generated token."""

    def __init__(self, bar: tqdm):
        self.bar = bar

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class GenerationRun:
    """Token ids (and logits, when asked for) of a greedy run, its wall time and the cache it left behind."""

    sequences: torch.LongTensor
    seconds: float
    cache: Any
    new_tokens: int
    logits: tuple[torch.Tensor, ...] | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def greedy_generate(
    model,
    input_ids: torch.LongTensor,
    cache,
    new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    progress: str | None = None,
    **generate_kwargs: Any,
) -> GenerationRun:
    """Greedy decoding of exactly ``new_tokens`` tokens with ``cache``; a tqdm bar when ``progress`` names it."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "cache": cache,
        "pad_token_id": model.generation_config.pad_token_id or model.generation_config.eos_token_id,
        **generate_kwargs,
    }
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    bar = tqdm(total=new_tokens, desc=progress, unit="tok", disable=progress is None, leave=False)
    with bar, torch.inference_mode():
        if progress is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([ProgressCriteria(bar)])
        start = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - start
    if isinstance(out, torch.Tensor):
        return GenerationRun(out, seconds, cache, new_tokens)
    return GenerationRun(out.sequences, seconds, cache, new_tokens, getattr(out, "logits", None))
