"""The block codec on its own (no cache): one rule for marginals and for adoption (`BlockCodec.codes_like`),
predictor capabilities declared at construction, blocks as plain data, and a bit-exact round trip."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import same_bits

from hf_kvcompress import LosslessConfig
from hf_kvcompress import codec as codec_api
from hf_kvcompress.blockcodec import BlockCodec, CodedBlock
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.predictors import make_predictor

CALIBRATION = Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "calibration"


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    return Calibration.load(str(CALIBRATION))


def codec(name: str, calibration=None, portable: bool = False, **settings) -> BlockCodec:
    return BlockCodec.over(LosslessConfig(**settings), make_predictor(name, calibration=calibration, portable=portable),
                           calibration, None)


def test_capabilities_are_facts_of_construction(calibration):
    assert not make_predictor("generic").portable and make_predictor("generic", portable=True).portable
    assert make_predictor("context", calibration=calibration, portable=True).portable
    assert not make_predictor("generic").calibrated and not make_predictor("context").calibrated
    assert make_predictor("context", calibration=calibration).calibrated
    assert make_predictor("below", calibration=calibration, portable=True).calibrated


def test_only_a_calibrated_predictor_codes_with_the_marginals(calibration):
    assert codec("generic", calibration).codec_for(0) == LosslessConfig().codec_config()
    assert codec("context").codec_for(0).marginal is None  # no calibration: block statistics, default p_hat
    calibrated = codec("context", calibration, coder="lanes")
    assert calibrated.codec_for(1).marginal.sha256 == calibration.marginal(1).sha256
    assert calibrated.codec_for(1) is calibrated.codec_for(1)  # one object per layer (the coder groups by it)
    huff = codec("context", calibration, coder="huff")  # huff reads no marginal: none held, none in its config
    assert huff.marginals is None and huff.codec_for(1) == LosslessConfig(coder="huff").codec_config()


def test_huff_streams_are_the_same_bytes_whatever_the_marginal(calibration):
    torch.manual_seed(0)
    x = torch.randn(4, 64, 16).bfloat16()
    mean, std = torch.zeros(4, 64, 1), torch.ones(4, 64, 1)
    plain = LosslessConfig(coder="huff").codec_config()
    with_marginal = replace(plain, marginal=calibration.marginal(0))
    assert codec_api.encode_batch(x, mean, std, plain) == codec_api.encode_batch(x, mean, std, with_marginal)


def test_codes_like_is_the_adoption_rule(calibration):
    generation = codec("generic")
    assert codec("generic", portable=True).codes_like(generation)  # exact everywhere: portable changes nothing
    assert not codec("generic", coder="lanes").codes_like(generation)  # other codec settings
    assert not codec("self").codes_like(codec("self"))  # statistics fitted on the cache's own blocks
    assert not codec("context", calibration, portable=True).codes_like(codec("context", calibration))


@pytest.mark.parametrize("name", ["generic", "none", "context"])
def test_round_trip_is_bit_exact_with_special_values(name, calibration):
    torch.manual_seed(0)
    model = calibration.meta["model"]
    layers, heads, dim, tokens = 2, model["kv_heads"], model["head_dim"], 16
    kv = [(torch.randn(1, heads, tokens, dim).bfloat16(), torch.randn(1, heads, tokens, dim).bfloat16())
          for _ in range(layers)]
    bits = [0x7FC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F]  # NaN payload, +-inf, -0.0, subnormals
    specials = torch.tensor([b - 65536 if b >= 32768 else b for b in bits], dtype=torch.int16).view(torch.bfloat16)
    kv[1][0].view(-1)[3:9] = specials  # every predictor codes them (docs/lossless.md, "Special values")
    blocks: dict = {}
    writer = BlockCodec.over(LosslessConfig(), make_predictor(name, calibration=calibration, portable=True),
                             calibration, lambda layer, start: blocks.get((layer, start)))
    for layer, (k, v) in enumerate(kv):
        blocks[(layer, 0)] = writer.encode_block(layer, k, v, 0)
    assert all(isinstance(b, CodedBlock) and not hasattr(b, "coding") for b in blocks.values())  # plain data
    reader = BlockCodec.over(LosslessConfig(), make_predictor(name, calibration=calibration, portable=True),
                             calibration, lambda layer, start: blocks.get((layer, start)))
    for layer, (k, v) in enumerate(kv):
        values = reader.decoded(blocks[(layer, 0)])
        assert same_bits(values.keys, k) and same_bits(values.values, v)
    assert reader.decodes == layers
