"""The Triton decoder of the lanes format (`codec.device_triton`) in the CPU interpreter: bit-identical to the
numba decoder, corrupt streams refused. Small streams: the interpreter runs every vector op in numpy."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported and the kernel defined

import pytest
import torch
from codec_testutil import DTYPES, assert_bit_exact, from_patterns, special_patterns
from helpers import count_lanes_decoders

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError

pytest.importorskip("triton")

LANES = CodecConfig(coder="lanes")


def _data(dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 4, 8, generator=g) * 3).to(dtype)  # 32 elements a stream (the interpreter is slow)
    sp = from_patterns(special_patterns(dtype), dtype)
    x.view(-1)[: sp.numel()] = sp  # NaN payloads, infinities, -0.0, subnormals: escapes under p_hat
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lanes_log2", [0, 3])
def test_triton_decoder_equals_cpu(dtype, lanes_log2, monkeypatch):
    """One lane (32 rounds) and 8 lanes (4 rounds: the prefix-sum refills), forced on short streams."""
    from hf_kvcompress.codec import lanes
    from hf_kvcompress.codec.device_triton import decode_batch_triton

    monkeypatch.setattr(lanes, "lanes_for", lambda n: lanes_log2)
    x = _data(dtype, 0)
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randn(2, 1, 8, generator=g), torch.rand(2, 1, 8, generator=g) + 0.5),
             (x.float().nan_to_num(0, 0, 0) * 0.9, torch.rand(2, 4, 8, generator=g) * 0.5), (None, None)]
    for mean, std in cases if dtype == torch.bfloat16 else cases[:1]:
        blobs = codec.encode_batch(x, mean, std, LANES)
        y = decode_batch_triton(blobs, mean, std, LANES)
        assert_bit_exact(y, x)
        assert_bit_exact(y, codec.decode_batch(blobs, mean, std, LANES))


def test_triton_decoder_refuses_corruption(monkeypatch):
    from hf_kvcompress.codec import lanes
    from hf_kvcompress.codec.device_triton import decode_batch_triton

    monkeypatch.setattr(lanes, "lanes_for", lambda n: 2)
    x = _data(torch.bfloat16, 2)
    blobs = codec.encode_batch(x, 0.0, 2.0, LANES)
    for flip in (-1, -9, -30):
        bad = bytearray(blobs[1])
        bad[flip] ^= 0x04
        with pytest.raises(CorruptStreamError):
            decode_batch_triton([blobs[0], bytes(bad)], 0.0, 2.0, LANES)


@pytest.fixture
def decoders(monkeypatch):
    """Counts of the streams each lanes decoder decoded: the Triton one and the host's compiled kernel."""
    return count_lanes_decoders(monkeypatch)


@pytest.mark.parametrize("stats", ["shared", "channel", "element"])
def test_decode_batch_routes_to_triton_when_the_kernels_say_so(stats, decoders, monkeypatch):
    """`codec.decode_batch` takes the Triton decoder where `kernels.dispatch` says Triton (forced here; on a GPU:
    CUDA statistics or ``out``), writes into ``out`` and gives the host decoder's bits; otherwise the host."""
    from hf_kvcompress import kernels
    from hf_kvcompress.codec import lanes

    monkeypatch.setattr(lanes, "lanes_for", lambda n: 2)
    x = _data(torch.bfloat16, 3)
    g = torch.Generator().manual_seed(4)
    shape = {"shared": (1, 1, 8), "channel": (2, 1, 8), "element": (2, 4, 8)}[stats]
    mean, std = torch.randn(shape, generator=g), torch.rand(shape, generator=g) + 0.5
    blobs = codec.encode_batch(x, mean, std, LANES)
    host = codec.decode_batch(blobs, mean, std, LANES)
    assert decoders == {"triton": 0, "host": 2}
    out = torch.empty_like(x)
    with kernels.forced("triton"):
        y = codec.decode_batch(blobs, mean, std, LANES, out=out)
    assert y is out and decoders == {"triton": 2, "host": 2}
    assert_bit_exact(y, host)
    assert_bit_exact(y, x)
    with kernels.forced("triton"), pytest.raises(ValueError, match=r"out must be a torch\.bfloat16 tensor of shape"):
        codec.decode_batch(blobs, mean, std, LANES, out=torch.empty(2, 4, 7, dtype=torch.bfloat16))
