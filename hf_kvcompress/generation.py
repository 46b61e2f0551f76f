"""Generation helpers shared by the CLI, the eval harness and the tests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from .validation import check_int


class ProgressCriteria(StoppingCriteria):
    """Never stops generation; ticks a progress bar once per generated token."""

    def __init__(self, bar: tqdm):
        self.bar = bar

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class StepClock(StoppingCriteria):
    """Never stops generation; notes when each step ends. ``generate`` calls its stopping criteria once per
    step, after the step's token is chosen: the first call ends the prefill (the prompt's forward and the
    first new token), the later ones the decode steps."""

    def __init__(self) -> None:
        self.first: float | None = None  # perf_counter() at the end of the prefill step
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if self.first is None:
            self.first = time.perf_counter()
        self.steps += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class GenerationRun:
    """Token ids (and logits, when asked for) of a greedy run, its wall time and the cache it left behind.

    ``seconds`` splits into ``prefill_seconds`` (to the first new token: the prompt's forward, where a
    compressed cache also seals its blocks) and `decode_seconds` (the ``steps - 1`` one-token steps after it):
    the overall `tokens_per_second` mixes the two, so a slow decode step hides behind a long prefill."""

    sequences: torch.LongTensor
    seconds: float
    cache: Any
    new_tokens: int
    logits: tuple[torch.Tensor, ...] | None = None
    #: seconds to the end of the first step (0.0 if generate ran no step)
    prefill_seconds: float = 0.0
    #: steps generate ran (tokens added per row): ``new_tokens``, or fewer where every row stopped early
    steps: int = 0

    @property
    def tokens_per_second(self) -> float:
        """``new_tokens`` over the whole run, prefill included."""
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def decode_seconds(self) -> float:
        """Seconds after the prefill step: ``seconds - prefill_seconds``."""
        return self.seconds - self.prefill_seconds

    @property
    def decode_tokens(self) -> int:
        """Tokens of the decode steps: every step's but the first (the prefill's)."""
        return max(self.steps - 1, 0)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Decode steps per second (the tokens after the first one), or None where there was no decode step."""
        if self.decode_tokens == 0:
            return None
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("inf")

    @property
    def decode_ms_per_step(self) -> float | None:
        """Milliseconds per decode step, or None where there was no decode step."""
        return 1000 * self.decode_seconds / self.decode_tokens if self.decode_tokens else None


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
    """Greedy decoding of exactly ``new_tokens`` tokens with ``cache``; a tqdm bar when ``progress`` names it.
    The run's time is split into its prefill step and its decode steps (`GenerationRun`); a
    ``stopping_criteria`` in ``generate_kwargs`` is kept, with the step clock added to it."""
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
    clock = StepClock()
    with bar, torch.inference_mode():
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(clock)
        if progress is not None:
            criteria.append(ProgressCriteria(bar))
        kwargs["stopping_criteria"] = criteria
        start = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - start
    prefill = 0.0 if clock.first is None else clock.first - start
    sequences, logits = (out, None) if isinstance(out, torch.Tensor) else (out.sequences, getattr(out, "logits", None))
    return GenerationRun(sequences, seconds, cache, new_tokens, logits, prefill_seconds=prefill, steps=clock.steps)


@torch.no_grad()
def prefill_in_chunks(
    model, input_ids: torch.LongTensor, cache, chunk_size: int, *, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Feed ``input_ids`` (``[b, t]``) through ``model`` into ``cache`` ``chunk_size`` tokens per forward, as
    ``generate(..., prefill_chunk_size=chunk_size)`` does, and return the last position's logits (``[b, vocab]``).

    For ``model(...)`` users: a lossy cache summarises at the end of every chunk's attention, so it never holds
    more than its budget plus one chunk (docs/lossy.md, *Chunked prefill*). ``attention_mask`` (``[b, past + t]``,
    1 = real token) covers what the cache already holds and ``input_ids``; positions follow it (left padding)."""
    check_int("prefill_in_chunks: chunk_size", chunk_size, minimum=1)
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
