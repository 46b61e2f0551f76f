"""The mhuff format (`CodecConfig(coder="mhuff")`): every bit pattern round trips under any statistics, batches
equal single streams whatever the thread count, damage and wrong statistics are refused with the codec's errors,
contexts are the documented integer function of the statistics' bits, and the top mantissa bits are modelled
(a predicted stream codes smaller than with huff)."""

from __future__ import annotations

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
from hf_kvcompress.codec.huff_coder import huff, kernels, mhuff
from hf_kvcompress.errors import CorruptStreamError, ParameterMismatchError

MHUFF = CodecConfig(coder="mhuff")
HUFF = CodecConfig(coder="huff")


def _predicted(shape, dtype=torch.bfloat16, seed: int = 0):
    """Per-element statistics as a calibrated predictor gives them: x near its mean, spreads varying per element."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(shape, generator=g) * 2
    std = torch.rand(shape, generator=g) * 0.3 + 0.01
    return (mean + std * torch.randn(shape, generator=g)).to(dtype), mean, std


def _stats(kind: str, x: torch.Tensor):
    g = torch.Generator().manual_seed(1)
    cshape = (1,) * (x.dim() - 1) + tuple(x.shape[-1:])
    return {"none": (None, None), "scalar": (-0.25, 1.5), "mean-only": (torch.randn(cshape, generator=g), None),
            "std-only": (None, torch.rand(cshape, generator=g) * 3),
            "row": (torch.randn(*x.shape[:-1], 1, generator=g), torch.rand(*x.shape[:-1], 1, generator=g)),
            "element": (torch.randn(x.shape, generator=g) * 5, torch.rand(x.shape, generator=g) * 1e3),
            "tiny": (torch.randn(x.shape, generator=g) * 1e-41, torch.rand(x.shape, generator=g) * 1e-39)}[kind]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "scalar", "mean-only", "std-only", "row", "element", "tiny"])
def test_every_pattern_round_trips(dtype, kind):
    """All 2^16 bf16 / fp16 patterns (a wide sample of float32's), NaN payloads, +-inf, -0.0, subnormals."""
    pats = np.concatenate([pattern_sample(dtype), special_patterns(dtype)])
    pats = pats[: pats.size // 64 * 64]
    x = from_patterns(pats, dtype).reshape(-1, 64)
    mean, std = _stats(kind, x)
    blob = codec.encode(x, mean, std, MHUFF)
    assert blob[:3] == mhuff.MAGIC
    assert_bit_exact(codec.decode(blob, mean, std, config=MHUFF), x)
    assert codec.stream_info(blob, config=MHUFF) == (dtype, tuple(x.shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_one_element_streams(dtype):
    for shape in ((3, 0), (2, 0, 5), (1, 1), (4, 1, 1)):
        x, mean, std = _predicted(shape, dtype)
        blobs = codec.encode_batch(x, mean, std, MHUFF)
        assert_bit_exact(codec.decode_batch(blobs, mean, std, MHUFF), x)
        assert [codec.stream_info(b, config=MHUFF) for b in blobs] == [(dtype, shape[1:])] * shape[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_equals_per_stream_whatever_the_threads(dtype):
    """A batch's streams are the single streams' bytes; encoding and decoding threads change no bit; a batch mixing
    stored (incompressible) and coded streams decodes."""
    x, mean, std = _predicted((7, 24, 40), dtype, seed=2)
    blobs = codec.encode_batch(x, mean, std, MHUFF)
    assert blobs == [codec.encode(x[i], mean[i], std[i], MHUFF) for i in range(7)]
    assert codec.encode_batch(x, mean, std, MHUFF, threads=3) == blobs
    for threads in (1, 2, 3):
        assert_bit_exact(codec.decode_batch(blobs, mean, std, MHUFF, threads=threads), x)
    assert_bit_exact(codec.decode_batch(blobs, mean, std, MHUFF, verify=[True, False] * 3 + [True]), x)
    g = torch.Generator().manual_seed(7)
    width = 4 if dtype == torch.float32 else 2
    noise = torch.randint(0, 256, (3, 24 * 40 * width), generator=g, dtype=torch.uint8)
    noise = noise.view(torch.int32 if width == 4 else torch.int16).view(dtype).reshape(3, 24, 40)
    both = torch.cat([noise, x])
    blobs = codec.encode_batch(both, mean[:1], std[:1], MHUFF)
    assert max(map(len, blobs[:3])) <= noise[0].numel() * width + 30  # stored: raw plus the header
    assert_bit_exact(codec.decode_batch(blobs, mean[:1], std[:1], MHUFF, threads=2), both)


def test_decode_into_strided_out():
    x, mean, std = _predicted((6, 16, 24), seed=3)
    blobs = codec.encode_batch(x, mean, std, MHUFF)
    buf = torch.full((6, 24, 16), -7.0, dtype=x.dtype)
    view = buf.transpose(1, 2)
    assert codec.decode_batch(blobs, mean, std, MHUFF, out=view) is view
    assert_bit_exact(buf.transpose(1, 2), x)


def test_mantissa_bits_are_modelled():
    """On a predicted stream (x within a few percent of its per-element mean) the top mantissa bits are nearly
    known: mhuff must code well under huff's size (which stores them raw)."""
    x, mean, std = _predicted((12, 64, 128), seed=4)
    rate = {name: 8 * sum(map(len, codec.encode_batch(x, mean, std, cfg))) / x.numel()
            for name, cfg in (("huff", HUFF), ("mhuff", MHUFF))}
    assert rate["mhuff"] < rate["huff"] - 1.0, rate


@pytest.mark.parametrize("dtype", DTYPES)
def test_contexts_equal_the_definition(dtype):
    """`kernels.mhuff_contexts` is ``cls << (W + 1) | ms << W | ref`` of codec_format.md 14, computed here with
    numpy integer operations, for statistics broadcast any way (-0.0, zero, subnormal, tiny and huge values)."""
    g = torch.Generator().manual_seed(3)
    shape = (5, 6, 33)
    fmt = huff.format_of(dtype)
    ew, k = huff.FIELDS[fmt.code][0], mhuff.K_BITS
    w = ew + k
    mean = torch.randn(shape, generator=g) * torch.logspace(-40, 30, 33)
    mean[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-40, -1e-40])
    for m, s in ((mean, None), (None, mean.abs()), (mean, torch.rand(5, 6, 1, generator=g)),
                 (mean[:1], torch.rand(shape, generator=g) * 7), (torch.full((1, 1, 33), -0.0), torch.zeros(1))):
        m32, s32 = (None if t is None else t.numpy().reshape((1,) * (3 - t.dim()) + tuple(t.shape)) for t in (m, s))
        cx = mhuff.SPEC.contexts(m32, s32, fmt, shape[1:], 5)
        mb = np.zeros(shape, np.int64) if m32 is None else np.broadcast_to(m32, shape).view(np.uint32).astype(np.int64)
        sb = np.zeros(shape, np.int64) if s32 is None else np.broadcast_to(s32, shape).view(np.uint32).astype(np.int64)
        a = np.maximum(mb & 0x7FFFFFFF, sb & 0x7FFFFFFF)
        ref = a >> (23 - k)
        if dtype == torch.float16:
            ref = np.clip(ref - (112 << k), 0, (1 << w) - 1)
        cls = np.minimum((a >> 23) - ((sb & 0x7FFFFFFF) >> 23), 3)
        want = (cls << (w + 1)) | ((mb >> 31) << w) | ref
        assert (cx.run, cx.rows) == (1, 6 * 33)
        assert np.array_equal(cx.ctx[cx.crow].reshape(shape), want)


def test_wrong_statistics_and_other_streams_refused():
    x, mean, std = _predicted((4, 32, 16), seed=5)
    blobs = codec.encode_batch(x, mean, std, MHUFF)
    with pytest.raises(ParameterMismatchError):
        codec.decode_batch(blobs, -mean, std, MHUFF)
    with pytest.raises(ParameterMismatchError):
        codec.decode_batch(blobs, mean * 1.3, std, MHUFF)  # the top mantissa bits of the reference move
    with pytest.raises(ParameterMismatchError):
        codec.decode_batch(blobs, mean, std * 8, MHUFF)
    with pytest.raises(CorruptStreamError, match="with a std"):
        codec.decode_batch(blobs, mean, None, MHUFF)
    with pytest.raises(CorruptStreamError, match="is a 'huff' stream"):
        codec.decode_batch(codec.encode_batch(x, mean, std, HUFF), mean, std, MHUFF)
    with pytest.raises(CorruptStreamError, match="is a 'mhuff' stream"):
        codec.decode_batch(blobs, mean, std, HUFF)
    with pytest.raises(ValueError, match="window must be 'fixed'"):
        CodecConfig(coder="mhuff", window="metadata")


def test_damage_is_a_corrupt_stream_error():
    """Every flipped byte, every cut and extension: CorruptStreamError with the check; with the crc32 resealed
    (verify=False too) a CorruptStreamError or other values, never a crash, and the good stream beside it intact."""
    x, _, scale = realistic((1, 2, 16, 63), seed=5)
    x = x[0].transpose(1, 2).contiguous()
    mean, std = x.float() + 0.01 * torch.randn(x.shape), scale[0].transpose(1, 2).expand(x.shape)
    assert_damage_is_caught(x, mean, std, MHUFF)


# ------------------------------------------------------------------------- stream versions (issue 48's rate)


def test_version_1_streams_decode_alone_and_mixed_with_version_2():
    """Version 1 streams (k = 2, tables as nibbles: what files and chunks hold from before) decode bit for bit,
    alone and in one batch with version 2 streams (a store written before and after), into ``out`` too; a mixed
    batch has no decode-ahead job (`decode_batch` splits it)."""
    pats = np.concatenate([pattern_sample(torch.bfloat16), special_patterns(torch.bfloat16)])
    x = from_patterns(pats[: 6 * 64 * 16], torch.bfloat16).view(6, 64, 16)
    g = torch.Generator().manual_seed(7)
    mean, std = torch.randn(x.shape, generator=g) * 3, torch.rand(x.shape, generator=g) + 0.01
    old = huff.encode_family(x, mean, std, mhuff.SPEC_V1)
    new = codec.encode_batch(x, mean, std, MHUFF)
    assert all(b[:3] == mhuff.MAGIC_V1 for b in old) and all(b[:3] == mhuff.MAGIC for b in new)
    assert_bit_exact(codec.decode_batch(old, mean, std, MHUFF), x)
    mixed = [old[i] if i % 2 else new[i] for i in range(6)]
    assert_bit_exact(codec.decode_batch(mixed, mean, std, MHUFF), x)
    out = torch.full_like(x, -1.0)
    codec.decode_batch(mixed, mean, std, MHUFF, out=out, threads=2, verify=[True, False] * 3)
    assert_bit_exact(out, x)
    coder = mhuff.MHuffCoder()
    assert coder.start_decode_batch(mixed, mean, std, MHUFF) is None
    assert coder.start_decode_batch(old, mean, std, MHUFF) is not None
    assert coder.stream_infos(mixed, MHUFF) == [(torch.bfloat16, (64, 16))] * 6
    damaged = bytearray(old[3])
    damaged[12] ^= 0x10
    with pytest.raises(CorruptStreamError, match="crc32"):
        codec.decode_batch([*new[:3], bytes(damaged), *new[4:]], mean, std, MHUFF)


def test_version_2_tables_cost_less_than_nibbles():
    """Version 2's tables (pairs of lengths in static prefix codes) on predicted streams: under 0.65x the bytes of
    the same lengths as nibbles, and the streams smaller than version 1's (k = 2, nibbles) and than k = 3 with
    nibbles, whose tables would eat what k = 3 saves."""
    x, mean, std = _predicted((8, 64, 128), seed=9)
    size = {name: sum(map(len, huff.encode_family(x, mean, std, spec)))
            for name, spec in (("v2", mhuff.SPEC), ("v1", mhuff.SPEC_V1), ("k3 nibbles", mhuff.spec(3, version=1)))}
    assert size["v2"] < size["k3 nibbles"] - 8 * 60 and size["v2"] < size["v1"], size
    fmt = huff.format_of(x.dtype)
    cx = mhuff.SPEC.contexts(mean.numpy(), std.numpy(), fmt, tuple(x.shape[1:]), x.shape[0])
    lay = mhuff.SPEC.layouts[fmt.code]
    paired = nibbles = 0
    for s, bits in enumerate(huff._bits(x)):
        tables = mhuff.SPEC.encode_stream(bits, cx.ctx[cx.crow[s]], cx.rows, cx.run, lay)[2]
        paired += sum(len(huff.length_pairs(t)) for t in tables)
        nibbles += sum(len(huff.length_segments(t)) for t in tables)
    assert paired < 0.65 * nibbles, (paired, nibbles)


def _read_pairs(blob: bytes, alphabet: int):
    b8 = np.zeros(len(blob) + 64, np.uint8)
    b8[: len(blob)] = np.frombuffer(blob, np.uint8)
    used = np.empty((2, alphabet), np.int64)
    at, n = kernels.read_length_pairs(b8, 0, len(blob), alphabet, used)
    lengths = np.zeros(alphabet, np.int64)
    lengths[used[0, :n]] = used[1, :n]
    return at, lengths


def test_length_pairs_round_trip_and_refuse_a_cut_table():
    """`kernels.length_pairs` / `read_length_pairs`: any lengths 0..10 (every pair of them, runs of unused pairs
    longer and shorter than `PAIR_GAP`, the alphabet's edges) come back as written, ending at the table's last
    byte; a table cut short is refused (-1), never read past its end."""
    g = np.random.default_rng(3)
    pairs = np.array([(e, o) for e in range(11) for o in range(11)]).reshape(-1)
    cases = [np.zeros(2048, np.uint8), np.r_[pairs, np.zeros(2048 - pairs.size)].astype(np.uint8)]
    for density in (0.02, 0.2, 0.9):
        cases.append((g.integers(0, 11, 4096) * (g.random(4096) < density)).astype(np.uint8))
    edges = np.zeros(512, np.uint8)
    edges[[0, 511]] = (3, 10)
    cases.append(edges)
    for lengths in cases:
        blob = huff.length_pairs(lengths)
        at, back = _read_pairs(blob, lengths.size)
        assert at == len(blob) and np.array_equal(back, lengths)
        for cut in range(1, len(blob)):
            assert _read_pairs(blob[:cut], lengths.size)[0] in (-1, cut) and \
                (_read_pairs(blob[:cut], lengths.size)[0] == -1 or not lengths.any())
