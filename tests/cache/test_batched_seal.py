"""Sealing many blocks at once (a prefill, a load handing a layer's decoded blocks over): one codec call per layer,
the block statistics in one pass, and the bytes of blocks sealed one at a time (issue 48)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_continues_identically, fresh_tiny_model, random_ids, same_bits, tiny_calibration
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig, blockcoder
from hf_kvcompress.blockcoder import SCALE_MAX, SCALE_MIN, choose_scale, choose_scales
from hf_kvcompress.cache.coded import CodedStorage
from hf_kvcompress.layer.storage import Storage
from hf_kvcompress.predictors import generic

BLOCK, RESIDUAL = 32, 16
LAYERS = 6
#: NaN payloads, infinities, -0.0 and subnormals of bfloat16 (tests/fixtures/make_fixtures.special_values)
SPECIALS = [0x7FC0, 0x7FC1, 0xFFC3, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x0040, 0x7F7F]


@pytest.fixture(scope="module")
def model():
    return fresh_tiny_model("llama-gqa", torch.bfloat16, layers=LAYERS)


@pytest.fixture(scope="module")
def calibration(model):
    return tiny_calibration(model, 256, predictors=("none", "context", "below"))


def config(**lossless) -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                             lossless=LosslessConfig(**lossless))


def model_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's K/V of ``ids`` per layer, the special values written over a few elements of each."""
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    specials = torch.tensor([b - 65536 if b >= 32768 else b for b in SPECIALS], dtype=torch.int16).view(torch.bfloat16)
    out = []
    for layer in cache.layers:
        k, v = layer.keys.clone(), layer.values.clone()
        for t in (k, v):
            t.view(-1)[7 : 7 + specials.numel()] = specials
            t.view(-1)[-50 : -50 + specials.numel()] = specials
        out.append((k, v))
    return out


def blocks_bytes(cache: CompressedCache) -> list[bytes]:
    """Every sealed block's streams, scale codes, side data and listed elements, block by block."""
    out = []
    for layer in cache.kv_layers():
        for block in layer.blocks:
            data = bytearray(f"{block.layer}/{block.start}/{block.tokens}".encode())
            for row in block.rows:
                data += b"".join(len(blob).to_bytes(4, "little") + blob for blob in row.blobs) + bytes(row.scales)
                for name in sorted(row.side):
                    data += name.encode() + row.side[name].contiguous().view(torch.uint8).numpy().tobytes()
                if row.listed is not None:
                    data += row.listed.numpy().tobytes()
            out.append(bytes(data))
    return out


def filled(settings: CompressionConfig, kv, calibration=None) -> CompressedCache:
    """A cache given ``kv`` in one update per layer."""
    cache = CompressedCache(settings, calibration=calibration)
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    return cache


def both_ways(monkeypatch, settings: CompressionConfig, kv, calibration=None):
    """``kv`` filled into a cache that seals an update's blocks together, and into one that seals them one by one
    (`Storage.hold_blocks`' loop over `hold`, as every update sealed before blocks were sealed together)."""
    together = filled(settings, kv, calibration)
    with monkeypatch.context() as patch:
        patch.setattr(CodedStorage, "hold_blocks", Storage.hold_blocks)
        one_by_one = filled(settings, kv, calibration)
    return together, one_by_one


def test_a_prefill_seals_its_blocks_in_one_codec_call_per_layer(model, monkeypatch):
    ids = random_ids(2, RESIDUAL + 5 * BLOCK + 7, seed=3)  # 5 full blocks per layer, 2 rows
    calls, stats = [], []
    encode, block_stats = blockcoder.encode_streams, generic.block_stats

    def counted_encode(x, *args, **kwargs):
        calls.append(x.shape[0])
        return encode(x, *args, **kwargs)

    def counted_stats(keys, values):
        stats.append(keys.shape[0])
        return block_stats(keys, values)

    monkeypatch.setattr(blockcoder, "encode_streams", counted_encode)
    monkeypatch.setattr(generic, "block_stats", counted_stats)
    reference, cache = DynamicCache(), CompressedCache(config(), model=model)
    with torch.no_grad():
        model(ids, past_key_values=reference, use_cache=True)
        model(ids, cache=cache, use_cache=True)
    heads = model.config.num_key_value_heads
    assert [len(layer.blocks) for layer in cache.kv_layers()] == [5] * LAYERS
    # one codec call and one pass of block statistics per layer, each over the layer's 5 blocks of 2 rows
    assert calls == [5 * 2 * heads * 2] * LAYERS
    assert stats == [5 * 2] * LAYERS
    assert_continues_identically(model, reference, cache, random_ids(2, 3, seed=4))


