"""Helpers shared by the codec tests: bit-level comparison, special values, small realistic tensors."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch
from hypothesis import strategies as st

from hf_kvcompress.codec.ans_coder.layout import (
    COMPACT_MAGIC,
    FULL_BODY,
    FULL_PREFIX,
    write_compact,
    write_stream,
)
from hf_kvcompress.codec.ans_coder.streams import Decoder
from hf_kvcompress.codec.ans_coder.windows import window_crc
from hf_kvcompress.codec.lanes_coder.lanes import MAGIC as LANES_MAGIC
from hf_kvcompress.codec.lanes_coder.lanes import parse_header
from hf_kvcompress.codec.symbols import tensor_bits
from hf_kvcompress.errors import CorruptStreamError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (a.shape, b.shape)
    assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), "decoded bits differ"


def from_patterns(patterns: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return torch.from_numpy(patterns.astype(np.uint32).view(np.int32).copy()).view(torch.float32)
    return torch.from_numpy(patterns.astype(np.uint16).view(np.int16).copy()).view(dtype)


def special_patterns(dtype: torch.dtype) -> np.ndarray:
    """NaNs of both signs with several payloads, +-inf, +-0, subnormals, max / min finite."""
    if dtype == torch.float32:
        e, m, s = 0x7F800000, 0x007FFFFF, 0x80000000
    elif dtype == torch.bfloat16:
        e, m, s = 0x7F80, 0x007F, 0x8000
    else:
        e, m, s = 0x7C00, 0x03FF, 0x8000
    vals = [0, s, e, e | s, e | 1, e | m, e | (m >> 1) + 1, s | e | 1, s | e | m, 1, m, s | 1, s | m,
            e - 1, s | (e - 1), (e >> 1) & e]
    return np.array(vals, dtype=np.int64)


def realistic(shape=(1, 3, 96, 64), seed: int = 0, dtype=torch.bfloat16):
    """KV-like data: per-channel offsets and scales, a few outlier channels, plus per-channel stats."""
    g = torch.Generator().manual_seed(seed)
    _b, h, _t, d = shape
    scale = torch.rand(1, h, 1, d, generator=g) * 2 + 0.05
    scale[..., :3] *= 20
    offset = torch.randn(1, h, 1, d, generator=g) * 2
    x = (torch.randn(shape, generator=g) * scale + offset).to(dtype)
    return x, offset, scale


def reseal(blob: bytes) -> bytes:
    """Recompute every CRC of a (possibly mutated) stream so that the decoder's deeper checks are exercised.
    Returns the blob unchanged when its layout cannot be followed."""
    if blob[:3] == COMPACT_MAGIC:
        return _reseal_compact(blob)
    if blob[:3] == LANES_MAGIC:
        return _reseal_lanes(blob)
    try:
        b = bytearray(blob)
        _magic, _v, _r, body_len = FULL_PREFIX.unpack_from(b, 0)
        head_end = FULL_PREFIX.size + body_len
        fields = FULL_BODY.unpack_from(b, FULL_PREFIX.size)
        entry_size, n_windows = fields[5], fields[8]
        struct.pack_into("<I", b, head_end, zlib.crc32(b[:head_end]))
        t0 = head_end + 4
        t1 = t0 + entry_size * n_windows
        _reseal_windows(b, t0, entry_size, n_windows, t1 + 4)
        struct.pack_into("<I", b, t1, zlib.crc32(b[t0:t1]))
        return bytes(b)
    except (struct.error, IndexError, ValueError, OverflowError):
        return blob


def _reseal_windows(b: bytearray, table: int, entry: int, n_windows: int, data: int) -> None:
    """Set each window entry's CRC (entries of ``entry`` bytes at ``table``) to the CRC of its payload
    (payloads from ``data`` on)."""
    for w in range(n_windows):
        size = struct.unpack_from("<I", b, table + w * entry)[0]
        struct.pack_into("<I", b, table + w * entry + 4, zlib.crc32(b[data : data + size]))
        data += size


def _reseal_compact(blob: bytes) -> bytes:
    """`reseal` for the compact layout: walk its varints, then fix the window CRCs and the header CRC."""
    try:
        b = bytearray(blob)
        flags, ndim = b[4], b[5]
        pos = 6

        def varint() -> int:
            nonlocal pos
            v, shift = 0, 0
            while True:
                byte = b[pos]
                pos += 1
                v |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80 or shift > 63:
                    return v

        for _ in range(ndim):
            varint()
        n_windows = varint()
        varint()
        pos += 4 + 8 + 8 * ((flags >> 2) & 1) + 8 * ((flags >> 3) & 1)
        mode = (flags >> 4) & 3
        entry = 8 + (2 if mode == 1 else 0) + (0 if (flags >> 3) & 1 else 2)
        table_end = pos + entry * n_windows
        _reseal_windows(b, pos, entry, n_windows, table_end + 4)
        struct.pack_into("<I", b, table_end, zlib.crc32(b[:table_end]))
        return bytes(b)
    except (struct.error, IndexError, ValueError, OverflowError):
        return blob


def _reseal_lanes(blob: bytes) -> bytes:
    """A lanes stream: the header CRC (the payload's check covers the decoded values: nothing to reseal)."""
    b = bytearray(blob)
    try:
        h = parse_header(blob, verify=False)
    except CorruptStreamError:
        return blob
    at = h.data_start - 4
    struct.pack_into("<I", b, at, zlib.crc32(b[:at]))
    return bytes(b)


def pattern_sample(dtype: torch.dtype) -> np.ndarray:
    """Every 16-bit pattern (bf16, fp16), or 2^16 random float32 patterns plus the special ones."""
    if dtype == torch.float32:
        rng = np.random.default_rng(1)
        return np.concatenate([rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.int64),
                               special_patterns(dtype)])
    return np.arange(1 << 16)


