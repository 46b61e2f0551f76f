"""The embedded default model (SmolLM2-135M-Instruct) with Shakespeare text: the real-model tier."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.generation import greedy_generate

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("mode", ["none"])
def test_greedy_32_tokens_match_dynamic_cache(smollm2, shakespeare_prompt, mode):
    model, _ = smollm2
    config = CompressionConfig(mode=mode, block_tokens=64, residual_tokens=32)
    expected = greedy_generate(model, shakespeare_prompt, DynamicCache(), 32)
    cache = CompressedCache(config, model=model)
    got = greedy_generate(model, shakespeare_prompt, cache, 32)
    assert torch.equal(got.sequences, expected.sequences)
    stats = cache.stats()
    assert stats["tokens"] == 300 + 32 - 1
    assert len(cache.layers) == 30
    assert len(cache.layers[0].blocks) == (stats["tokens"] - 32) // 64
