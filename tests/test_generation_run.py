"""`greedy_generate`'s timing: the run's seconds split into its prefill step and its decode steps."""

from __future__ import annotations

import time

import torch
from helpers import random_ids, tiny_model
from transformers import DynamicCache, StoppingCriteria

from hf_kvcompress.generation import greedy_generate

PREFILL_SLEEP, STEP_SLEEP, NEW = 0.3, 0.05, 5


def test_prefill_is_the_first_step_and_decode_the_others():
    """A forward hook sleeps 0.3 s on the prompt's forward and 0.05 s on each one-token forward: the prefill
    holds the first sleep only, the decode the other four, and the two add up to the run's seconds."""
    model = tiny_model("llama-gqa")

    def slow(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        time.sleep(PREFILL_SLEEP if ids.shape[-1] > 1 else STEP_SLEEP)

    hook = model.register_forward_hook(slow, with_kwargs=True)
    try:
        run = greedy_generate(model, random_ids(1, 16), DynamicCache(), NEW)
    finally:
        hook.remove()
    assert run.steps == NEW and run.decode_tokens == NEW - 1
    assert abs(run.prefill_seconds + run.decode_seconds - run.seconds) < 1e-9
    decode_sleeps = STEP_SLEEP * (NEW - 1)
    # the prefill ends with the first token: its sleep is in it, none of the decode steps' sleeps
    assert PREFILL_SLEEP <= run.prefill_seconds < PREFILL_SLEEP + decode_sleeps, run
    assert run.decode_seconds >= decode_sleeps, run
    assert run.decode_tokens_per_second == run.decode_tokens / run.decode_seconds
    assert run.decode_ms_per_step == 1000 * run.decode_seconds / run.decode_tokens
    assert run.tokens_per_second == NEW / run.seconds  # kept for its callers: the whole run


class StopAfter(StoppingCriteria):
    def __init__(self, steps: int):
        self.steps, self.calls = steps, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= self.steps, dtype=torch.bool)


def test_a_callers_stopping_criteria_is_kept_and_steps_count_what_ran():
    """With a progress bar too (it used to replace the caller's criteria): 3 steps of 8 asked for."""
    stop = StopAfter(3)
    run = greedy_generate(tiny_model("llama-gqa"), random_ids(1, 12), DynamicCache(), 8, min_new_tokens=0,
                          stopping_criteria=[stop], progress="test")
    assert run.sequences.shape[1] == 12 + 3
    assert run.steps == 3 and run.decode_tokens == 2 and stop.calls == 3


def test_one_token_has_no_decode_step():
    run = greedy_generate(tiny_model("llama-gqa"), random_ids(1, 12), DynamicCache(), 1)
    assert run.steps == 1 and run.decode_tokens == 0
    assert run.decode_tokens_per_second is None and run.decode_ms_per_step is None
    assert 0 < run.prefill_seconds <= run.seconds
