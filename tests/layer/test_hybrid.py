"""Hybrid models (linear attention, conv, mamba beside attention): transformers' own state layers hold the
recurrent and convolution states untouched; the attention layers are compressed; generation is DynamicCache's."""

from __future__ import annotations

import pytest
import torch
from helpers import HYBRID, hybrid_model, random_ids, same_bits
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.layer import CompressedLayer
from hf_kvcompress.layer.hybrid import CompressedHybridLayer
from hf_kvcompress_eval.env import walk_held_bytes


def run(model, ids, cache, mask=None, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, do_sample=False, max_new_tokens=8,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("kind", sorted(HYBRID))
@pytest.mark.parametrize("mode", ["none", "lossless"])
def test_generation_matches_dynamic_cache_bit_for_bit(kind, mode):
    model = hybrid_model(kind)
    ids = random_ids(2, 40, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    want = run(model, ids, DynamicCache(config=model.config), mask)
    cache = CompressedCache(CompressionConfig(mode=mode, block_tokens=8, residual_tokens=4), model=model,
                            calibration=None)
    got = run(model, ids, cache, mask)
    assert torch.equal(want.sequences, got.sequences)
    assert all(same_bits(a, b) for a, b in zip(want.logits, got.logits))
    kinds = {type(layer) for layer in cache.layers}
    if kind == "lfm2":
        assert kinds == {LinearAttentionLayer, CompressedLayer}
    else:
        assert kinds == {CompressedHybridLayer}
    assert any(layer.blocks for layer in cache.layers if isinstance(layer, CompressedLayer))
    stats = cache.stats(per_layer=True)
    assert stats["state_bytes"] > 0
    skip = [cache.model_config] + ([cache.lossless.predictor] if cache.lossless is not None else [])
    assert stats["held_bytes"] == walk_held_bytes(cache, skip=skip)


@pytest.mark.parametrize("kind", sorted(HYBRID))
def test_lossy_mode_summarises_attention_and_keeps_states(kind):
    model = hybrid_model(kind)
    ids = random_ids(1, 80, seed=2)
    want = run(model, ids, DynamicCache(config=model.config))
    # a 32-token window: the 80-token prompt is longer than the sinks and window, which a summary leaves as they are
    cache = CompressedCache(CompressionConfig(mode="lossy", budget=0.5, residual_tokens=32), model=model)
    got = run(model, ids, cache)
    assert same_bits(want.logits[0], got.logits[0])
    assert all(torch.isfinite(step).all() for step in got.logits)
    assert cache.stats()["held_bytes"] < dynamic_cache_bytes(model, ids)


def dynamic_cache_bytes(model, ids) -> int:
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=reference)
    return walk_held_bytes(reference)


def test_without_a_model_a_state_update_says_to_pass_the_model():
    model = hybrid_model("lfm2")
    with pytest.raises(ValueError, match=r"layer 0 of this model keeps a recurrent or convolution state.*model=model"):
        run(model, random_ids(1, 10), CompressedCache(CompressionConfig(mode="none")))


def test_a_recorded_past_counts_the_recurrent_states_history():
    """`activate_past_recording` keeps transformers' recurrent-state history (5.25+): held bytes count it."""
    model = hybrid_model("falcon_h1")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=4), model=model,
                            calibration=None)
    for layer in cache.layers:
        layer.activate_past_recording(recurrent_states_to_keep=4)
    run(model, random_ids(1, 24, seed=3), cache)
    history = [t for layer in cache.layers for states in getattr(layer, "recurrent_states_history", {}).values()
               for t in states]
    assert history, "the model kept no recurrent-state history: the test checks nothing"
    skip = [cache.model_config, cache.lossless.predictor]
    assert cache.stats()["held_bytes"] == walk_held_bytes(cache, skip=skip)
