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


@torch.no_grad()
def prefill_in_chunks(
    model, input_ids: torch.LongTensor, cache, chunk_size: int, *, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Feed ``input_ids`` (``[b, t]``) through ``model`` into ``cache`` ``chunk_size`` tokens per forward, as
    ``generate(..., prefill_chunk_size=chunk_size)`` does, and return the last position's logits (``[b, vocab]``).

    For ``model(...)`` users: a lossy cache summarises at the end of every chunk's attention, so it never holds
    more than its budget plus one chunk (docs/lossy.md, *Chunked prefill*). ``attention_mask`` (``[b, past + t]``,
    1 = real token) covers what the cache already holds and ``input_ids``; positions follow it (left padding)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"prefill_in_chunks: chunk_size must be an int >= 1, got {chunk_size!r}")
    length = input_ids.shape[-1]
    if length < 1:
        raise ValueError("prefill_in_chunks: input_ids holds no token")
    past = cache.get_seq_length()
    if attention_mask is not None and attention_mask.shape[-1] != past + length:
        raise ValueError(
            f"prefill_in_chunks: attention_mask covers {attention_mask.shape[-1]} positions; the cache holds {past} "
            f"and input_ids {length}, so it must cover {past + length}"
        )
    positions = None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = None
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        kwargs: dict[str, Any] = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask[:, : past + end]
            kwargs["position_ids"] = positions[:, past + start : past + end]
        logits = model(input_ids[:, start:end], cache=cache, logits_to_keep=1, **kwargs).logits[:, -1]
    return logits
