"""The lossy-method registry: every method module registers itself with its paper and traits, the config checks
names against it, and a method registered from outside the package runs in a cache like the built-in ones."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_tiny_model, random_ids

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy import METHODS, register
from hf_kvcompress.lossy.blocks import LossyBlock


def test_the_config_checks_names_against_the_registry():
    assert {"summary", "topk", "streaming", "svd"} <= set(LossyConfig.METHODS)
    assert LossyConfig.METHODS is METHODS
    for name, method in METHODS.items():
        assert method.name == name and method.paper.startswith("https://")
        assert LossyConfig(method=name).method == name
    # the query-scored methods are those the cache refuses without a model
    assert {n for n, m in METHODS.items() if m.needs_queries} >= {"summary", "topk"}
    assert not METHODS["streaming"].needs_queries and not METHODS["svd"].needs_queries
    with pytest.raises(ValueError, match=r"Without a model use method .*'streaming' or 'svd'"):
        CompressedCache(CompressionConfig(mode="lossy", lossy=LossyConfig(method="topk")))


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        register("streaming", paper="https://example.org", needs_queries=False)(lambda region, budget, ctx: [])


@pytest.fixture
def oldest_entries():
    """A method registered as a new module would: keep the region's *oldest* entries that fit (the mirror of
    streaming), removed from the registry afterwards."""

    @register("oldest", paper="https://arxiv.org/abs/2309.17453", needs_queries=False)
    def compress(region, budget, ctx):
        per_entry = 2 * region.keys.shape[1] * region.keys.shape[-1] * region.keys.element_size()
        count = min(region.entries, budget // per_entry)
        if count <= 0:
            return []
        return [LossyBlock(region.keys[..., :count, :], region.values[..., :count, :], None, tokens=region.tokens)]

    yield compress
    del METHODS["oldest"]


def test_a_registered_method_runs_in_a_cache(oldest_entries):
    with pytest.raises(ValueError, match=r"LossyConfig\.method "):
        LossyConfig(method="newest-first")
    model = fresh_tiny_model("llama-gqa")
    lossy = LossyConfig(method="oldest", interval=8, sinks=2, budget=0.5)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=lossy), model=model)
    ids = random_ids(1, 48)
    model(ids, cache=cache)
    layer = cache.layers[0]
    assert layer.method.compress is oldest_entries and layer.summary_seconds
    assert layer.held_bytes() <= layer.budget_bytes()
    # sinks, then the region's oldest entries, then the recent window: the held keys are a prefix plus a suffix
    held = layer.keys
    full = CompressedCache(CompressionConfig(mode="none"), model=model)
    model(ids, cache=full)
    reference = full.layers[0].keys
    window = layer.residual_length
    kept = held.shape[-2] - window
    assert torch.equal(held[..., :kept, :], reference[..., :kept, :])
    assert torch.equal(held[..., kept:, :], reference[..., -window:, :])
