"""Lossy mode on the real SmolLM2-135M (short prompts; the 1,024-token prefill is the one long case the issue
asks for)."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2():
    from hf_kvcompress.models import load_model

    model, tokenizer = load_model(attn_implementation="sdpa")
    return model, tokenizer


def test_long_prefill_is_summarised_to_budget(smollm2):
    from hf_kvcompress.data import token_ids

    model, tokenizer = smollm2
    ids = token_ids(tokenizer, 1024, split="evaluation")
    lossy = LossyConfig(method="summary", budget=0.3, reference_queries=256)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=64, lossy=lossy), model=model)
    with torch.inference_mode():
        model(ids, cache=cache, logits_to_keep=1)
    stats = cache.stats(per_layer=True)
    assert stats["tokens"] == 1024
    assert stats["stored_bytes"] <= 0.3 * stats["raw_bytes"]
    assert all(layer["summaries"] == 1 and layer["summary_seconds"] > 0 for layer in stats["per_layer"])
    # layers may hold different numbers of entries (the SVD stage trades value rank for entries), all far fewer
    # than the text is long
    assert all(layer["entries"] < 0.5 * 1024 for layer in stats["per_layer"])


@pytest.mark.parametrize("method", ["summary", "topk", "streaming", "svd"])
def test_batched_generation(smollm2, method):
    model, tokenizer = smollm2
    prompts = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
               "Friends, Romans, countrymen,"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    lossy = LossyConfig(method=method, budget=0.5, interval=8, sinks=2, reference_queries=64)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=lossy), model=model)
    out = model.generate(**batch, cache=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (2, batch["input_ids"].shape[1] + 12)
    assert cache.stats()["stored_bytes"] < cache.stats()["raw_bytes"]
