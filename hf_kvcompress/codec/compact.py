"""The compact stream layout: a ~50-byte header for streams whose decoder is handed the `CodecConfig`.

The full layout (`stream.py`) is self-describing: config JSON, two SHA-256 and two 16-byte fingerprints,
~450 bytes, i.e. ~0.2 bit/scalar on a 16k-element stream. Callers that store many small streams and know
their config (the lossless cache) use this one instead; the decoder recomputes an 8-byte digest of
(tables, marginal, config) from the config it is given and refuses a stream whose digest differs.

Layout (little-endian; varint = unsigned LEB128, at most 9 bytes; zigzag for signed):

    magic "\\x89Kc"[3] version:u8
    flags:u8   bits 0-1 dtype code, 2 has_mean, 3 has_std, 4-5 window mode, 6-7 zero
    ndim:u8  shape:varint[ndim]  n_windows:varint  g_spread:zigzag varint
    data_crc:u32  digest[8]  [mean_fp[8] if has_mean]  [std_fp[8] if has_std]
    window table: n_windows entries, as in the full layout (`stream.entry_dtype`)
    crc32 of everything above : u32
    payloads
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import zlib

from .config import WINDOW_MODES, CodecConfig
from .errors import CorruptStreamError
from .model import get_tables
from .stream import MAX_NDIM, Header, check_window_count, entry_dtype, parse_window_table
from .symbols import FORMATS_BY_CODE

MAGIC = b"\x89Kc"
VERSION = 2  # 2: window CRCs bound to their stream and index (plan.window_seed)
_MAX_VARINT = 9  # bytes: 63 bits
_MAX_G = 1 << 31


@functools.lru_cache(maxsize=64)
def config_digest(cfg: CodecConfig) -> bytes:
    """8-byte BLAKE2b of the tables hash, the marginal hash and the config (everything that shapes the
    bits), so that a decoder handed another config fails loudly instead of decoding garbage."""
    h = hashlib.blake2b(b"hf_kvcompress.codec compact v1\n", digest_size=8)
    h.update(bytes.fromhex(get_tables().sha256))
    h.update(bytes.fromhex(cfg.marginal_or_default.sha256))
    h.update(json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode())
    return h.digest()


def is_compact(blob) -> bool:
    return bytes(blob[:3]) == MAGIC


def varint_bytes(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _zigzag(v: int) -> int:
    return 2 * v if v >= 0 else -2 * v - 1


def write_compact(h: Header, entries, payloads: list[bytes]) -> bytes:
    flags = h.fmt.code | h.has_mean << 2 | h.has_std << 3 | WINDOW_MODES.index(h.config.window) << 4
    head = bytearray(MAGIC + bytes([VERSION, flags, len(h.shape)]))
    for d in h.shape:
        head += varint_bytes(d)
    head += varint_bytes(h.n_windows) + varint_bytes(_zigzag(h.g_spread))
    head += struct.pack("<I", h.data_crc) + config_digest(h.config)
    if h.has_mean:
        head += h.mean_fp
    if h.has_std:
        head += h.std_fp
    head += entries.tobytes()
    return b"".join([bytes(head), struct.pack("<I", zlib.crc32(head)), *payloads])


def _corrupt(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"corrupt codec stream (compact): {msg}")


class _Reader:
    """Bounds-checked cursor over the header bytes."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, k: int) -> bytes:
        if self.pos + k > len(self.buf):
            raise _corrupt(f"header runs past the end of the {len(self.buf)}-byte stream (truncated?)")
        out = bytes(self.buf[self.pos : self.pos + k])
        self.pos += k
        return out

    def varint(self) -> int:
        v = 0
        for i in range(_MAX_VARINT):
            (b,) = self.take(1)
            v |= (b & 0x7F) << (7 * i)
            if b < 0x80:
                return v
        raise _corrupt("varint longer than 9 bytes")


def read_compact(blob, config: CodecConfig | None):
    """Parse and verify a compact stream against the decoder's ``config``. Returns (header, entries,
    payload offsets, blob view) like `stream.read_stream`."""
    buf = memoryview(blob).cast("B") if not isinstance(blob, bytes) else memoryview(blob)
    if config is None:
        raise CorruptStreamError(
            "this is a compact codec stream: it does not carry its CodecConfig; pass the encoder's config to "
            "decode(..., config=...)"
        )
    r = _Reader(buf)
    magic, version, flags, ndim = r.take(3), *r.take(3)
    if magic != MAGIC:
        raise CorruptStreamError("not a hf_kvcompress compact codec stream (bad magic bytes)")
    if version > VERSION:
        raise CorruptStreamError(
            f"compact codec stream version {version} is newer than this library supports ({VERSION}); upgrade"
        )
    if version < 1:
        raise _corrupt(f"invalid version {version}")
    dtype_code, has_mean, has_std, mode_i = flags & 3, flags >> 2 & 1, flags >> 3 & 1, flags >> 4 & 3
    if flags >> 6 or dtype_code not in FORMATS_BY_CODE:
        raise _corrupt(f"bad flags byte {flags:#04x}")
    if ndim > MAX_NDIM:
        raise _corrupt(f"bad ndim {ndim}")
    shape = tuple(r.varint() for _ in range(ndim))
    n_windows = r.varint()
    gz = r.varint()
    g_spread = gz >> 1 if gz % 2 == 0 else -(gz >> 1) - 1
    if abs(g_spread) >= _MAX_G:
        raise _corrupt("sigma_global code out of range")
    (data_crc,) = struct.unpack("<I", r.take(4))
    digest = r.take(8)
    mean_fp = r.take(8) if has_mean else bytes(8)
    std_fp = r.take(8) if has_std else bytes(8)
    numel = 1
    for d in shape:
        numel *= d
    dt = entry_dtype(WINDOW_MODES[mode_i], bool(has_std))
    table_start = r.pos
    check_window_count(numel, n_windows, len(buf) - table_start - 4, dt.itemsize)
    table_end = table_start + n_windows * dt.itemsize
    (crc,) = struct.unpack_from("<I", buf, table_end)
    if zlib.crc32(buf[:table_end]) != crc:
        raise _corrupt("header checksum mismatch")
    if digest != config_digest(config):
        raise CorruptStreamError(
            "compact codec stream was written with other codec tables, marginal or CodecConfig than the config "
            "passed to decode (digest mismatch); pass the encoder's config"
        )
    if WINDOW_MODES.index(config.window) != mode_i:
        raise _corrupt("window mode in header and config disagree")
    entries, offsets = parse_window_table(buf, table_start, n_windows, dt, table_end + 4, numel, config,
                                          bool(has_std))
    tables = bytes.fromhex(get_tables().sha256)
    marginal = bytes.fromhex(config.marginal_or_default.sha256)
    header = Header(FORMATS_BY_CODE[dtype_code], shape, numel, bool(has_mean), bool(has_std), config, n_windows,
                    g_spread, data_crc, tables, marginal, mean_fp, std_fp, compact=True, version=version)
    return header, entries, offsets, buf
