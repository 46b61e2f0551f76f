"""Lossless decoding on the device path, forced onto Triton's CPU interpreter (no GPU here).

On a CUDA model the cache decodes its blocks into tensors on the K/V's device and `codec.decode_batch` runs the
coder's Triton decoder there (`kernels.dispatch` decides). Here ``kernels.forced("triton")`` takes the same route
with CPU tensors: generation must be bit-identical to DynamicCache, and every block decode must have gone
through the Triton decoder (counted per stream), none through the host kernel. Small on purpose: the
interpreter runs every vector operation in numpy (16-token blocks, 64 lanes: 4 rounds a stream;
huff: 4-token blocks, 64 elements a stream).
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's kernels are defined (imported lazily)

import pytest
import torch
from helpers import count_huff_decoders, count_lanes_decoders, fresh_tiny_model, random_ids, same_bits
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, kernels

pytest.importorskip("triton")

LAYERS, BLOCK, PROMPT, NEW = 6, 16, 40, 2  # one decode step: 12 block decodes, 24 streams


@functools.cache
def model6():
    return fresh_tiny_model("llama-mqa", torch.bfloat16, layers=LAYERS)  # one KV head of 16 channels


@pytest.fixture
def decoders(monkeypatch):
    """Streams decoded by the Triton lanes decoder and by the host's compiled kernel."""
    from hf_kvcompress.codec import lanes

    monkeypatch.setattr(lanes, "lanes_for", lambda n: 6)  # 64 lanes: 4 rounds a 256-element stream
    return count_lanes_decoders(monkeypatch)


def _generate(cache):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0, "output_logits": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        return model6().generate(random_ids(1, PROMPT, seed=5), cache=cache, **kwargs)


@pytest.mark.parametrize("route", ["triton", "auto"])
def test_generation_is_identical_and_decodes_through_the_chosen_decoder(route, decoders):
    """``triton``: the device route (what a CUDA model with Triton takes); ``auto`` with CPU tensors: the host
    kernel. Either way logits and tokens are DynamicCache's, bit for bit, and the counts say which decoder ran
    every block (streams = 2 x kv heads per block decode)."""
    want = _generate(DynamicCache())
    config = CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=0,
                               lossless={"decoded_budget": 0.0, "coder": "lanes"})  # lanes' Triton decoder
    cache = CompressedCache(config, model=model6(), calibration=None)
    with kernels.forced(route):
        got = _generate(cache)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(want.logits, got.logits, strict=True):
        assert same_bits(a, b)
    decodes = cache.lossless.decodes
    assert decodes == (NEW - 1) * LAYERS * ((PROMPT + NEW - 2) // BLOCK)  # every sealed block, every step
    used, unused = ("triton", "host") if route == "triton" else ("host", "triton")
    assert decoders[used] == 2 * decodes and decoders[unused] == 0


def test_the_default_coder_generates_identically_through_its_triton_decoder(monkeypatch):
    """``coder=None``: generic's ``huff``, chosen automatically (the config says so), whose blocks take the huff
    family's Triton decoder on the device route: logits and tokens are DynamicCache's, bit for bit, and every block
    decode went through it. 4-token blocks: 64 elements a stream (the interpreter steps them one by one)."""
    counts = count_huff_decoders(monkeypatch)
    want = _generate(DynamicCache())
    config = CompressionConfig(mode="lossless", block_tokens=4, residual_tokens=0, lossless={"decoded_budget": 0.0})
    assert config.lossless.coder == "huff" and config.lossless.coder_auto
    cache = CompressedCache(config, model=model6(), calibration=None)
    with kernels.forced("triton"):
        got = _generate(cache)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(want.logits, got.logits, strict=True):
        assert same_bits(a, b)
    decodes = cache.lossless.decodes
    assert decodes == (NEW - 1) * LAYERS * ((PROMPT + NEW - 2) // 4)
    assert counts == {"triton": 2 * decodes, "host": 0}
