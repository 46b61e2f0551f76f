"""The codec through the kernel path (what it does with CUDA tensors, forced here onto the CPU interpreter)
writes the same stream bytes and decodes the same tensors as its host path; corruption still raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_testutil import needs_triton

from hf_kvcompress import codec, kernels
from hf_kvcompress.codec import CodecConfig, CorruptStreamError

SMALL = dict(short_tokens=0, tier_windows=(64, 128, 192), probe=64, min_window=64)


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(2, 96, generator=g)
    std = torch.rand(2, 96, generator=g) + 0.05
    x = (mean + std * torch.randn(2, 96, generator=g)).to(dtype)
    x.view(-1)[[5, 100]] = torch.tensor([float("nan"), -3e4]).to(dtype)  # escapes
    return x, mean, std


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("cfg", "stats"),
    [
        (CodecConfig(coder="ans", fixed_window=64), "both"),
        (CodecConfig(coder="ans", header="compact", fixed_window=128, mean_steps=4), "both"),
        (CodecConfig(coder="ans", window="metadata", **SMALL), "none"),
        (CodecConfig(coder="ans", header="compact", window="predicted", **SMALL), "channel"),
    ],
    ids=["fixed", "compact", "metadata-nostats", "predicted-channel"],
)
def test_same_bytes_and_values_through_the_kernels(dtype, cfg, stats):
    x, mean, std = _data(dtype)
    if stats == "none":
        mean = std = None
    elif stats == "channel":
        mean, std = mean.mean(-1, keepdim=True), std.mean(-1, keepdim=True)
    host = codec.encode(x, mean, std, cfg)
    with kernels.forced("triton"):
        device = codec.encode(x, mean, std, cfg)
        back = codec.decode(host, mean, std, config=cfg)
    assert device == host
    assert torch.equal(_bits(back), _bits(x))


@needs_triton
def test_corrupt_streams_raise_on_the_kernel_path():
    x, mean, std = _data(torch.bfloat16, seed=1)
    cfg = CodecConfig(coder="ans", header="compact", fixed_window=64)
    blob = codec.encode(x, mean, std, cfg)
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(6):
        b = bytearray(blob)
        pos = int(rng.integers(len(b) - 40, len(b)))  # in the payloads
        b[pos] ^= 1 << int(rng.integers(0, 8))
        with kernels.forced("triton"):
            try:
                out = codec.decode(bytes(b), mean, std, config=cfg)
                assert torch.equal(_bits(out), _bits(x))
                outcomes.add("exact")
            except CorruptStreamError:
                outcomes.add("error")
    assert "error" in outcomes


def test_device_source_with_the_torch_reference(monkeypatch):
    """A CUDA machine without Triton: the codec's device path runs the per-element model as the torch
    reference (same bytes); decoding then falls back to the host (constriction)."""
    import hf_kvcompress.kernels.dispatch as dispatch

    x, mean, std = _data(torch.bfloat16, seed=2)
    cfg = CodecConfig(coder="ans", header="compact", fixed_window=128)
    host = codec.encode(x, mean, std, cfg)
    monkeypatch.setattr(dispatch, "device_path", lambda *tensors: True)
    with kernels.forced("torch"):
        assert codec.encode(x, mean, std, cfg) == host
        assert torch.equal(_bits(codec.decode(host, mean, std, config=cfg)), _bits(x))


@needs_triton
@pytest.mark.parametrize("shape", [(0,), (3, 0, 5), (1,), (7,)])
def test_empty_and_tiny_tensors_through_the_kernels(shape):
    x = torch.randn(shape).bfloat16()
    mean, std = torch.zeros(shape), torch.ones(shape)
    for cfg in (CodecConfig(coder="ans"), CodecConfig(coder="ans", header="compact")):
        host = codec.encode(x, mean, std, cfg)
        with kernels.forced("triton"):
            assert codec.encode(x, mean, std, cfg) == host
            out = codec.decode(host, mean, std, config=cfg)
        assert out.shape == x.shape and torch.equal(_bits(out), _bits(x))
