"""The offline long-context suite (issue 36): deterministic samples of the asked length with their needles, and the
scorer on hand-made answers; a tiny smoke of one sample through a lossy cache."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_tiny_model

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.generation import greedy_generate, prefill_in_chunks
from hf_kvcompress_eval.long_context import TASKS, Sample, make_sample, score


def words(text: str) -> int:
    """A stand-in tokenizer: whitespace-separated words."""
    return len(text.split())


#: real text stands in for Shakespeare: numbered sentences, so a window's place is visible
TEXT = " ".join(f"Line {i} of the play, and the king speaks." for i in range(3000))


def sample(task: str, length: int, seed: int):
    return make_sample(task, length, seed, words, TEXT)


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_deterministic_and_of_the_asked_length(task):
    one = sample(task, 600, 3)
    assert one == sample(task, 600, 3)
    assert sample(task, 600, 4) != one
    assert 500 <= words(one.context) <= 600
    for answer in one.answers:
        assert answer in one.context
    if task != "variable_tracking":
        assert one.context.count(one.answers[0]) == (2 if task in ("passkey", "niah_text") else 1)


def test_needle_tasks_ask_what_the_context_says():
    single = make_sample("niah_single", 300, 1, words)
    key = single.question.split(" for ")[1].rstrip("?")
    assert f"special magic numbers for {key} is: {single.answers[0]}." in single.context
    multi = make_sample("niah_multikey", 300, 1, words)
    key = multi.question.split(" for ")[1].rstrip("?")
    assert f"for {key} is: {multi.answers[0]}." in multi.context
    assert multi.context.count("special magic numbers") > 10  # the haystack is needles
    chain = make_sample("variable_tracking", 300, 1, words)
    value = chain.question.split("value ")[1].rstrip("?")
    assert f"{chain.answers[0]} = {value}." in chain.context
    for a, b in zip(chain.answers, chain.answers[1:]):
        assert f"{b} = {a}." in chain.context
        assert chain.context.index(f"{b} = {a}.") > chain.context.index(f"= {value}.")


def test_score_on_hand_made_answers():
    passkey = Sample("passkey", "ctx", "q", ("71432",), 0)
    assert score(passkey, "The pass key is 71432.") == 1.0
    assert score(passkey, "71433") == 0.0
    assert score(passkey, "") == 0.0
    chain = Sample("variable_tracking", "ctx", "q", ("VARABCD", "VAREFGH", "VARJKLM", "VARNPQR"), 0)
    assert score(chain, "varabcd, VAREFGH and VARJKLM") == 0.75  # case-insensitive, each answer counted once
    assert score(chain, "VARABCD VAREFGH VARJKLM VARNPQR VARXXXX") == 1.0


def test_the_real_text_needle_sits_in_a_window_of_the_text():
    one = sample("niah_text", 300, 5)
    needle = f"Remember this: the secret number is {one.answers[0]}. The secret number is {one.answers[0]}."
    assert needle in one.context
    rest = one.context.replace(" " + needle, "", 1)
    assert rest in TEXT  # the text around the needle is one window of the text, cut between words
    assert 250 <= words(one.context) <= 300
    assert sample("niah_text", 300, 6).context != one.context  # another seed, another window


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="needs a text of at least 4800 characters"):
        make_sample("niah_text", 300, 0, words)
    with pytest.raises(ValueError, match="got a text of 100 characters"):
        make_sample("niah_text", 300, 0, words, "word " * 20)
    with pytest.raises(ValueError, match="must be one of"):
        make_sample("qa", 100, 0, words)
    with pytest.raises(ValueError, match="int >= 16"):
        make_sample("passkey", 8, 0, words)


def test_smoke_one_sample_through_a_chunked_lossy_prefill():
    model = fresh_tiny_model("llama-gqa")
    sample = make_sample("passkey", 120, 0, words)
    ids = torch.tensor([[3 + ord(c) % 120 for c in sample.prompt[:160]]])  # a character "tokenizer" for the tiny vocab
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=LossyConfig(
        method="snapkv", budget=0.3, sinks=2)), model=model)
    prefill_in_chunks(model, ids[:, :-1], cache, 64)
    run = greedy_generate(model, ids, cache, 6)  # generate feeds only what the cache has not seen: the last token
    text = "".join(chr(t) for t in run.sequences[0, ids.shape[1]:].tolist())
    assert score(sample, text) in (0.0, 1.0)
    assert cache.stats()["held_bytes"] < 0.5 * cache.stats()["raw_bytes"]


@pytest.mark.parametrize("task", TASKS)
def test_the_question_and_answer_prefix_never_give_the_answer_away(task):
    for seed in range(5):
        one = sample(task, 400, seed)
        assert one.answer_prefix and one.prompt.endswith(f"\nAnswer: {one.answer_prefix}")
        assert one.prompt == one.context + one.asked
        assert not any(answer.lower() in one.asked.lower() for answer in one.answers)


def test_score_on_hand_made_answers_after_a_prefix():
    needle = make_sample("niah_single", 300, 2, words)
    value = needle.answers[0]
    assert score(needle, f" {value}.") == 1.0  # what the model writes after "... is"
    assert score(needle, f" {value[:-1]}.") == 0.0  # one digit short
    assert score(needle, f" {value[:3]} {value[3:]}") == 0.0  # split: not the number
    chain = make_sample("variable_tracking", 300, 2, words)
    assert score(chain, " " + ", ".join(chain.answers[:2])) == pytest.approx(2 / 5)
    assert score(chain, " " + ", ".join(reversed(chain.answers)) + ".") == 1.0  # order does not matter
