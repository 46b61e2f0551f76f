"""CompressedCache inside generate(): exact modes must give DynamicCache's tokens, whatever the decoding."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids, tiny_model
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig

EXACT_MODES = ["none", "lossless"]


def small_blocks(mode: str) -> CompressionConfig:
    # tiny blocks so prompts and generations seal many blocks
    return CompressionConfig(mode=mode, block_tokens=8, residual_tokens=4)


def generate(model, ids, cache, **kwargs):
    kwargs.setdefault("max_new_tokens", 12)
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, cache=cache, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_greedy_matches_dynamic_cache(tiny, mode):
    ids = random_ids(1, 37)
    expected = generate(tiny, ids, DynamicCache())
    cache = CompressedCache(small_blocks(mode))
    got = generate(tiny, ids, cache)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == got.shape[1] - 1
    assert len(cache.layers[0].blocks) >= 4


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_greedy_logits_match_bit_for_bit(tiny, mode):
    ids = random_ids(1, 29)
    kwargs = {"output_logits": True, "return_dict_in_generate": True, "max_new_tokens": 8}
    expected = generate(tiny, ids, DynamicCache(), **kwargs)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), **kwargs)
    for a, b in zip(expected.logits, got.logits):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_past_key_values_keyword_still_works(mode):
    model = tiny_model("llama-gqa")
    ids = random_ids(1, 20)
    expected = generate(model, ids, DynamicCache())
    with torch.no_grad(), pytest.warns(FutureWarning):
        got = model.generate(
            ids, past_key_values=CompressedCache(small_blocks(mode)), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_sampling_matches_dynamic_cache(tiny, mode):
    ids = random_ids(1, 25)
    torch.manual_seed(123)
    expected = generate(tiny, ids, DynamicCache(), do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(123)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), do_sample=True, top_k=20, temperature=0.9)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_beam_search_matches_dynamic_cache(tiny, mode):
    ids = random_ids(1, 30, seed=3)
    kwargs = {"num_beams": 3, "max_new_tokens": 10}
    expected = generate(tiny, ids, DynamicCache(), **kwargs)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_left_padded_batch_matches_dynamic_cache(tiny, mode):
    ids = random_ids(2, 26, seed=5)
    mask = torch.ones_like(ids)
    ids[1, :9] = 0
    mask[1, :9] = 0
    expected = generate(tiny, ids, DynamicCache(), attention_mask=mask)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), attention_mask=mask)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_crop_then_continue(tiny, mode):
    ids = random_ids(1, 33, seed=7)
    runs = []
    for cache in (DynamicCache(), CompressedCache(small_blocks(mode))):
        first = generate(tiny, ids, cache, max_new_tokens=10)
        # drop the last 9 cached tokens (reaching into sealed blocks), then continue from the shorter text
        cache.crop(-9)
        kept = first[:, : cache.get_seq_length() + 1]
        runs.append(generate(tiny, kept, cache, max_new_tokens=10))
    assert cache.get_seq_length() == runs[1].shape[1] - 1
    assert torch.equal(runs[0], runs[1])


def test_batch_repeat_and_select_match_dynamic_layer():
    ids = random_ids(2, 21)
    model = tiny_model("llama-gqa")
    caches = [DynamicCache(), CompressedCache(small_blocks("none"))]
    with torch.no_grad():
        for cache in caches:
            model(ids, cache=cache)
    for cache in caches:
        cache.batch_repeat_interleave(3)
    for cache in caches:
        cache.batch_select_indices(torch.tensor([5, 0, 2]))
    for layer in range(2):
        assert torch.equal(caches[0].layers[layer].keys, caches[1].layers[layer].keys)
        assert torch.equal(caches[0].layers[layer].values, caches[1].layers[layer].values)


def test_mask_sizes_seq_length_and_reset():
    model = tiny_model("llama-gqa")
    cache = CompressedCache(small_blocks("none"))
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        model(random_ids(1, 30), cache=cache)
    assert cache.get_seq_length() == 30
    assert cache.get_mask_sizes(1, 0) == (31, 0)
    assert cache.layers[0].entries == 30
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.layers[0].keys is None


def test_keys_and_values_are_writable_like_dynamic_layer():
    model = tiny_model("llama-gqa")
    cache = CompressedCache(small_blocks("none"))
    with torch.no_grad():
        model(random_ids(1, 30), cache=cache)
    layer = cache.layers[0]
    keys, values = layer.keys, layer.values
    assert keys.shape == (1, 2, 30, 16)
    # a press-style tool keeps every other token
    layer.keys = keys[:, :, ::2]
    layer.values = values[:, :, ::2]
    assert torch.equal(layer.keys, keys[:, :, ::2])
    assert torch.equal(layer.values, values[:, :, ::2])
    assert layer.get_seq_length() == 15


def test_stats_report_sizes():
    model = tiny_model("llama-gqa")
    cache = CompressedCache(small_blocks("none"))
    with torch.no_grad():
        model(random_ids(1, 30), cache=cache)
    stats = cache.stats()
    for key in ("mode", "tokens", "raw_bytes", "stored_bytes", "bits_per_scalar", "compression_ratio"):
        assert key in stats
    expected_raw = 2 * 2 * (1 * 2 * 30 * 16) * 4  # layers * (k, v) * scalars * float32 bytes
    assert stats["raw_bytes"] == expected_raw
    assert stats["stored_bytes"] == expected_raw
    assert stats["bits_per_scalar"] == 32.0
    assert stats["compression_ratio"] == 1.0
    assert stats["tokens"] == 30


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_row_selection_is_consistent_across_kv_blocks_and_token_ids(mode):
    """Indices and bool masks select the same rows of K/V (sealed blocks and residual) and token ids, as
    DynamicCache does; a bool mask to reorder_cache (which DynamicCache refuses) or of the wrong length
    is refused and leaves the cache as it was."""
    model = tiny_model("llama-gqa")
    ids = random_ids(3, 21, seed=3)
    cache, reference = CompressedCache(small_blocks(mode), model=model), DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids, cache=reference)
    assert cache.layers[0].blocks

    def same(rows):
        for layer, ref in zip(cache.kv_layers(), reference.layers):
            assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
        assert torch.equal(cache.token_ids, ids[rows])

    for bad, error in [(torch.tensor([True, False, True]), TypeError), (torch.tensor([0, 3]), IndexError)]:
        with pytest.raises(error):
            cache.reorder_cache(bad)
    with pytest.raises(IndexError, match="bool mask of 2 entries"):
        cache.batch_select_indices(torch.tensor([True, False]))
    same([0, 1, 2])
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    reference.reorder_cache(torch.tensor([2, 0, 0]))
    same([2, 0, 0])
    mask = torch.tensor([False, True, True])
    cache.batch_select_indices(mask)
    reference.batch_select_indices(mask)
    same([0, 0])
