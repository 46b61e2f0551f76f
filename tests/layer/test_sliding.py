"""Sliding-window layers answer exactly as transformers' `DynamicSlidingWindowLayer`: the same entries in the same
order (so the same logits, bit for bit), the same mask sizes, crop and past recording; they hold no token a future
query cannot reach, beyond the rest of one sealed block."""

from __future__ import annotations

import pytest
import torch
from helpers import RAW, SEALING, random_ids, same_bits, sliding_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.cache import SLIDING_MIN_BLOCKS
from hf_kvcompress_eval.env import walk_held_bytes

BLOCK, RESIDUAL = 8, 4


def config(mode: str) -> CompressionConfig:
    return CompressionConfig(mode=mode, block_tokens=BLOCK, residual_tokens=RESIDUAL)


def run(model, ids, cache, mask=None, **kwargs):
    kwargs.setdefault("max_new_tokens", 10)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, **kwargs)


def assert_same_generation(want, got) -> None:
    assert torch.equal(want.sequences, got.sequences)
    assert len(want.logits) == len(got.logits)
    for a, b in zip(want.logits, got.logits):
        assert same_bits(a, b)


def test_the_sealing_threshold_is_what_the_windows_here_assume():
    assert SEALING - 1 >= RESIDUAL + SLIDING_MIN_BLOCKS * BLOCK > RAW - 1


