"""The huff format (`CodecConfig(coder="huff")`): every bit pattern round trips under any statistics, batches
equal single streams, ``out=`` views are written in place and nothing else, damage and wrong statistics are
refused with the codec's errors."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from codec_testutil import (
    DTYPES,
    assert_bit_exact,
    assert_damage_is_caught,
    from_patterns,
    pattern_sample,
    realistic,
    special_patterns,
)

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress.codec.huff_coder import huff, kernels
from hf_kvcompress.errors import CorruptStreamError, ParameterMismatchError

HUFF = CodecConfig(coder="huff")


def _stats(kind: str, x: torch.Tensor):
    g = torch.Generator().manual_seed(1)
    cshape = (1,) * (x.dim() - 1) + tuple(x.shape[-1:])
    return {"none": (None, None), "scalar": (-0.25, 1.5), "mean-only": (torch.randn(cshape, generator=g), None),
            "std-only": (None, torch.rand(cshape, generator=g) * 3),
            "row": (torch.randn(*x.shape[:-1], 1, generator=g), torch.rand(*x.shape[:-1], 1, generator=g)),
            "element": (torch.randn(x.shape, generator=g) * 5, torch.rand(x.shape, generator=g) * 1e3)}[kind]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "scalar", "mean-only", "std-only", "row", "element"])
def test_every_pattern_round_trips(dtype, kind):
    """All 2^16 bf16 / fp16 patterns (a wide sample of float32's), NaN payloads, +-inf, -0.0, subnormals."""
    pats = np.concatenate([pattern_sample(dtype), special_patterns(dtype)])
    pats = pats[: pats.size // 64 * 64]
    x = from_patterns(pats, dtype).reshape(-1, 64)
    mean, std = _stats(kind, x)
    blob = codec.encode(x, mean, std, HUFF)
    assert_bit_exact(codec.decode(blob, mean, std, config=HUFF), x)
    assert codec.stream_info(blob, config=HUFF) == (dtype, tuple(x.shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_equals_per_stream_and_threads(dtype):
    x, offset, scale = realistic((1, 7, 64, 40), dtype=dtype)
    x, mean, std = x[0].transpose(1, 2), offset[0].transpose(1, 2), scale[0].transpose(1, 2)  # [7, 40 ch, 64 tok]
    mean, std = mean.expand(7, 40, 1), std.expand(7, 40, 1)
    blobs = codec.encode_batch(x, mean, std, HUFF)
    assert blobs == [codec.encode(x[i], mean[i], std[i], HUFF) for i in range(7)]
    for threads in (1, 2, 3):
        assert_bit_exact(codec.decode_batch(blobs, mean, std, HUFF, threads=threads), x)
    assert_bit_exact(codec.decode_batch(blobs, mean, std, HUFF, verify=[True, False] * 3 + [True]), x)


def test_rate_on_kv_like_data():
    """Per-channel contexts pay off: KV-like bf16 codes in < 11 bits/scalar (raw: 16), headers included."""
    x, offset, scale = realistic((1, 6, 128, 64), seed=2)
    x = x[0].transpose(1, 2).contiguous()
    mean, std = offset[0].transpose(1, 2), scale[0].transpose(1, 2)
    blobs = codec.encode_batch(x, mean, std, HUFF)
    assert 8 * sum(map(len, blobs)) / x.numel() < 11.0


def test_decode_into_strided_out():
    """``out=`` views (the cache's layout, transposed, spread over lead dims): the same bits, nothing else written."""
    x, offset, scale = realistic((1, 6, 24, 16), seed=3)
    x = x[0].transpose(1, 2).contiguous()  # 6 streams of [16 ch, 24 tok], per-channel stats
    mean, std = offset[0].transpose(1, 2), scale[0].transpose(1, 2)
    blobs = codec.encode_batch(x, mean, std, HUFF)
    sentinel = torch.tensor(-7.0, dtype=x.dtype)

    def check(buffer: torch.Tensor, view: torch.Tensor) -> None:
        buffer.fill_(sentinel)
        assert codec.decode_batch(blobs, mean, std, HUFF, out=view) is view
        assert_bit_exact(view.reshape(x.shape), x)
        mask = torch.ones(buffer.shape, dtype=torch.bool)
        mask.as_strided(view.shape, view.stride(), view.storage_offset() - buffer.storage_offset()).fill_(False)
        assert (buffer.view(torch.int16)[mask] == sentinel.view(torch.int16)).all()

    buf = torch.empty(6, 24, 16, dtype=x.dtype)
    check(buf, buf.transpose(1, 2))  # channel-major streams over a token-major buffer
    buf = torch.empty(2, 1, 3, 40, 16, dtype=x.dtype)  # [k/v, rows, heads, tokens, dim] as a cache holds it
    check(buf, buf[:, :, :, :24].permute(0, 2, 1, 4, 3))
    buf = torch.empty(2, 4, 16, 50, dtype=x.dtype)
    check(buf, buf[:, 1:, :, 1:49:2])


def test_wrong_statistics_and_arguments_refused():
    x, offset, scale = realistic((1, 4, 32, 16))
    x, mean, std = x[0], offset[0], scale[0]
    blobs = codec.encode_batch(x, mean, std, HUFF)
    with pytest.raises(ParameterMismatchError):
        codec.decode_batch(blobs, -mean, std, HUFF)
    with pytest.raises(ParameterMismatchError):
        codec.decode_batch(blobs, mean, std * 8, HUFF)
    with pytest.raises(CorruptStreamError, match="with a std"):
        codec.decode_batch(blobs, mean, None, HUFF)
    assert_bit_exact(codec.decode_batch(blobs, mean.expand(4, 32, 16), std.expand(4, 32, 16), HUFF), x)
    with pytest.raises(ValueError, match="one shape"):
        codec.decode_batch([blobs[0], codec.encode(x[0, :5], mean[0], std[0], HUFF)], mean[:2], std[:2], HUFF)
    with pytest.raises(ValueError, match="threads"):
        codec.decode_batch(blobs, mean, std, HUFF, threads=0)
    with pytest.raises(ValueError, match="window must be 'fixed'"):
        CodecConfig(coder="huff", window="metadata")


def _reseal(blob: bytes) -> bytes:
    return blob[:-4] + struct.pack("<I", zlib.crc32(blob[:-4]))


@pytest.mark.parametrize("per", ["channel", "element"])
def test_damage_is_a_corrupt_stream_error(per):
    """Every flipped byte, every cut and extension: CorruptStreamError with the check, and with the crc32 resealed
    (verify=False too) either a CorruptStreamError or, for a mantissa bit, other values (never a crash); with
    per-channel and per-element statistics (each its own decode loop)."""
    x, offset, scale = realistic((1, 2, 16, 63), seed=5)  # an odd count of elements: the per-element loop's tail
    x, mean, std = x[0].transpose(1, 2).contiguous(), offset[0].transpose(1, 2), scale[0].transpose(1, 2)
    if per == "element":
        mean, std = x.float() + 0.01 * torch.randn(x.shape), std.expand(x.shape)
    assert_damage_is_caught(x, mean, std, HUFF)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_element_contexts_equal_the_definition(dtype):
    """The compiled per-element contexts (`kernels.element_contexts`) are ``ms << EW | ref`` of the module
    docstring for statistics broadcast any way (a shared mean, a per-channel std, -0.0, zero, tiny and huge
    values), and such streams decode in a batch with per-element means that differ per stream."""
    g = torch.Generator().manual_seed(3)
    shape = (5, 6, 33)
    fmt = huff.format_of(dtype)
    mean = torch.randn(shape, generator=g) * torch.logspace(-30, 30, 33)
    mean[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-40, -1e-40])
    for m, s in ((mean, None), (None, mean.abs()), (mean, torch.rand(5, 6, 1, generator=g)),
                 (mean[:1], torch.rand(shape, generator=g) * 7), (torch.full((1, 1, 33), -0.0), torch.zeros(1))):
        m32, s32 = (None if t is None else t.numpy().reshape((1,) * (3 - t.dim()) + tuple(t.shape)) for t in (m, s))
        cx = huff.contexts(m32, s32, fmt, shape[1:], 5)
        mm = np.zeros(shape, np.float32) if m32 is None else np.broadcast_to(m32, shape)
        ss = np.zeros(shape, np.float32) if s32 is None else np.broadcast_to(s32, shape)
        ref = (np.maximum(np.abs(mm), ss).view(np.uint32) >> 23) & 0xFF
        if dtype == torch.float16:
            ref = np.clip(ref.astype(np.int64) - 112, 0, 31)
        ew = huff.FIELDS[fmt.code][0]
        want = ((mm.view(np.uint32) >> 31) << ew) | ref
        assert (cx.run, cx.rows) == (1, 6 * 33)
        assert np.array_equal(cx.ctx[cx.crow].reshape(shape), want)
    x = (mean + torch.randn(shape, generator=g)).to(dtype)
    blobs = codec.encode_batch(x, mean, mean.abs() * 0.1, HUFF)
    assert_bit_exact(codec.decode_batch(blobs, mean, mean.abs() * 0.1, HUFF), x)


def test_batched_fingerprints_equal_one_stream_at_a_time():
    """`kernels.fingerprints` (four rows of contexts in lock step, branch-free) gives each stream
    `context_fingerprint`'s value: groups of four and their ragged ends, runs, empty and one-row streams."""
    rng = np.random.default_rng(0)
    for n, rows, run in ((1, 5, 3), (5, 64, 128), (9, 300, 1), (7, 0, 1), (3, 100, 0)):
        ctx = rng.integers(0, 3, (n, rows)).astype(np.uint32) * np.uint32(rng.integers(1, 512))
        crow = rng.integers(0, n, 11).astype(np.int64)
        out = np.empty(11, np.uint32)
        kernels.fingerprints(ctx, crow, rows, run, out)
        assert out.tolist() == [int(kernels.context_fingerprint(ctx[r], rows, run)) & 0xFFFFFFFF for r in crow]


def test_errors_land_on_their_stream():
    x, offset, scale = realistic((1, 6, 16, 64), seed=6)
    x, mean, std = x[0].transpose(1, 2).contiguous(), offset[0].transpose(1, 2), scale[0].transpose(1, 2)
    blobs = codec.encode_batch(x, mean, std, HUFF)
    head = len(huff.parse_prefix(blobs[5]).prefix) + 4
    bad = bytearray(blobs[5])
    bad[head] = 200  # an absurd segment count
    blobs[5] = _reseal(bytes(bad))
    with pytest.raises(CorruptStreamError, match="stream 5"):
        codec.decode_batch(blobs, mean, std, HUFF, verify=False)


def test_code_lengths_are_limited_and_complete():
    counts = np.array([2 ** k for k in range(20)] + [0, 1, 1], dtype=np.int64)
    lengths = kernels.code_lengths(counts, kernels.MAX_LEN)
    used = lengths[counts > 0]
    assert used.max() <= kernels.MAX_LEN and (lengths[counts == 0] == 0).all()
    assert sum(2.0 ** -used) == 1.0
    assert kernels.canonical_codes(lengths, kernels.MAX_LEN)[1] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_incompressible_streams_are_stored(dtype):
    """Random bit patterns (and tiny float32 streams): stored as they are, never more than ~16 bytes over raw."""
    g = torch.Generator().manual_seed(7)
    width = 4 if dtype == torch.float32 else 2
    raw = torch.randint(0, 256, (3, 40 * width), generator=g, dtype=torch.uint8)
    x = raw.view(torch.int32 if width == 4 else torch.int16).view(dtype)
    blobs = codec.encode_batch(x, None, 2.0, HUFF)
    assert max(map(len, blobs)) <= x[0].numel() * width + 20
    assert_bit_exact(codec.decode_batch(blobs, None, 2.0, HUFF), x)
    # a batch mixing stored and coded streams of one shape
    smooth = (torch.randn(5, 40 * width // width, generator=g) * 0.01 + 1.0).to(dtype)
    both = torch.cat([x, smooth])
    assert_bit_exact(codec.decode_batch(codec.encode_batch(both, None, 2.0, HUFF), None, 2.0, HUFF, threads=2), both)