@pytest.mark.parametrize("predictor,coder", [("generic", "huff"), ("generic", "lanes"), ("none", "huff"),
                                             ("context", "lanes"), ("below", "huff")])
def test_blocks_sealed_together_are_the_bytes_of_blocks_sealed_one_by_one(model, calibration, monkeypatch, predictor,
                                                                          coder):
    kv = model_kv(model, random_ids(2, RESIDUAL + 4 * BLOCK + 5, seed=5))
    settings = config(predictor=predictor, coder=coder)
    together, one_by_one = both_ways(monkeypatch, settings, kv, None if predictor == "generic" else calibration)
    assert len(blocks_bytes(together)) == 4 * LAYERS
    assert blocks_bytes(together) == blocks_bytes(one_by_one)
    # the decoded pool and the chain memo were offered the blocks with the same budget at each: the same bytes held
    assert together.stats() == one_by_one.stats()
    for got, (k, v) in zip(together.kv_layers(), kv):
        assert same_bits(got.keys, k) and same_bits(got.values, v)


def test_keys_and_values_of_two_widths_seal_together_as_one_by_one(monkeypatch):
    torch.manual_seed(1)
    kv = [(torch.randn(2, 2, RESIDUAL + 3 * BLOCK, 16).bfloat16(), torch.randn(2, 2, RESIDUAL + 3 * BLOCK, 8).bfloat16())
          for _ in range(2)]
    together, one_by_one = both_ways(monkeypatch, config(), kv)
    assert len(blocks_bytes(together)) == 3 * 2 and blocks_bytes(together) == blocks_bytes(one_by_one)
    for got, (k, v) in zip(together.kv_layers(), kv):
        assert same_bits(got.keys, k) and same_bits(got.values, v)


def test_blocks_that_do_not_divide_are_refused(model):
    cache = CompressedCache(config())
    cache.update(*model_kv(model, random_ids(1, RESIDUAL + BLOCK, seed=6))[0], 0)
    k = torch.zeros(1, 2, BLOCK + 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        cache.lossless.encode_blocks(0, k, k, 0, BLOCK)


CHOOSE_SCALES = """
import torch
from hf_kvcompress.blockcoder import choose_scale, choose_scales
torch.manual_seed(0)
x = (torch.randn(3, 4, 2, 32, 16) * torch.logspace(-6, 6, 16)).bfloat16()
x.view(-1)[:12] = torch.tensor({specials}, dtype=torch.int16).view(torch.bfloat16)
cases = [(torch.randn(3, 4, 2, 1, 16), torch.rand(3, 4, 2, 1, 16) + 1e-3),  # per-channel, as `generic` predicts
         (torch.randn(3, 4, 2, 32, 16), torch.rand(3, 4, 2, 32, 16) * 4),  # per-element
         (torch.randn(3, 4, 2, 32, 16, dtype=torch.float64), torch.rand(1, 4, 1, 1, 16, dtype=torch.float64)),
         (torch.zeros(1, 1, 1, 1, 16), torch.full((1, 1, 1, 1, 1), 1e-30))]
def pick(t, *at):  # stream `at` of statistics broadcast over streams
    return t[tuple(min(a, n - 1) for a, n in zip(at, t.shape))]
for mean, std in cases:
    got = choose_scales(x, mean, std)
    want = [[[choose_scale(x[i, s, b], pick(mean, i, s, b), pick(std, i, s, b)) for b in range(2)]
             for s in range(4)] for i in range(3)]
    assert got.tolist() == want, (got.tolist(), want)
print("same", sorted(set(got.reshape(-1).tolist()))[:3])
"""


@pytest.mark.parametrize("capability", [None, "default"])
def test_choose_scales_is_choose_scale_of_each_stream(capability):
    """The vectorized scale choice gives each stream's own code, with this CPU's kernels and with the default
    (non-vectorized) ones: each stream's mean reduces one contiguous row exactly as a stream alone does."""
    env = dict(os.environ)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", CHOOSE_SCALES.format(specials=[
        b - 65536 if b >= 32768 else b for b in SPECIALS])], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("same")


def test_choose_scales_clips_like_choose_scale():
    x = torch.tensor([[[[1e30, -1e30]], [[0.0, 0.0]]]])  # [2 streams, 1 token, 2 channels]
    mean, std = torch.zeros(1, 1, 2), torch.full((1, 1, 2), 1e-6)
    codes = choose_scales(x, mean, std).tolist()
    assert codes == [[choose_scale(x[0, 0], mean, std), choose_scale(x[0, 1], mean, std)]]
    assert codes[0][1] == SCALE_MIN and SCALE_MIN <= codes[0][0] <= SCALE_MAX
