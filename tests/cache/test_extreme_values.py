"""Lossless codes any bit pattern, with every predictor: the largest finite values (a whole channel of them, whose
block statistics overflow float32), infinities, NaN payloads, -0.0 and subnormals, in generation and in saved
files, in bf16 / fp16 / fp32; and a few such elements do not spoil the predictions of the elements after them."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import fresh_tiny_model, random_ids, same_bits, tiny_calibration
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.predictors import below, linear

LAYERS, HEADS, DIM, TOKENS = 6, 2, 16, 40
CALIBRATED = ("none", "context", "below", "grid")
SAVED = ("generic", "framed", "self", *CALIBRATED)


@functools.cache
def model6():
    return fresh_tiny_model("llama-gqa", torch.bfloat16, layers=LAYERS)


@functools.cache
def calibration6() -> Calibration:
    return tiny_calibration(model6(), 256, predictors=CALIBRATED)


def specials(dtype: torch.dtype) -> torch.Tensor:
    """NaN payloads (quiet, negative, signalling), +-inf, -0.0, subnormals and +-the largest finite value."""
    if dtype == torch.float32:
        bits, view = [0x7FC00001, 0xFFA60000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001,
                      0x80000003, 0x7F7FFFFF, 0xFF7FFFFF], torch.int32
    elif dtype == torch.bfloat16:
        bits, view = [0x7FC1, 0xFFA5, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x8003, 0x7F7F, 0xFF7F], torch.int16
    else:
        bits, view = [0x7E01, 0xFEA5, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x8003, 0x7BFF, 0xFBFF], torch.int16
    width = 32 if view == torch.int32 else 16
    return torch.tensor([b - (1 << width) if b >> (width - 1) else b for b in bits], dtype=view).view(dtype)


def extreme_kv(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian K/V with the special values planted, and one block's channel (and its RoPE pair) held at the
    largest finite magnitudes: a channel whose float32 mean and std overflow."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        x = torch.randn(1, HEADS, TOKENS, DIM, generator=g).to(dtype)
        top = torch.finfo(dtype).max
        x[0, 0, :16, 3], x[0, 0, :16, 3 + DIM // 2] = top, -top  # the first block (block_tokens 16)
        x[0, 1, 5, :10] = specials(dtype)
        x[0, 0, 20, 6:16] = specials(dtype)
        out.append(x)
    return out[0], out[1]


def filled(dtype: torch.dtype, predictor: str = "generic", coder: str = "huff") -> tuple[CompressedCache, list]:
    config = CompressionConfig(block_tokens=16, residual_tokens=8,
                               lossless=LosslessConfig(predictor=predictor, coder=coder, workers=1))
    cache = CompressedCache(config, calibration=calibration6() if predictor in CALIBRATED else None)
    kv = [extreme_kv(dtype, layer) for layer in range(LAYERS)]
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    return cache, kv


def assert_holds(cache: CompressedCache, kv: list) -> None:
    for layer, (k, v) in zip(cache.kv_layers(), kv, strict=True):
        assert same_bits(layer.keys, k) and same_bits(layer.values, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_every_save_predictor_codes_extreme_values_bit_exactly(dtype, tmp_path):
    cache, kv = filled(dtype)
    assert_holds(cache, kv)
    for predictor in SAVED:
        path = cache.save(tmp_path / f"{predictor}.kvc", predictor=predictor)
        assert_holds(CompressedCache.load(path, calibration=calibration6()), kv)


@pytest.mark.parametrize("coder", ["huff", "lanes"])
@pytest.mark.parametrize("predictor", ["generic", "framed", "self", *CALIBRATED])
def test_every_generation_predictor_codes_extreme_values_bit_exactly(predictor, coder):
    cache, kv = filled(torch.bfloat16, predictor, coder)
    assert all(len(layer.blocks) == 2 for layer in cache.kv_layers())  # 32 of the 40 tokens are coded
    assert_holds(cache, kv)


def coded_bytes(cache: CompressedCache) -> int:
    return sum(len(blob) for layer in cache.kv_layers() for block in layer.blocks for row in block.rows
               for blob in row.blobs)


@pytest.mark.parametrize("predictor", CALIBRATED)
def test_a_non_finite_element_does_not_spoil_later_predictions(predictor):
    """One NaN and one inf in layer 1's first block: every later stream, token and layer codes as well as
    without them (a NaN or inf mean or spread downstream would cost every element after it, or be refused)."""
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, HEADS, 24, DIM, generator=g).bfloat16(), torch.randn(1, HEADS, 24, DIM, generator=g).bfloat16())
          for _ in range(LAYERS)]
    sizes = []
    for plant in (False, True):
        config = CompressionConfig(block_tokens=16, residual_tokens=8, lossless=LosslessConfig(predictor=predictor))
        cache = CompressedCache(config, calibration=calibration6())
        written = [(k.clone(), v.clone()) for k, v in kv]
        if plant:
            written[1][0][0, 0, 2, 1], written[1][1][0, 0, 3, 4] = float("nan"), float("inf")
        for layer, (k, v) in enumerate(written):
            cache.update(k, v, layer)
        sizes.append(coded_bytes(cache))
        assert_holds(cache, written)
    # two escaped elements and one token's larger spread: a few bytes of ~13,000 (a feature clamped to a large
    # bound instead of read as 0 cost 60 more; a NaN mean or spread would be refused)
    # a Huffman-table coder (``grid`` generates with ``mhuff``) also lists the two new symbols in its stream's
    # code-length table: a segment of ~3 bytes each (mhuff version 2, k = 3: its gap and count varints and its pair
    # codes, ~5 bytes each, and the codes around them; measured 21, version 1 13)
    allowed = 8 if config.lossless.coder == "lanes" else 24
    assert sizes[1] - sizes[0] <= allowed, sizes


def plant_in_last_layer(model, dtype: torch.dtype, token: int):
    """Forward hooks that write the special values into the last layer's key and value projections at prompt
    position ``token`` (the layers below stay finite, so the K/V of every other token are ordinary)."""
    attention = model.model.layers[-1].self_attn

    def plant(module, args, out):
        if out.shape[1] > token:  # the prefill only
            out = out.clone()
            out[0, token, : specials(dtype).numel()] = specials(dtype)
        return out

    return [attention.k_proj.register_forward_hook(plant), attention.v_proj.register_forward_hook(plant)]


@pytest.mark.parametrize("predictor", CALIBRATED)
def test_calibrated_predictors_generate_with_special_values(predictor):
    model = model6()
    ids = random_ids(1, 40, seed=5)
    hooks = plant_in_last_layer(model, torch.bfloat16, token=7)
    try:
        with torch.no_grad():
            expected = DynamicCache()
            want = model.generate(ids, cache=expected, do_sample=False, pad_token_id=0, max_new_tokens=12)
            config = CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=8,
                                       lossless={"predictor": predictor})
            cache = CompressedCache(config, model=model, calibration=calibration6())
            got = model.generate(ids, cache=cache, do_sample=False, pad_token_id=0, max_new_tokens=12)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(got, want)
    last = cache.kv_layers()[-1]
    assert len(last.blocks) >= 2 and bool(last.keys.isnan().any()) and bool(last.values.isinf().any())
    for layer, ref in zip(cache.kv_layers(), expected.layers, strict=True):
        assert same_bits(layer.keys, ref.keys) and same_bits(layer.values, ref.values)


def blobs(cache: CompressedCache) -> list[bytes]:
    return [bytes(blob) for layer in cache.kv_layers() for block in layer.blocks for row in block.rows
            for blob in row.blobs]


@pytest.mark.parametrize("predictor", CALIBRATED)
def test_what_coded_before_codes_the_same_bytes(predictor, tmp_path, monkeypatch):
    """K/V the predictors coded before they read non-finite elements as 0 (an infinity in values, huge finite
    values, the largest finite one, a NaN in the last stream): generation blocks and saved files are the bytes the
    predictors write with those guards switched off, so files written before load (written by 072c9fa, they did)."""
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, HEADS, 24, DIM, generator=g).bfloat16(), torch.randn(1, HEADS, 24, DIM, generator=g).bfloat16())
          for _ in range(LAYERS)]
    kv[2][0][0, 0, 3, 4] = 1e20
    kv[3][1][0, 1, 3, 4] = 1e30
    kv[4][1][0, 1, 5, 4] = torch.finfo(torch.bfloat16).max
    kv[5][1][0, 1, 3, 15] = float("nan")  # the last stream of the last layer: nothing reads it
    if predictor == "none":  # no features: only the surprise reads an infinity (it saturates, as before)
        kv[1][1][0, 1, 3, 4] = float("inf")

    def written(name: str) -> tuple[list[bytes], bytes]:
        config = CompressionConfig(block_tokens=16, residual_tokens=8, lossless=LosslessConfig(predictor=predictor))
        cache = CompressedCache(config, calibration=calibration6())
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        path = cache.save(tmp_path / f"{name}.kvc", predictor=predictor)
        assert_holds(CompressedCache.load(path, calibration=calibration6()), kv)
        return blobs(cache), path.read_bytes()

    guarded = written("guarded")
    monkeypatch.setattr(linear, "finite_features", lambda x: x)
    monkeypatch.setattr(linear, "finite_means", lambda means, bias: means)
    monkeypatch.setattr(linear, "F32_MAX", float("inf"))
    monkeypatch.setattr(below, "F32_MAX", float("inf"))
    assert written("unguarded") == guarded
