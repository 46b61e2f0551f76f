"""Causality and exactness under every inner attention lossy mode accepts (sdpa, eager), batch 1 and a left-padded
batch 2; the model's attention setting is restored; what lossy mode cannot do is refused (docs/lossy.md,
*Masks per inner attention*)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import fresh_tiny_model, random_ids
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy import detach
from hf_kvcompress.lossy.attention_hook import ATTENTION_NAME

LENGTH, PREFILL, PAD = 36, 24, 5


def _model(impl: str):
    model = fresh_tiny_model("llama-gqa")
    model.set_attn_implementation(impl)
    return model


def _cache(model, budget: float) -> CompressedCache:
    lossy = LossyConfig(method="summary", budget=budget, interval=4, sinks=2, reference_queries=16)
    return CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)


def _inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(batch, LENGTH, seed=seed)
    mask = torch.ones_like(ids)
    if batch == 2:
        ids[1, :PAD] = 0
        mask[1, :PAD] = 0
    return ids, mask


@torch.no_grad()
def _logits(model, cache, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits ``[b, LENGTH, vocab]``: a prefill of PREFILL tokens, then one token per forward."""
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = [model(ids[:, :PREFILL], attention_mask=mask[:, :PREFILL], position_ids=positions[:, :PREFILL],
                 cache=cache).logits]
    for t in range(PREFILL, LENGTH):
        out.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=positions[:, t : t + 1],
                         cache=cache).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_full_budget_equals_dynamic_cache(impl, batch):
    ids, mask = _inputs(batch)
    model = _model(impl)
    cache = _cache(model, 1.0)
    got = _logits(model, cache, ids, mask)
    expected = _logits(_model(impl), DynamicCache(), ids, mask)  # a fresh, never attached copy
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    assert all(not layer.summary_seconds for layer in cache.layers)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_no_logit_depends_on_a_later_token(impl, batch):
    model = _model(impl)
    ids, mask = _inputs(batch)
    base = _logits(model, _cache(model, 0.3), ids, mask)
    for changed in (PREFILL - 6, PREFILL + 5):  # inside the prefill, and in the decode steps
        other = ids.clone()
        other[:, changed:] = random_ids(batch, LENGTH - changed, seed=changed)
        cache = _cache(model, 0.3)
        logits = _logits(model, cache, other, mask)
        assert all(len(layer.summary_seconds) >= 2 for layer in cache.layers)
        assert torch.equal(logits[:, :changed], base[:, :changed]), f"a logit before position {changed} changed"
        assert not torch.equal(logits[:, changed:], base[:, changed:])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_setting_restored_when_caches_are_released(impl):
    model = _model(impl)
    first, second = _cache(model, 0.3), _cache(model, 0.3)
    assert model.config._attn_implementation == ATTENTION_NAME
    del first
    gc.collect()
    assert model.config._attn_implementation == ATTENTION_NAME  # the second cache still needs it
    _logits(model, second, *_inputs(1))
    del second
    gc.collect()
    assert model.config._attn_implementation == impl


def test_explicit_detach_restores_and_the_cache_then_refuses():
    model = _model("eager")
    cache = _cache(model, 0.3)
    ids, mask = _inputs(1)
    _logits(model, cache, ids, mask)
    detach(model)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="no longer runs the lossy attention function"):
        model(ids[:, :1], cache=cache)
    del cache
    gc.collect()  # releasing a cache of the earlier attachment leaves a new one alone
    fresh = _cache(model, 0.3)
    assert model.config._attn_implementation == ATTENTION_NAME
    del fresh


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attached_model_keeps_working_with_other_caches(impl):
    ids, mask = _inputs(2)
    expected = _logits(_model(impl), DynamicCache(), ids, mask)
    model = _model(impl)
    cache = _cache(model, 0.3)
    got = _logits(model, DynamicCache(), ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    del cache


def test_an_unexpected_attention_call_is_an_error():
    model = _model("sdpa")
    cache = _cache(model, 0.3)
    ids, mask = _inputs(1)
    _logits(model, cache, ids, mask)
    k = cache.layers[0].keys
    cache.layers[0].update(k[..., :1, :], k[..., :1, :])  # an update whose attention never runs
    with pytest.raises(RuntimeError, match="biases and padding mask would be lost"):
        model(ids[:, :3], cache=DynamicCache())


def test_a_batch_without_a_model_is_refused():
    lossy = LossyConfig(method="streaming", budget=0.5, interval=4)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy))
    states = torch.zeros(2, 2, 5, 16)
    with pytest.raises(ValueError, match="without a model: the cache cannot see the attention mask"):
        cache.update(states, states, 0)
