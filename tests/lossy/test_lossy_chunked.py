"""Chunked prefill (issue 36; docs/lossy.md, *Chunked prefill*): every registered method keeps each layer within its
budget plus one chunk at every chunk of ``generate(prefill_chunk_size=...)`` and of the plain loop
(`prefill_in_chunks`), every held byte found by an independent walk after every chunk; until the first summary the
logits equal `DynamicCache`'s bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_tiny_model, random_ids
from lossy_testutil import walked_bytes
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.generation import prefill_in_chunks
from hf_kvcompress.lossy.methods import kvzip

METHODS = list(LossyConfig.METHODS)
CHUNK, PROMPT = 16, 64


@pytest.fixture(scope="module")
def six_layers():
    return fresh_tiny_model("llama-gqa", layers=6)


def _cache(model, method, **budget):
    lossy = LossyConfig(method=method, interval=8, sinks=2, reference_queries=32, **budget)
    return CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)


def _record_summaries(cache) -> list[tuple[int, int, int, int]]:
    """Per summary: (layer, held bytes before it, the layer's budget at its previous summary, held bytes after)."""
    seen: list[tuple[int, int, int, int]] = []
    for layer in cache.layers:
        last = {"budget": 0}

        def wrapped(current=None, layer=layer, inner=layer.summarize, last=last):
            before = layer.held_bytes()
            inner(current)
            seen.append((layer.layer_idx, before, last["budget"], layer.held_bytes()))
            last["budget"] = layer.budget_bytes()

        layer.summarize = wrapped
    return seen


@pytest.mark.parametrize("method", METHODS)
def test_every_chunk_stays_within_budget_plus_one_chunk(six_layers, method):
    model = six_layers
    cache = _cache(model, method, budget=0.3)
    seen = _record_summaries(cache)
    ids = random_ids(1, PROMPT, seed=7)
    out = model.generate(ids, prefill_chunk_size=CHUNK, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         cache=cache, pad_token_id=0)
    assert out.shape == (1, PROMPT + 4)
    summarised = {layer for layer, *_ in seen}
    assert summarised == {layer.layer_idx for layer in cache.layers if layer.budget_bytes() < PROMPT * layer.token_bytes}
    assert summarised  # something was compressed, every chunk from the first over budget on
    for layer_idx, before, previous_budget, after in seen:
        layer = cache.layers[layer_idx]
        one_chunk = CHUNK * (layer.token_bytes + 1)  # a chunk's K/V, and its padding-mask bytes at most
        assert before <= max(previous_budget, CHUNK * layer.token_bytes) + one_chunk, (layer_idx, before)
        assert after <= layer.budget_bytes() + 4 * layer.token_bytes  # decode steps since, at most the 4 generated
    per_layer = {i: sum(1 for layer, *_ in seen if layer == i) for i in summarised}
    # a summary at (nearly) every chunk once the layer is over budget: the prefill never holds it all
    assert max(per_layer.values()) >= PROMPT // CHUNK - 1


@torch.no_grad()
def _steps(model, cache, ids: torch.Tensor, steps: int, seen: list | None = None) -> tuple[list, list[int]]:
    """Logits of each forward (the prompt in chunks through `prefill_in_chunks`, one chunk per call, then one token
    each) and how many summaries each forward ran (``seen``: what `_record_summaries` fills)."""
    out, counts = [], []

    def forward(run):
        before = 0 if seen is None else len(seen)
        out.append(run())
        counts.append(0 if seen is None else len(seen) - before)

    for start in range(0, PROMPT, CHUNK):
        forward(lambda start=start: prefill_in_chunks(model, ids[:, start : start + CHUNK], cache, CHUNK))
    for t in range(PROMPT, PROMPT + steps):
        forward(lambda t=t: model(ids[:, t : t + 1], cache=cache).logits[:, -1])
    return out, counts


@pytest.mark.parametrize("method", METHODS)
def test_exact_until_the_first_summary(six_layers, method):
    model = six_layers
    ids = random_ids(1, PROMPT + 6, seed=8)
    expected, _ = _steps(model, DynamicCache(), ids, 6)
    # with layer budgets (PyramidKV) the top layer gets a twentieth of what the window leaves: a larger budget lets
    # its first chunk fit too
    cache = _cache(model, method, budget_tokens=40 if LossyConfig.METHODS[method].layer_share is None else 400)
    got, counts = _steps(model, cache, ids, 6, _record_summaries(cache))
    first = next(i for i, count in enumerate(counts) if count)
    assert first >= 1  # the first chunk fits: at least one later forward is compared with a chunk held exactly
    for i in range(first + 1):  # a summary changes only what later forwards see
        assert torch.equal(got[i], expected[i]), i
    assert not torch.allclose(got[-1], expected[-1], atol=1e-5, rtol=0)


def test_prefill_in_chunks_left_padded_matches_one_forward(six_layers):
    """The plain loop's positions follow the attention mask: a left-padded batch of 2 in chunks gives the one-forward
    logits of `DynamicCache`."""
    model = six_layers
    ids = random_ids(2, 40, seed=9)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        whole = model(ids, attention_mask=mask, position_ids=positions, cache=DynamicCache()).logits[:, -1]
    chunked = prefill_in_chunks(model, ids, DynamicCache(), 16, attention_mask=mask)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        prefill_in_chunks(model, ids, DynamicCache(), 0)
    with pytest.raises(ValueError, match="must cover 40"):
        prefill_in_chunks(model, ids, DynamicCache(), 8, attention_mask=mask[:, 1:])


def _held_after_every_forward(model, cache) -> tuple[list[list[tuple[int, int, int]]], object]:
    """A forward hook recording, after every forward of ``model``, per layer (held bytes, the walk's bytes, the
    layer's budget) and the whole cache's held bytes against its walk."""
    seen: list[list[tuple[int, int, int]]] = []

    def hook(module, args, output):
        assert cache.stats()["held_bytes"] == walked_bytes(cache)
        seen.append([(layer.held_bytes(), walked_bytes(layer), layer.budget_bytes()) for layer in cache.layers])

    return seen, model.register_forward_hook(hook)


@pytest.mark.parametrize("route", ["generate", "loop"])
@pytest.mark.parametrize("method", METHODS)
def test_held_bytes_after_every_chunk_are_the_walk_and_within_budget_plus_one_chunk(six_layers, method, route):
    """After every chunk (and every decode step) each layer holds at most its budget plus one chunk, and the bytes
    it says it holds are those an independent walk of its tensors finds, through ``generate(prefill_chunk_size=...)``
    and through a plain loop of `prefill_in_chunks` calls, one chunk each."""
    model = six_layers
    cache = _cache(model, method, budget=0.3)
    ids = random_ids(1, PROMPT, seed=10)
    seen, handle = _held_after_every_forward(model, cache)
    try:
        if route == "generate":
            model.generate(ids, prefill_chunk_size=CHUNK, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                           cache=cache, pad_token_id=0)
        else:
            for start in range(0, PROMPT, CHUNK):
                prefill_in_chunks(model, ids[:, start : start + CHUNK], cache, CHUNK)
    finally:
        handle.remove()
    assert len(seen) == PROMPT // CHUNK + (2 if route == "generate" else 0)  # generate's last token is not fed
    token_bytes = {layer.layer_idx: layer.token_bytes for layer in cache.layers}
    over_budget = 0
    for after in seen:
        for i, (held, walked, budget) in enumerate(after):
            assert held == walked, (i, held, walked)
            assert held <= budget + CHUNK * (token_bytes[i] + 1), (i, held, budget)  # + a chunk's mask bytes
            over_budget += held > budget
    # the bound is not met by holding little: the full cache would not fit, so every layer was summarised
    assert all(PROMPT * token_bytes[i] > budget for i, (_, _, budget) in enumerate(seen[-1]))
    assert all(layer.summary_seconds for layer in cache.layers)


@pytest.mark.parametrize("method", METHODS)
def test_generate_in_chunks_is_bit_exact_while_nothing_is_compressed(six_layers, method):
    """``generate(prefill_chunk_size=...)`` with a lossy cache that never needs to compress (budget 1.0) gives the
    logits of `DynamicCache` with the same chunks bit for bit, at every step."""
    model = six_layers
    ids = random_ids(1, PROMPT, seed=11)

    def run(cache):
        return model.generate(ids, prefill_chunk_size=CHUNK, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                              cache=cache, pad_token_id=0, output_logits=True, return_dict_in_generate=True)

    expected, got = run(DynamicCache()), run(_cache(model, method, budget=1.0))
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits, strict=True))


def test_kvzip_replay_holds_the_whole_context_in_chunks(six_layers):
    """KVzip's `compress_context` needs the whole context before its replay: with ``chunk_size`` its prefill holds
    every token (chunks bound the activations, not the cache) and summarises nothing until the replay; then each
    layer is within its budget (docs/lossy.md, *Chunked prefill*)."""
    model = six_layers
    cache = _cache(model, "kvzip", budget=0.3)
    seen, handle = _held_after_every_forward(model, cache)
    context, repeat = random_ids(1, PROMPT, seed=12), random_ids(1, 5, seed=13)
    try:
        kvzip.compress_context(model, cache, context, repeat, chunk_size=CHUNK)
    finally:
        handle.remove()
    full = [PROMPT * layer.token_bytes for layer in cache.layers]
    prefill = seen[PROMPT // CHUNK - 1]  # after the context's last chunk, before the replay
    assert all(held >= whole > budget + CHUNK * layer.token_bytes
               for (held, _, budget), whole, layer in zip(prefill, full, cache.layers))
    for layer in cache.layers:
        assert layer.held_bytes() <= layer.budget_bytes() and layer.stats()["held_bytes"] == walked_bytes(layer)