_FINITE32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
# (mean, free std, |mean| / std ratio) triples for `params_inputs`
PARAM_TRIPLES = st.lists(st.tuples(_FINITE32, _FINITE32, st.floats(0.0, 20.0, width=32)), min_size=1, max_size=64)


def params_inputs(triples) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) float32 from hypothesis triples (mean, free std, ratio): half the stds near
    |mean| / ratio, the W / N boundary of the per-element model."""
    mean = np.array([t[0] for t in triples], dtype=np.float32)
    free = np.abs(np.array([t[1] for t in triples], dtype=np.float32))
    ratio = np.array([t[2] for t in triples], dtype=np.float32)
    with np.errstate(all="ignore"):
        tied = np.where(ratio > 0, np.abs(mean) / ratio, free).astype(np.float32)
    std = np.where(np.arange(mean.size) % 2 == 0, free, tied)
    return mean, np.where(np.isfinite(std), std, 1.0).astype(np.float32)


def params_bulk(n: int = 200_000, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) float32 over the whole finite range, half the stds tied to the mean."""
    rng = np.random.default_rng(seed)
    with np.errstate(all="ignore"):  # overflows become inf, replaced below
        mean = (rng.standard_normal(n) * 10.0 ** rng.uniform(-44, 38, n)).astype(np.float32)
        std = np.abs(rng.standard_normal(n) * 10.0 ** rng.uniform(-44, 38, n)).astype(np.float32)
        tied = (np.abs(mean) / rng.uniform(0.01, 20, n)).astype(np.float32)
    std = np.where(rng.random(n) < 0.5, std, tied)
    mean = np.where(np.isfinite(mean), mean, 0).astype(np.float32)
    return mean, np.where(np.isfinite(std), std, 1).astype(np.float32)


def rebuild(blob: bytes, mean, std, config, *, entries=None, payloads=None, version: int | None = None) -> bytes:
    """Re-serialise a parsed stream with other window-table entries, payloads or format version, every
    framing CRC (header, table) recomputed and the window CRCs taken as given: what a splice looks like."""
    d = Decoder(blob, mean, std, None, config)
    table = d.entries.copy() if entries is None else entries
    pieces = payloads if payloads is not None else window_payloads(d)
    out = bytearray((write_compact if d.h.compact else write_stream)(d.h, table, pieces))
    if version is not None:
        if d.h.compact:
            out[3] = version
            end = len(out) - sum(len(p) for p in pieces) - 4
            struct.pack_into("<I", out, end, zlib.crc32(out[:end]))
        else:
            struct.pack_into("<H", out, 8, version)
            head_end = FULL_PREFIX.size + struct.unpack_from("<I", out, 12)[0]
            struct.pack_into("<I", out, head_end, zlib.crc32(out[:head_end]))
    return bytes(out)


def window_payloads(d) -> list[bytes]:
    """The payload bytes of each window of a parsed stream (`Decoder`)."""
    return [bytes(d.buf[int(a) : int(b)]) for a, b in zip(d.offsets[:-1], d.offsets[1:])]


def as_version1(blob: bytes, x: torch.Tensor, mean, std, config) -> bytes:
    """``blob`` (a current stream of ``x``) written as format version 1: window CRCs started at 0."""
    d = Decoder(blob, mean, std, None, config)
    bits = tensor_bits(x)
    table = d.entries.copy()
    starts = np.concatenate([[0], np.cumsum(d.lengths)])
    for w, payload in enumerate(window_payloads(d)):
        table["crc"][w] = window_crc(payload, bits[starts[w] : starts[w + 1]], d.fmt, 0)
    return rebuild(blob, mean, std, config, entries=table, version=1)


def assert_damage_is_caught(x: torch.Tensor, mean, std, config) -> None:
    """The huff family's damage check, on the first of two streams of ``x``: every cut and extension and every
    flipped byte is a CorruptStreamError with the check; with the crc32 resealed (verify=False too) a
    CorruptStreamError or other values (a mantissa bit), never a crash, and the good stream beside it intact."""
    import pytest

    from hf_kvcompress import codec

    [blob, other] = codec.encode_batch(x, mean, std, config)
    for cut in (0, 3, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptStreamError):
            codec.decode_batch([blob[:cut], other], mean, std, config)
    with pytest.raises(CorruptStreamError):
        codec.decode_batch([blob + b"\0", other], mean, std, config)
    rng = np.random.default_rng(0)
    for at in range(len(blob)):
        bad = bytearray(blob)
        bad[at] ^= int(rng.integers(1, 256))
        with pytest.raises(CorruptStreamError):
            codec.decode_batch([bytes(bad), other], mean, std, config)
        resealed = bytes(bad[:-4]) + struct.pack("<I", zlib.crc32(bytes(bad[:-4])))
        for verify in (True, False):
            try:
                y = codec.decode_batch([resealed, other], mean, std, config, verify=verify)
            except (CorruptStreamError, ValueError):
                continue
            assert_bit_exact(y[1], x[1])  # the good stream beside it decodes whatever the damage

