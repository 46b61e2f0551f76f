"""Generation in lossy mode on tiny random Llama / Qwen3 models: batch 1 and 2 (left padded), every method,
with and without an attached model; the budget holds right after every summary."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.layer import LossyLayer

#: every registered method (a new method file is in this matrix with nothing else to change)
METHODS = list(LossyConfig.METHODS)


def lossy_cache(model, method, budget=0.4, **kwargs):
    budget = {"budget_tokens": budget} if isinstance(budget, int) else {"budget": budget}
    lossy = LossyConfig(method=method, interval=8, sinks=2, reference_queries=64, **budget, **kwargs)
    return CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=lossy), model=model)


def check_budget(cache, interval=8):
    for layer in cache.layers:
        assert isinstance(layer, LossyLayer)
        # right after a summary the layer holds at most its budget; since then at most `interval` new tokens
        slack = layer.since_summary * layer.token_bytes + layer.rows * layer.since_summary
        assert layer.held_bytes() <= layer.budget_bytes() + slack
        assert layer.since_summary < interval or not layer.summary_seconds


@pytest.mark.parametrize("method", METHODS)
def test_generate_batch_one(tiny_model, method):
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    cache = lossy_cache(tiny_model, method)
    out = tiny_model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, cache=cache, pad_token_id=0)
    assert out.shape == (1, 72)
    stats = cache.stats(per_layer=True)
    assert stats["tokens"] == 71  # the last generated token is never fed back
    assert stats["stored_bytes"] < 0.6 * stats["raw_bytes"]
    assert all(s["summaries"] >= 2 for s in stats["per_layer"])
    check_budget(cache)


@pytest.mark.parametrize("method", METHODS)
def test_generate_batch_two_left_padded(tiny_model, method):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 40), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :7] = 0
    mask[1, :7] = 0
    cache = lossy_cache(tiny_model, method)
    out = tiny_model.generate(
        ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, cache=cache, pad_token_id=0
    )
    assert out.shape == (2, 60)
    check_budget(cache)
    for layer in cache.layers:
        # the padded row's sinks are its first real tokens, not padding
        keys = layer.sink_block.keys
        assert torch.equal(keys[1], _prefill_keys(tiny_model, ids[1:, 7:], layer.layer_idx)[0, :, :2])


def test_padded_row_matches_unpadded_run(llama):
    """Streaming with a token budget keeps the same tokens for a left-padded row as for the row alone."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 36), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :5] = 0
    mask[1, :5] = 0
    both = llama.generate(
        ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0,
        cache=lossy_cache(llama, "streaming", budget=20),
    )
    alone = llama.generate(
        ids[1:, 5:], max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, cache=lossy_cache(llama, "streaming", budget=20)
    )
    assert torch.equal(both[1, 5:], alone[0])


@pytest.mark.parametrize("method", [m for m in METHODS if LossyConfig.METHODS[m].needs_queries])
def test_query_methods_without_a_model_are_refused_at_construction(method):
    lossy = LossyConfig(method=method, budget=0.4)
    with pytest.raises(ValueError, match=rf"lossy method '{method}' scores entries by the model's queries; pass the "
                                         r"model: CompressedCache\(config, model=model\)"):
        CompressedCache(CompressionConfig(mode="lossy", lossy=lossy))
    with pytest.raises(ValueError, match="pass the model"):  # the shortcut's default method is a query method
        CompressedCache(CompressionConfig(mode="lossy", budget=0.3))
    # a budget of 1.0 never summarises: nothing needs queries
    assert CompressedCache(CompressionConfig(mode="lossy", budget=1.0, lossy={"method": method})).stats()["mode"] == "lossy"


@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
@pytest.mark.parametrize("method", [m for m in METHODS if not LossyConfig.METHODS[m].needs_queries])
def test_query_free_methods_generate_without_a_model(llama, method):
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    lossy = LossyConfig(method=method, budget=0.4, interval=8, sinks=2, reference_queries=32)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=lossy))
    out = llama.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, cache=cache, pad_token_id=0)
    assert out.shape == (1, 52)
    check_budget(cache)
    # without the lossy attention function transformers' one mask serves every layer: equal lengths
    assert len({layer.entries for layer in cache.layers}) == 1


def test_budget_holds_right_after_prefill(llama):
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(5))
    for method in METHODS:
        cache = lossy_cache(llama, method, budget=0.3)
        with torch.no_grad():
            llama(ids, cache=cache)
        stats = cache.stats(per_layer=True)
        assert stats["stored_bytes"] <= 0.3 * stats["raw_bytes"], method
        assert all(s["summaries"] == 1 for s in stats["per_layer"])


def test_budget_tokens_are_token_equivalents(llama):
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(6))
    cache = lossy_cache(llama, "topk", budget=30)
    with torch.no_grad():
        llama(ids, cache=cache)
    for layer in cache.layers:
        assert layer.held_bytes() <= 30 * layer.token_bytes
        # no biases for Top-K: every byte is a whole token, less the room kept for the next fit's queries
        assert 0 < layer.query_reserve() < 30 * layer.token_bytes
        assert layer.entries == (30 * layer.token_bytes - layer.query_reserve()) // layer.token_bytes
        assert layer.get_seq_length() == 100


def test_a_prompt_within_the_sinks_and_window_is_held_exactly(llama):
    """Lossy mode at its defaults (budget 0.3, 4 sinks, a 128-token window: the demo's settings) leaves a 13-token
    prompt as it is: no summary, the K/V held bit for bit, DynamicCache's tokens. A prompt longer than the sinks
    and the window is summarised at prefill as before."""
    from helpers import same_bits
    from transformers import DynamicCache

    ids = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(7))
    kwargs = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    reference = DynamicCache(config=llama.config)
    expected = llama.generate(ids, cache=reference, **kwargs)  # before lossy mode takes the model's attention
    cache = CompressedCache(CompressionConfig(mode="lossy"), model=llama)
    got = llama.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got, expected)
    for layer, ref in zip(cache.layers, reference.layers):
        assert not layer.summary_seconds and layer.get_seq_length() == 28
        assert same_bits(layer.keys, ref.keys) and same_bits(layer.values, ref.values)
    long = CompressedCache(CompressionConfig(mode="lossy"), model=llama)
    with torch.no_grad():
        llama(torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(8)), cache=long)
    stats = long.stats(per_layer=True)
    assert all(s["summaries"] == 1 for s in stats["per_layer"])
    assert stats["held_bytes"] <= 0.3 * stats["raw_bytes"]


def _prefill_keys(model, ids, layer_idx):
    cache = CompressedCache(CompressionConfig(mode="none"), model=model)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache.layer(layer_idx).keys
