"""Kept entries in 8 bits (`LossyConfig.entry_format`): exact codes, more entries in the same budget, every byte
counted."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_tiny_model, random_ids
from test_lossy_memory import walked_bytes

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.packed import Packed, pack


def test_int8_codes_are_within_half_a_step():
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(0)) * 5
    packed = pack(x, "int8")
    assert packed.codes.dtype == torch.int8 and packed.scales.dtype == torch.float16
    step = packed.scales.float()
    assert bool(((packed.unpack() - x).abs() <= step / 2 + 1e-6).all())
    assert packed.nbytes() == x.numel() + 2 * x.numel() // 16


def test_fp8_keeps_three_mantissa_bits():
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(1))
    packed = pack(x, "fp8")
    assert packed.codes.dtype == torch.float8_e4m3fn
    # e4m3: relative rounding error <= 2^-4 for normal values; the tiniest values may be subnormal
    assert bool(((packed.unpack() - x).abs() <= x.abs() / 16 + packed.scales.float() * 2**-9).all())
    with pytest.raises(ValueError, match="entry format must be one of"):
        pack(x, "int4")


@pytest.mark.parametrize("method", ["summary", "topk", "streaming"])
def test_packed_entries_fit_more_in_the_budget(method):
    model = fresh_tiny_model("llama-gqa")
    ids = random_ids(2, 60, seed=3)
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    entries = {}
    for fmt in ("model", "int8"):
        lossy = LossyConfig(method=method, budget=0.3, interval=8, sinks=2, reference_queries=32, entry_format=fmt)
        cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             cache=cache, pad_token_id=0)
        assert out.shape == (2, 70)
        stats = cache.stats(per_layer=True)
        for layer, layer_stats in zip(cache.layers, stats["per_layer"]):
            kept = layer.blocks[-1]
            assert isinstance(kept.keys, Packed) == (fmt == "int8")
            assert layer_stats["held_bytes"] == walked_bytes(layer)
            assert layer.held_bytes() <= layer.budget_bytes() + layer.since_summary * layer.token_bytes + 1
        cache.batch_select_indices(torch.tensor([1]))  # packed blocks follow row selections
        assert cache.layers[0].keys.shape[0] == 1
        entries[fmt] = stats["entries"]
    assert entries["int8"] > 1.5 * entries["model"]
