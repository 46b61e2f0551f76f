"""Kept entries in 8 or 4 bits (`LossyConfig.entry_format`): exact codes, more entries in the same budget, every byte
counted."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_tiny_model, random_ids
from lossy_testutil import walked_bytes

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.budget import entry_bytes, upgrade_order
from hf_kvcompress.lossy.packed import Packed, Split, pack, vector_bytes


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
        pack(x, "int3")


def test_int4_codes_are_within_half_a_step_and_two_per_byte():
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(2)) * 3 + 1
    x[0, 0, 0] = 0.5  # a constant vector: every code 0, the offset carries it
    packed = pack(x.to(torch.bfloat16), "int4")
    assert packed.codes.dtype == torch.uint8 and packed.codes.shape == (2, 3, 7, 8) and packed.shape == x.shape
    assert packed.scales.dtype == packed.offsets.dtype == torch.float16
    out = packed.unpack()
    assert out.dtype == torch.bfloat16
    step = packed.scales.float()
    # the float16 offset is the rounded minimum: codes clamp at 0, so the error bound gains its rounding
    slack = (x.amin(-1, keepdim=True) - packed.offsets.float()).abs()
    assert bool(((out.float() - x.to(torch.bfloat16).float()).abs() <= step / 2 + slack + x.abs() / 128).all())
    assert torch.equal(out[0, 0, 0].float(), torch.full((16,), 0.5))
    assert packed.nbytes() == x.numel() // 2 + 4 * x.numel() // 16
    assert vector_bytes(16, 2, "int4") * 2 * 3 * 7 == packed.nbytes()
    picked = packed.map(lambda t: t[1:])
    assert torch.equal(picked.unpack(), out[1:])
    with pytest.raises(ValueError, match="head_dim divisible by 2"):
        pack(torch.randn(1, 1, 2, 5), "int4")


@pytest.mark.parametrize("method", ["summary", "topk", "streaming"])
def test_packed_entries_fit_more_in_the_budget(method):
    model = fresh_tiny_model("llama-gqa")
    ids = random_ids(2, 60, seed=3)
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    entries = {}
    for fmt in ("model", "int8", "int4", "mixed"):
        lossy = LossyConfig(method=method, budget=0.3, interval=8, sinks=2, reference_queries=32, entry_format=fmt)
        cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             cache=cache, pad_token_id=0)
        assert out.shape == (2, 70)
        stats = cache.stats(per_layer=True)
        for layer, layer_stats in zip(cache.layers, stats["per_layer"]):
            kept = layer.blocks[-1]
            assert isinstance(kept.keys, Split if fmt == "mixed" else Packed) == (fmt != "model")
            assert layer_stats["held_bytes"] == walked_bytes(layer)
            assert layer.held_bytes() <= layer.budget_bytes() + layer.since_summary * layer.token_bytes + 1
        cache.batch_select_indices(torch.tensor([1]))  # packed blocks follow row selections
        assert cache.layers[0].keys.shape[0] == 1
        entries[fmt] = stats["entries"]
    assert entries["int8"] > 1.5 * entries["model"]
    assert entries["int4"] > entries["int8"]
    assert entries["mixed"] == entries["int4"]  # the same entries, some of them upgraded


def test_mixed_stores_the_first_entries_in_int8_and_the_rest_in_int4():
    x = torch.randn(2, 3, 10, 16, generator=torch.Generator().manual_seed(4))
    split = pack(x, "mixed", (4,))
    assert isinstance(split, Split) and split.shape == x.shape
    assert torch.equal(split.unpack(), torch.cat([pack(x[..., :4, :], "int8").unpack(),
                                                  pack(x[..., 4:, :], "int4").unpack()], dim=-2))
    assert split.nbytes() == 2 * 3 * (4 * vector_bytes(16, 4, "int8") + 6 * vector_bytes(16, 4, "int4"))
    assert torch.equal(split.map(lambda t: t[:1]).unpack(), split.unpack()[:1])


def test_upgrade_order_spends_exactly_the_budget_left_on_the_best_entries():
    h, t, d, elem = 2, 10, 16, 2
    score = torch.tensor([[5.0, 1, 9, 3, 7, 2, 8, 0, 6, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])[None]
    base = entry_bytes(h, d, elem, with_bias=True, fmt="int4")
    extra = 2 * h * (vector_bytes(d, elem, "int8") - vector_bytes(d, elem, "int4"))
    for high_wanted in (0, 3, 10):
        budget = t * base + high_wanted * extra + extra - 1  # one byte short of one more upgrade
        order, (high,) = upgrade_order(score, budget, d, elem, with_bias=True)
        assert high == min(high_wanted, t)
        # the upgraded entries are the best-scored ones, each part in position order
        assert order[0, 0, :high].tolist() == sorted(score[0, 0].argsort(descending=True)[:high].tolist())
        assert order[0, 1, :high].tolist() == list(range(t - high, t))
        assert sorted(order[0, 0].tolist()) == list(range(t))
    assert upgrade_order(score, t * base - 1, d, elem, with_bias=True)[1] == (0,)


def test_mixed_keeps_every_entry_while_int4_holds_them():
    """At a budget where int4 holds the whole region nothing is dropped (and nothing refitted): the summary is the
    region, quantized, its best entries in int8."""
    model = fresh_tiny_model("llama-gqa")
    ids = random_ids(1, 60, seed=5)
    lossy = LossyConfig(method="summary", budget=0.33, interval=8, sinks=2, reference_queries=32, kept_queries=0,
                        entry_format="mixed")
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    for layer in cache.layers:
        kept = layer.blocks[-1]
        high, low = kept.keys.parts
        assert isinstance(kept.keys, Split) and high.shape[-2] > 0 and low.shape[-2] > 0
        assert kept.bias is None  # plain tokens, kept as they are: no fitted bias
        assert kept.entries + layer.residual_length + layer.sink_block.entries == 60
        assert layer.held_bytes() <= layer.budget_bytes() + 1
