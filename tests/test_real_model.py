"""The embedded default model (SmolLM2-135M-Instruct) with Shakespeare text: the real-model tier."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.generation import greedy_generate

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def reference(smollm2, shakespeare_prompt):
    """DynamicCache's greedy 32 tokens after the prompt, with their logits: what every cache must reproduce
    (computed once: the model, the prompt and greedy decoding are the same in every test here)."""
    return greedy_generate(smollm2[0], shakespeare_prompt, DynamicCache(), 32, output_logits=True,
                           return_dict_in_generate=True)


@pytest.mark.parametrize(("mode", "calibrated"), [("none", False), ("lossless", False), ("lossless", True)])
def test_greedy_32_tokens_match_dynamic_cache(smollm2, shakespeare_prompt, smollm2_calibration, reference, mode,
                                              calibrated):
    model, _ = smollm2
    config = CompressionConfig(mode=mode, block_tokens=128, residual_tokens=32)
    expected = reference
    cache = CompressedCache(config, model=model, calibration=smollm2_calibration if calibrated else None)
    got = greedy_generate(model, shakespeare_prompt, cache, 32, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(expected.logits, got.logits):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    stats = cache.stats()
    assert stats["tokens"] == 300 + 32 - 1
    assert len(cache.layers) == 30
    assert len(cache.layers[0].blocks) == (stats["tokens"] - 32) // 128
    if mode == "lossless":
        assert stats["compression_ratio"] > 1.2


def test_save_load_continue_on_smollm2(tmp_path, smollm2, shakespeare_prompt, smollm2_calibration, reference):
    model, _ = smollm2
    config = CompressionConfig(mode="lossless", block_tokens=128, residual_tokens=32)
    cache = CompressedCache(config, model=model, calibration=smollm2_calibration)
    with torch.no_grad():
        model(shakespeare_prompt[:, :-1], cache=cache)
    path = cache.save(tmp_path / "prompt.kvc")
    loaded = CompressedCache.load(path, model=model, calibration=smollm2_calibration)
    got = greedy_generate(model, shakespeare_prompt, loaded, 8)
    assert torch.equal(got.sequences, reference.sequences[:, : shakespeare_prompt.shape[1] + 8])  # greedy: a prefix
