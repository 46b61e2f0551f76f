"""Lossy mode refuses what it cannot do, with messages that name the problem."""

from __future__ import annotations

import pytest
from helpers import fresh_tiny_model, random_ids

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig


def _config() -> CompressionConfig:
    return CompressionConfig(mode="lossy", residual_tokens=8, lossy=LossyConfig(method="topk", budget=0.5, interval=16))


def test_an_attention_implementation_without_float_masks_is_refused():
    model = fresh_tiny_model("llama-gqa")
    model.config._attn_implementation = "flash_attention_2"  # only the name matters: attach refuses it first
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        CompressedCache(_config(), model=model)


def test_wrong_head_count_is_refused():
    model = fresh_tiny_model("llama-gqa")
    cache = CompressedCache(_config(), model=model)
    ids = random_ids(1, 20)
    model(ids, cache=cache)
    k = cache.layers[0].keys
    bad = k.new_zeros(1, k.shape[1] + 1, 1, k.shape[-1])
    with pytest.raises(ValueError, match=r"layer 0: new states .* do not match the cached \[batch, heads"):
        cache.layers[0].update(bad, bad)
