"""`stats()["held_bytes"]` is every byte a lossy layer holds: checked against an independent walk of the layer's
tensors (each storage counted once, by its real size, so a view pinning a larger buffer shows up)."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_tiny_model
from lossy_testutil import walked_bytes

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig


@pytest.mark.parametrize("method", list(LossyConfig.METHODS))
@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa"])
def test_held_bytes_is_every_byte_the_layer_holds(method, kind):
    model = fresh_tiny_model(kind)
    lossy = LossyConfig(method=method, budget=0.4, interval=8, sinks=2, reference_queries=32, kept_queries=16)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=6, lossy=lossy), model=model)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 2):
        ids = torch.randint(3, 128, (batch, 40), generator=gen)
        mask = torch.ones_like(ids)
        if batch == 2:
            ids[1, :5] = 0
            mask[1, :5] = 0
        for steps in (0, 13):  # right after the prefill's summary, and after decoding through more of them
            cache.reset()
            if steps:
                model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                               cache=cache, pad_token_id=0)
            else:
                with torch.no_grad():
                    model(ids, attention_mask=mask, cache=cache)
            check(cache, batch)


def check(cache, batch: int) -> None:
    stats = cache.stats(per_layer=True)
    # the layers' bytes, and the token ids the cache records beside them (no decoded blocks in lossy mode)
    assert stats["decoded_bytes"] == 0
    assert stats["held_bytes"] == sum(s["held_bytes"] for s in stats["per_layer"]) + stats["token_ids_bytes"]
    for layer, layer_stats in zip(cache.layers, stats["per_layer"]):
        assert layer.summary_seconds  # something was summarised
        assert layer_stats["held_bytes"] == walked_bytes(layer), (batch, layer.layer_idx)
        assert layer.held_bytes() <= layer.budget_bytes() + layer.since_summary * layer.token_bytes + 1


def test_kept_queries_fit_in_the_budget():
    """Right after a summary the layer holds at most its budget less the room of the queries it will keep; with
    them (before the next summary) at most the budget plus the tokens that arrived."""
    model = fresh_tiny_model("llama-gqa")
    lossy = LossyConfig(method="summary", budget=0.3, interval=8, sinks=2, reference_queries=32, kept_queries=8)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=6, lossy=lossy), model=model)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, cache=cache)
    for layer in cache.layers:
        assert len(layer.query_buffer) == 0 and layer.query_reserve() > 0
        assert layer.held_bytes() <= layer.budget_bytes() - layer.query_reserve()
    with torch.no_grad():
        for t in range(7):
            model(ids[:, t : t + 1], cache=cache)
    for layer in cache.layers:
        assert len(layer.query_buffer) == 7
        assert layer.held_bytes() <= layer.budget_bytes() + 7 * layer.token_bytes
