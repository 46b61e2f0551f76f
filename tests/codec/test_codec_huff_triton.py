"""The huff family's Triton decoder (`huff_coder.huff_triton`, through `huff.decode_batch_triton`) in the CPU interpreter: bit-identical to the numba
decoder for ``huff`` and ``mhuff``, damaged streams refused with the numba decoder's own error. Streams of 32
elements: the interpreter runs every vector op in numpy, ~15 ms an element whatever the number of streams."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported and the kernel defined

import struct
import zlib

import numpy as np
import pytest
import torch
from codec_testutil import DTYPES, assert_bit_exact, from_patterns, special_patterns
from helpers import count_huff_decoders

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError

pytest.importorskip("triton")

CODERS = ("huff", "mhuff")


def _spec(coder: str):
    from hf_kvcompress.codec.huff_coder import huff, mhuff

    return {"huff": huff.SPEC, "mhuff": mhuff.SPEC}[coder]


def _data(dtype, seed: int, n: int = 3, run: int = 8):
    """``n`` streams of 4 x ``run`` elements near 1 (so that coding pays even for so few), NaN payloads, infinities,
    -0.0 and subnormals at the heads of the first two."""
    g = torch.Generator().manual_seed(seed)
    x = (1.0 + torch.randn(n, 4, run, generator=g) * 0.3).to(dtype)
    sp = from_patterns(special_patterns(dtype), dtype)
    x.view(-1)[:8] = sp[:8]
    x[min(1, n - 1)].view(-1)[8:16] = sp[8:]
    return x


def _stats(kind: str, n: int = 3, run: int = 8):
    """Statistics near `_data`'s: per channel, per element, shared by every stream, or none."""
    g = torch.Generator().manual_seed(11)
    shape = {"channel": (n, 4, 1), "element": (n, 4, run), "shared": (1, 4, 1)}.get(kind)
    if shape is None:
        return None, None
    return 1.0 + 0.1 * torch.randn(shape, generator=g), 0.2 + 0.1 * torch.rand(shape, generator=g)