@pytest.mark.parametrize(("mode", "window", "dtype"), [
    ("lossless", SEALING, torch.float32), ("lossless", SEALING, torch.bfloat16), ("lossless", RAW, torch.bfloat16),
    ("none", SEALING, torch.bfloat16),
])
def test_logits_match_dynamic_cache_bit_for_bit_in_a_padded_batch(mode, window, dtype):
    model = sliding_model(window, dtype)
    ids = random_ids(2, 90, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    reference = DynamicCache(config=model.config)
    want = run(model, ids, reference, mask, max_new_tokens=14)
    cache = CompressedCache(config(mode), model=model, calibration=None)
    got = run(model, ids, cache, mask, max_new_tokens=14)
    assert_same_generation(want, got)
    sliding = cache.layers[0]
    assert sliding.is_sliding and sliding.seals == (mode == "lossless" and window == SEALING)
    if sliding.seals:
        assert sliding.blocks, "the sealing window should hold sealed blocks by now"
    # what attention sees, and what is held: the window and at most the rest of one block beyond it
    assert sliding.entries == window - 1
    assert sliding.held_entries < window - 1 + BLOCK
    assert same_bits(sliding.keys, reference.layers[0].keys)
    assert same_bits(sliding.values, reference.layers[0].values)


@pytest.mark.parametrize("mode", ["none", "lossless"])
def test_beam_search_matches_dynamic_cache(mode):
    model = sliding_model(SEALING)
    ids = random_ids(1, 70, seed=5)
    want = run(model, ids, DynamicCache(config=model.config), num_beams=2, max_new_tokens=8)
    got = run(model, ids, CompressedCache(config(mode), model=model, calibration=None), num_beams=2,
              max_new_tokens=8)
    assert torch.equal(want.sequences, got.sequences)


@pytest.mark.parametrize("mode", ["none", "lossless"])
def test_mask_sizes_seq_length_and_max_length_follow_dynamic_sliding_window_layer(mode):
    model = sliding_model(SEALING)
    reference = DynamicSlidingWindowLayer(sliding_window=SEALING)
    cache = CompressedCache(config(mode), model=model, calibration=None)
    layer = cache.layers[0]
    generator = torch.Generator().manual_seed(0)
    for count in [5, 30, 1, 1, 20, 1, 7, 1, 1, 40, 1]:
        k = torch.randn(1, 2, count, 16, generator=generator)
        v = torch.randn(1, 2, count, 16, generator=generator)
        for q in (1, 3):
            assert layer.get_mask_sizes(q) == reference.get_mask_sizes(q)
        want = reference.update(k, v)
        got = cache.update(k, v, 0)
        assert same_bits(want[0], got[0]) and same_bits(want[1], got[1])
        assert layer.get_seq_length() == reference.get_seq_length()
        assert same_bits(layer.keys, reference.keys) and same_bits(layer.values, reference.values)
    assert layer.get_max_length() == reference.get_max_length() == SEALING
    assert layer.is_compileable is False and reference.is_compileable is False


@pytest.mark.parametrize("mode", ["none", "lossless"])
def test_crop_answers_as_dynamic_sliding_window_layer(mode):
    model = sliding_model(SEALING)
    ids = random_ids(1, 80, seed=7)
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(config(mode), model=model, calibration=None)
    with torch.no_grad():
        model(ids, cache=reference)
        model(ids, cache=cache)
    # past the window without recording: both refuse, with the same error type
    with pytest.raises(RuntimeError, match="activate_past_recording") as theirs:
        reference.crop(-3)
    with pytest.raises(RuntimeError, match="activate_past_recording") as ours:
        cache.crop(-3)
    assert type(theirs.value) is type(ours.value)
    # recording the past: crop rolls back, then both continue alike
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(config(mode), model=model, calibration=None)
    reference.activate_past_recording()
    cache.activate_past_recording()
    more = random_ids(1, 6, seed=8)
    with torch.no_grad():
        for target in (reference, cache):
            model(ids, cache=target)
            model(more, cache=target)
            target.crop(-4)
        want = model(more[:, :3], cache=reference).logits
        got = model(more[:, :3], cache=cache).logits
    assert same_bits(want, got)
    for ours_layer, theirs_layer in zip(cache.layers, reference.layers):
        assert same_bits(ours_layer.keys, theirs_layer.keys)


def test_below_the_window_a_sliding_layer_crops_like_a_full_one():
    model = sliding_model(SEALING)
    ids = random_ids(1, 30, seed=9)
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(config("lossless"), model=model, calibration=None)
    with torch.no_grad():
        model(ids, cache=reference)
        model(ids, cache=cache)
        reference.crop(-5)
        cache.crop(-5)
        more = random_ids(1, 4, seed=10)
        assert same_bits(model(more, cache=reference).logits, model(more, cache=cache).logits)


def test_stats_count_what_the_window_holds():
    model = sliding_model(SEALING)
    ids = random_ids(1, 200, seed=12)
    cache = CompressedCache(config("lossless"), model=model, calibration=None)
    with torch.no_grad():
        model(ids, cache=cache)
    stats = cache.stats(per_layer=True)
    sliding, full = stats["per_layer"][0], stats["per_layer"][1]
    assert sliding["entries"] == SEALING - 1 and full["entries"] == 200
    # raw bytes: what DynamicCache holds (the window), not every token seen
    assert sliding["raw_bytes"] == 2 * 2 * 16 * (SEALING - 1) * 4
    assert stats["held_bytes"] == walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])


def test_lossy_mode_keeps_sliding_layers_as_plain_windows():
    model = sliding_model(SEALING)
    ids = random_ids(1, 120, seed=13)
    cache = CompressedCache(CompressionConfig(mode="lossy", budget=0.5), model=model)
    want = run(model, ids, DynamicCache(config=model.config), max_new_tokens=6)
    got = run(model, ids, cache, max_new_tokens=6)
    assert same_bits(want.logits[0], got.logits[0])  # the prefill's logits: nothing summarised before them
    assert all(torch.isfinite(step).all() for step in got.logits)
    sliding, full = cache.layers[0], cache.layers[1]
    assert type(sliding).__name__ == "SlidingWindowLayer" and not sliding.seals
    assert type(full).__name__ == "LossyLayer"
    assert sliding.entries == SEALING - 1


def test_without_a_model_every_layer_is_held_as_dynamic_cache_without_a_config_holds_it():
    # the cache cannot see the model's layer types then: like DynamicCache(), it keeps every token of every layer
    model = sliding_model(SEALING)
    ids = random_ids(1, 70, seed=14)
    want = run(model, ids, DynamicCache(), max_new_tokens=6)
    got = run(model, ids, CompressedCache(config("lossless")), max_new_tokens=6)
    assert_same_generation(want, got)
