"""Layers as transformers organises them: a ``layer_type -> factory`` table (as `DYNAMIC_LAYER_TYPE_MAPPING`), the
sliding window a subclass of the full-attention layer (as `DynamicSlidingWindowLayer(DynamicLayer)`), and the lossy
layer overriding the base's named update hooks rather than re-implementing ``update``."""

from __future__ import annotations

import pytest
from helpers import fresh_tiny_model, sliding_model
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    DummyLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.cache import LAYER_FACTORIES, SUPPORTED_LAYER_TYPES
from hf_kvcompress.identity import not_full_attention
from hf_kvcompress.layer import CompressedLayer, RawStorage, SlidingWindowLayer
from hf_kvcompress.layer.hybrid import CompressedHybridLayer, SlidingHybridLayer
from hf_kvcompress.layer.layer import holds_as_generated
from hf_kvcompress.lossy.layer import LossyHybridLayer, LossyLayer

KINDS = [("full_attention", {}), ("sliding_attention", {"sliding_window": 48}),
         ("chunked_attention", {"sliding_window": 12}), ("sliding_attention", {}), ("conv", {"number_of_states": 2}),
         ("linear_attention", {}), ("hybrid", {"number_of_states": 2}),
         ("hybrid_sliding", {"sliding_window": 48, "number_of_states": 2}), ("dummy", {})]
#: what each of KINDS becomes, per mode: a sliding type without a window is full attention; windows are never lossy
CLASSES = {
    "none": [CompressedLayer, SlidingWindowLayer, SlidingWindowLayer, CompressedLayer, LinearAttentionLayer,
             LinearAttentionLayer, CompressedHybridLayer, SlidingHybridLayer, DummyLayer],
    "lossless": [CompressedLayer, SlidingWindowLayer, SlidingWindowLayer, CompressedLayer, LinearAttentionLayer,
                 LinearAttentionLayer, CompressedHybridLayer, SlidingHybridLayer, DummyLayer],
    "lossy": [LossyLayer, SlidingWindowLayer, SlidingWindowLayer, LossyLayer, LinearAttentionLayer,
              LinearAttentionLayer, LossyHybridLayer, SlidingHybridLayer, DummyLayer],
}


def test_the_table_names_transformers_layer_types():
    assert set(LAYER_FACTORIES) <= set(DYNAMIC_LAYER_TYPE_MAPPING) and tuple(LAYER_FACTORIES) == SUPPORTED_LAYER_TYPES
    assert issubclass(SlidingWindowLayer, CompressedLayer) and issubclass(SlidingHybridLayer, SlidingWindowLayer)
    # the lossy layer changes what an update does through the base's hooks, not a second `update`
    assert "update" not in LossyLayer.__dict__ and {"_before_append", "_after_append"} <= set(LossyLayer.__dict__)


@pytest.mark.parametrize("mode", ["none", "lossless", "lossy"])
def test_each_layer_type_gets_its_class(mode):
    config = CompressionConfig(mode=mode, block_tokens=8, residual_tokens=4, lossy={"method": "streaming"})
    cache = CompressedCache(config, calibration=None)
    cache.build_layers(KINDS)
    assert [type(layer) for layer in cache.layers] == CLASSES[mode]
    sealing, raw = cache.layers[1], cache.layers[2]
    assert (sealing.sliding_window, raw.sliding_window) == (48, 12) and not raw.seals
    assert sealing.seals == (mode == "lossless")  # 47 >= 4 + SLIDING_MIN_BLOCKS * 8 tokens: coded when lossless
    assert cache.layers[0].sliding_window is None and cache.layers[0].get_max_length() == -1
    assert sealing.get_max_length() == 48
    # a hybrid window answers as transformers' own (its linear-attention half first in the MRO: -1)
    reference = LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=48, number_of_states=2)
    assert cache.layers[7].get_max_length() == reference.get_max_length()
    assert cache.layers[6].number_of_states == 2


@pytest.mark.parametrize("mode", ["none", "lossless", "lossy"])
def test_only_a_plain_full_attention_layer_holds_kv_as_generation_codes_it(mode):
    """One predicate (`holds_as_generated`) decides whether a save, a load or the prefix store takes a layer's
    blocks as they are: windows, lossy layers and hybrids answer no by their class trait, a subclass of the
    full-attention layer that changes nothing answers yes (no ``type(...) is`` test)."""
    config = CompressionConfig(mode=mode, block_tokens=8, residual_tokens=4, lossy={"method": "streaming"})
    cache = CompressedCache(config, calibration=None)
    cache.build_layers(KINDS)
    expected = [mode != "lossy", False, False, mode != "lossy", False, False, False, False, False]
    assert [holds_as_generated(layer) for layer in cache.layers] == expected

    class Traced(CompressedLayer):
        pass

    assert holds_as_generated(Traced(RawStorage(), block_tokens=8, residual_tokens=4))


def test_a_sliding_layer_refuses_adopted_blocks():
    cache = CompressedCache(CompressionConfig(block_tokens=8, residual_tokens=4), calibration=None)
    cache.build_layers([("sliding_attention", {"sliding_window": 48})])
    with pytest.raises(ValueError, match="adopt\\(\\) is for full-attention layers"):
        cache.layers[0].adopt([])


def test_full_attention_only_is_one_test_of_the_models_layer_types():
    assert not_full_attention(fresh_tiny_model("llama-gqa").config) == []
    assert not_full_attention(sliding_model(16).config) == ["sliding_attention"]