@pytest.mark.parametrize("coder", CODERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decoder_equals_cpu(dtype, coder):
    """Per-channel (one context a row), per-element, shared and no statistics; a stored stream (random bits)
    beside coded ones in one batch. bfloat16 takes every kind of statistics, the others per-channel ones."""
    from hf_kvcompress.codec.huff_coder.huff import decode_batch_triton, prepare_decode

    cfg = CodecConfig(coder=coder)
    run = 8 if coder == "huff" else 32  # (mhuff's four tables of k=3 symbols pay from longer streams on)
    x = _data(dtype, 0, run=run)
    width = 4 if dtype == torch.float32 else 2
    g = torch.Generator().manual_seed(3)
    noise = torch.randint(0, 256, (1, 4, run * width), generator=g, dtype=torch.uint8)
    x[2] = noise.view(torch.int32 if width == 4 else torch.int16).view(dtype)[0]  # incompressible: stored
    kinds = ("channel", "element", "shared", "none") if dtype == torch.bfloat16 else ("channel",)
    coded = 0
    for kind in kinds:
        mean, std = _stats(kind, run=run)
        blobs = codec.encode_batch(x, mean, std, cfg)
        stored = prepare_decode(blobs, mean, std, None, True, _spec(coder)).parsed.stored
        assert stored[2]  # (mhuff stores some short streams of scattered contexts too: four tables cost)
        coded += int((~stored).sum())
        y = decode_batch_triton(blobs, mean, std, _spec(coder))
        assert_bit_exact(y, x)
        assert_bit_exact(y, codec.decode_batch(blobs, mean, std, cfg))
    assert coded


def test_triton_decoder_reads_mhuff_version_1_streams():
    """Version 1 streams (nibble tables, k=2: still decoded, `mhuff.SPEC_V1`) through the Triton decoder: the
    numba decoder's bits, every bit pattern's specials included."""
    from hf_kvcompress.codec.huff_coder import huff, mhuff

    x = _data(torch.bfloat16, 1)
    mean, std = _stats("channel")
    blobs = huff.encode_family(x, mean, std, mhuff.SPEC_V1)
    assert all(bytes(b[:3]) == mhuff.MAGIC_V1 for b in blobs)
    y = huff.decode_batch_triton(blobs, mean, std, mhuff.SPEC_V1)
    assert_bit_exact(y, x)
    assert_bit_exact(y, codec.decode_batch(blobs, mean, std, CodecConfig(coder="mhuff")))


def _outcome(decode, *args, **kwargs):
    """The decoded tensor, or the CorruptStreamError's message."""
    try:
        return decode(*args, **kwargs)
    except CorruptStreamError as err:
        return str(err)


@pytest.mark.parametrize("coder", CODERS)
def test_damage_gives_the_cpu_decoders_outcome(coder):
    """Payload bytes flipped and the crc32 resealed (so that the decoders' own checks meet the damage; verify=False
    too): the Triton decoder raises the numba decoder's error, message included (an invalid code, codes not
    ending at the payload's end, code lengths that form no code), or gives its values. Smooth data with one
    exponent per row leaves huff a single code, so half of its bit patterns start no code."""
    from hf_kvcompress.codec.huff_coder.huff import decode_batch_triton

    cfg = CodecConfig(coder=coder)
    g = torch.Generator().manual_seed(5)
    x = (1.0 + torch.rand(2, 2, 8, generator=g) * 0.9).to(torch.bfloat16)  # 16 elements a stream: the time
    x[1] = _data(torch.bfloat16, 6, 1)[0, :2]
    mean, std = torch.full((2, 2, 1), 1.5), torch.full((2, 2, 1), 0.25)
    rng = np.random.default_rng(1)
    messages = set()
    for s in (0, 1):
        blobs = codec.encode_batch(x, mean, std, cfg)
        blob = blobs[s]
        # payload bytes (random flips; bit 0 of one: stream 0's one-bit code), length tables
        flips = [(at, int(rng.integers(1, 256))) for at in rng.integers(len(blob) - 18, len(blob) - 4, 6).tolist()]
        for at, flip in [*flips, (len(blob) - 10, 1), (13, 0x10), (14, 1)]:
            bad = bytearray(blob)
            bad[at] ^= flip
            bad[-4:] = struct.pack("<I", zlib.crc32(bytes(bad[:-4])))
            batch = list(blobs)
            batch[s] = bytes(bad)
            host = _outcome(codec.decode_batch, batch, mean, std, cfg, verify=False)
            device = _outcome(decode_batch_triton, batch, mean, std, _spec(coder), verify=False)
            if isinstance(host, str):
                assert device == host
                messages.add(host.split(": ")[-1])
            else:
                assert_bit_exact(device, host)
    assert "its codes do not end at the payload's end" in messages
    if coder == "huff":  # (mhuff's class tables of this data hold more than one code each)
        assert "a bit pattern no code starts with" in messages
    bad = bytearray(blobs[1])
    bad[-10] ^= 1
    with pytest.raises(CorruptStreamError, match="stream 1: crc32 does not match"):  # verified: caught on the host
        decode_batch_triton([blobs[0], bytes(bad)], mean, std, _spec(coder))


@pytest.fixture
def decoders(monkeypatch):
    """Counts of the streams each huff-family decoder decoded: the Triton one and the host's compiled kernel."""
    return count_huff_decoders(monkeypatch)


@pytest.mark.parametrize("coder", CODERS)
def test_decode_batch_routes_to_triton_when_the_kernels_say_so(coder, decoders):
    """`codec.decode_batch` takes the Triton decoder where `kernels.dispatch` says Triton (forced here; on a GPU:
    CUDA statistics or ``out``), into a contiguous ``out`` in place or a strided one by a copy; huff starts no
    decode ahead for it (the layer's read decodes there); otherwise the host's decoder."""
    from hf_kvcompress import kernels

    cfg = CodecConfig(coder=coder)
    x = _data(torch.bfloat16, 7, 2)
    mean, std = _stats("channel", 2)
    blobs = codec.encode_batch(x, mean, std, cfg)
    host = codec.decode_batch(blobs, mean, std, cfg)
    assert decoders == {"triton": 0, "host": 2}
    out = torch.empty_like(x)
    strided = torch.empty(2, 8, 4, dtype=x.dtype).transpose(1, 2)
    with kernels.forced("triton"):
        assert codec.decode_batch(blobs, mean, std, cfg, out=out) is out
        assert codec.decode_batch(blobs, mean, std, cfg, out=strided) is strided
        if coder == "huff":  # (mhuff's own start_decode_batch declines CUDA statistics only)
            assert codec.start_decode_batch(blobs, mean, std, cfg, out=out) is None
    assert decoders == {"triton": 4, "host": 2}
    assert_bit_exact(out, host)
    assert_bit_exact(strided, x)


@pytest.mark.real_model
def test_triton_decoder_on_smollm2_blocks(smollm2, shakespeare_prompt):
    """SmolLM2's own keys and values (layers 0 and 20, the cache's per-channel statistics): 64 streams a layer,
    each 4 channels x 8 tokens of a head (the interpreter's speed), huff and mhuff; layer 0's also as float16 and
    float32 (the model's bfloat16 values converted)."""
    from hf_kvcompress.codec.huff_coder.huff import decode_batch_triton

    model, _ = smollm2
    with torch.no_grad():
        kv = model(shakespeare_prompt[:, :64], use_cache=True).past_key_values
    for layer in (0, 20):
        k, v = kv.layers[layer].keys, kv.layers[layer].values  # [1, heads, 64 tokens, 64 dims]
        x = torch.cat([k, v], 1)[0, :, :8].transpose(-1, -2).reshape(-1, 4, 8)  # [streams, 4 dims, 8 tokens]
        mean = x.float().mean(-1, keepdim=True)
        std = x.float().std(-1, keepdim=True) + 1e-3
        for xd in [x] if layer else [x, x.to(torch.float16), x.float()]:
            for coder in CODERS:
                cfg = CodecConfig(coder=coder)
                blobs = codec.encode_batch(xd, mean, std, cfg)
                y = decode_batch_triton(blobs, mean, std, _spec(coder))
                assert_bit_exact(y, xd)
                assert_bit_exact(y, codec.decode_batch(blobs, mean, std, cfg))


@pytest.mark.parametrize("coder", CODERS)
@pytest.mark.parametrize("shape", [(3, 0, 5), (1,), (7,), (2, 1)])
def test_empty_and_tiny_batches(coder, shape):
    """Streams without elements (nothing launched) and of one element, through the Triton route."""
    from hf_kvcompress import kernels

    g = torch.Generator().manual_seed(9)
    x = torch.randn(shape, generator=g).bfloat16()
    mean, std = torch.zeros(shape), torch.ones(shape)
    cfg = CodecConfig(coder=coder)
    blobs = codec.encode_batch(x, mean, std, cfg)
    with kernels.forced("triton"):
        assert_bit_exact(codec.decode_batch(blobs, mean, std, cfg), x)
