"""Files written by earlier releases keep loading bit for bit (fixtures under tests/fixtures/)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from hf_kvcompress import CompressedCache

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_a_version_1_file_of_ans_streams_loads_bit_identically():
    # written by hf_kvcompress 0.1.0 at commit 248945f (constriction `ans` streams, compact headers, per-block
    # statistics), three layers of 40 tokens with a NaN, an -inf and a -0.0 among them
    expected = load_file(FIXTURES / "v1_generic_kv.safetensors")
    cache = CompressedCache.load(FIXTURES / "v1_generic.kvc")
    assert cache.config.lossless.coder == "ans"
    layers = cache.kv_layers()
    assert len(layers) == 3
    for i, layer in enumerate(layers):
        for got, want in ((layer.keys, expected[f"k{i}"]), (layer.values, expected[f"v{i}"])):
            assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
