"""The byte layouts of the ``ans`` coder's streams: the full (self-describing) and the compact header, the
window table, payloads and checksums. Parsing is bounds-checked throughout.

Full layout (little-endian; see docs/codec_format.md section 6 for the byte-by-byte table):

    prefix   magic[8] version:u16 reserved:u16 body_len:u32
    body     dtype:u8 ndim:u8 has_mean:u8 has_std:u8 mode:u8 entry_size:u8 reserved:u16
             numel:u64 n_windows:u32 g_spread:i32 data_crc:u32 payload_len:u64
             tables_sha256[32] marginal_sha256[32] mean_fp[16] std_fp[16]
             shape:u64[ndim] config_len:u32 config_json[config_len]
    crc32 of prefix + body : u32
    window table   n_windows entries of entry_size bytes:
             payload_len:u32 crc32(payload + decoded bits):u32 [length-1:u16 (metadata mode)] [sigma_code:u16 (no std)]
    crc32 of the window table : u32
    payloads (each a multiple of 4 bytes: ANS words, then raw low bits)

The compact layout (``CodecConfig(header="compact")``, docs/codec_format.md section 6.1) is described before
`write_compact`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import CorruptStreamError
from ..codec_config import MAX_WINDOW, WINDOW_MODES, CodecConfig
from ..symbols import FORMATS_BY_CODE, Format, varint_bytes
from ..tables import Marginal, get_tables

MAGIC = b"\x89KVCdc\r\n"
VERSION = 2  # 2: window CRCs bound to their stream and index (windows.window_seed)
#: the full layout's prefix (magic, version, reserved, body length) and body (docs/codec_format.md section 6)
FULL_PREFIX = struct.Struct("<8sHHI")
FULL_BODY = struct.Struct("<BBBBBBHQIiIQ32s32s16s16s")
_MAX_BODY = 1 << 20
MAX_NDIM = 32


@dataclass(frozen=True)
class Header:
    fmt: Format
    shape: tuple[int, ...]
    numel: int
    has_mean: bool
    has_std: bool
    config: CodecConfig
    n_windows: int
    g_spread: int
    data_crc: int
    tables_sha256: bytes
    marginal_sha256: bytes
    mean_fp: bytes
    std_fp: bytes
    compact: bool = False  # which layout carried it (decides the fingerprint function)
    version: int = VERSION  # format version it was read from (decides the window CRC seeds)


def entry_dtype(mode: str, has_std: bool) -> np.dtype:
    fields = [("nbytes", "<u4"), ("crc", "<u4")]
    if mode == "metadata":
        fields.append(("len1", "<u2"))
    if not has_std:
        fields.append(("sigma", "<u2"))
    return np.dtype(fields)


def write_stream(h: Header, entries: np.ndarray, payloads: list[bytes]) -> bytes:
    cfg_json = json.dumps(h.config.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    body = FULL_BODY.pack(
        h.fmt.code, len(h.shape), int(h.has_mean), int(h.has_std), WINDOW_MODES.index(h.config.window),
        entries.dtype.itemsize, 0, h.numel, h.n_windows, h.g_spread, h.data_crc,
        int(entries["nbytes"].sum(dtype=np.uint64)) if entries.size else 0,
        h.tables_sha256, h.marginal_sha256, h.mean_fp, h.std_fp,
    )
    body += struct.pack(f"<{len(h.shape)}Q", *h.shape) + struct.pack("<I", len(cfg_json)) + cfg_json
    head = FULL_PREFIX.pack(MAGIC, VERSION, 0, len(body)) + body
    table = entries.tobytes()
    parts = [head, struct.pack("<I", zlib.crc32(head)), table, struct.pack("<I", zlib.crc32(table))]
    parts.extend(payloads)
    return b"".join(parts)


def _corrupt(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"corrupt codec stream: {msg}")


def check_magic_version(magic: bytes, want: bytes, version: int, latest: int, what: str, field: str,
                        corrupt: Callable[[str], CorruptStreamError]) -> None:
    """A layout's magic bytes and version: foreign bytes, a version from the future (upgrade) or an invalid
    one each raise `CorruptStreamError` naming the layout (``what``) and its version ``field``."""
    if magic != want:
        raise CorruptStreamError(f"not a hf_kvcompress {what} (bad magic bytes)")
    if version > latest:
        raise CorruptStreamError(f"{what} {field} {version} is newer than this library supports ({latest}); upgrade")
    if version < 1:
        raise corrupt(f"invalid {field} {version}")


def check_window_count(numel: int, n_windows: int, room: int, entry_size: int) -> None:
    """A stream claims at most MAX_WINDOW elements per window and as many windows as its bytes can list."""
    if (numel == 0) != (n_windows == 0) or n_windows > room // entry_size:
        raise _corrupt(f"{n_windows} windows cannot fit in the stream (truncated?)")
    if numel > n_windows * MAX_WINDOW:
        raise _corrupt(f"{numel} elements cannot fit in {n_windows} windows")


def parse_window_table(buf, table_start: int, n_windows: int, dt: np.dtype, data_start: int, numel: int,
                       config: CodecConfig, has_std: bool) -> tuple[np.ndarray, np.ndarray]:
    """The (checksum-verified) window table -> entries and payload offsets, every field bounds-checked:
    payload sizes are multiples of 4 that fill the rest of the stream exactly."""
    entries = np.frombuffer(buf, dtype=dt, count=n_windows, offset=table_start)
    sizes = entries["nbytes"].astype(np.int64)
    if data_start + int(sizes.sum()) != len(buf):
        raise _corrupt(f"payload sizes do not match the {len(buf) - data_start} bytes present")
    if (sizes % 4).any():
        raise _corrupt("payload sizes must be multiples of 4")
    if config.window == "metadata" and int(entries["len1"].astype(np.int64).sum()) + n_windows != numel:
        raise _corrupt("window lengths do not add up to the element count")
    if not has_std and n_windows and ((entries["sigma"] < 8) | (entries["sigma"] > 2039)).any():
        raise _corrupt("bad window sigma code")
    return entries, data_start + np.concatenate([[0], np.cumsum(sizes)])


def read_stream(blob: bytes | bytearray | memoryview, marginal: Marginal | None):
    """Parse and verify header and window table. Returns (header, entries, payload offsets, blob view)."""
    buf = memoryview(blob).cast("B") if not isinstance(blob, bytes) else memoryview(blob)
    n = len(buf)
    if n < FULL_PREFIX.size:
        raise _corrupt(f"{n} bytes is shorter than the {FULL_PREFIX.size}-byte prefix (truncated or not a stream)")
    magic, version, _reserved, body_len = FULL_PREFIX.unpack_from(buf, 0)
    check_magic_version(magic, MAGIC, version, VERSION, "codec stream", "format version", _corrupt)
    if body_len < FULL_BODY.size or body_len > _MAX_BODY or FULL_PREFIX.size + body_len + 4 > n:
        raise _corrupt(f"header length {body_len} does not fit the {n}-byte stream (truncated?)")
    head_end = FULL_PREFIX.size + body_len
    (crc,) = struct.unpack_from("<I", buf, head_end)
    if zlib.crc32(buf[:head_end]) != crc:
        raise _corrupt("header checksum mismatch")
    (dtype_code, ndim, has_mean, has_std, mode_i, entry_size, _r, numel, n_windows, g_spread, data_crc,
     payload_len, tables_sha, marg_sha, mean_fp, std_fp) = FULL_BODY.unpack_from(buf, FULL_PREFIX.size)
    pos = FULL_PREFIX.size + FULL_BODY.size
    if dtype_code not in FORMATS_BY_CODE:
        raise _corrupt(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM or pos + 8 * ndim + 4 > head_end:
        raise _corrupt(f"bad ndim {ndim}")
    shape = struct.unpack_from(f"<{ndim}Q", buf, pos)
    pos += 8 * ndim
    (cfg_len,) = struct.unpack_from("<I", buf, pos)
    pos += 4
    if pos + cfg_len != head_end:
        raise _corrupt("config length does not match the header length")
    if mode_i >= len(WINDOW_MODES) or has_mean > 1 or has_std > 1:
        raise _corrupt("bad header flags")
    try:
        cfg_dict = json.loads(bytes(buf[pos:head_end]).decode("utf-8"))
        want_marg = cfg_dict.get("marginal_sha256") if isinstance(cfg_dict, dict) else None
        use = marginal if (want_marg is not None and marginal is not None and marginal.sha256 == want_marg) else None
        if want_marg is not None and use is None:
            raise CorruptStreamError(
                f"stream was encoded with marginal p_hat {want_marg[:16]}..., decoder has "
                f"{'none' if marginal is None else marginal.sha256[:16] + '...'}: pass the same marginal"
            )
        config = CodecConfig.from_dict(cfg_dict, marginal=use)
    except CorruptStreamError:
        raise
    except (ValueError, TypeError, UnicodeDecodeError, AttributeError, RecursionError) as err:
        raise _corrupt(f"bad config: {type(err).__name__}: {err}") from None
    if WINDOW_MODES.index(config.window) != mode_i:
        raise _corrupt("window mode in header and config disagree")
    prod = 1
    for d in shape:
        prod *= d
    if prod != numel:
        raise _corrupt(f"shape {shape} does not hold {numel} elements")
    dt = entry_dtype(config.window, bool(has_std))
    if entry_size != dt.itemsize:
        raise _corrupt(f"window entry size {entry_size}, expected {dt.itemsize}")
    table_start = head_end + 4
    check_window_count(numel, n_windows, n - table_start - 4, entry_size)
    table_end = table_start + n_windows * entry_size
    (tcrc,) = struct.unpack_from("<I", buf, table_end)
    if zlib.crc32(buf[table_start:table_end]) != tcrc:
        raise _corrupt("window table checksum mismatch")
    entries, offsets = parse_window_table(buf, table_start, n_windows, dt, table_end + 4, numel, config,
                                          bool(has_std))
    if int(offsets[-1] - offsets[0]) != payload_len:
        raise _corrupt(f"payload length {payload_len} does not match the window table")
    header = Header(
        FORMATS_BY_CODE[dtype_code], tuple(int(d) for d in shape), numel, bool(has_mean), bool(has_std), config,
        n_windows, g_spread, data_crc, tables_sha, marg_sha, mean_fp, std_fp, version=version,
    )
    return header, entries, offsets, buf


# ---------------------------------------------------------------------------------------------------------
# The compact stream layout: a ~50-byte header for streams whose decoder is handed the `CodecConfig`.
#
# The full layout (above) is self-describing: config JSON, two SHA-256 and two 16-byte fingerprints,
# ~450 bytes, i.e. ~0.2 bit/scalar on a 16k-element stream. Callers that store many small streams and know
# their config (the lossless cache) use this one instead; the decoder recomputes an 8-byte digest of
# (tables, marginal, config) from the config it is given and refuses a stream whose digest differs.
#
# Layout (little-endian; varint = unsigned LEB128, at most 9 bytes; zigzag for signed):
#
#     magic "\x89Kc"[3] version:u8
#     flags:u8   bits 0-1 dtype code, 2 has_mean, 3 has_std, 4-5 window mode, 6-7 zero
#     ndim:u8  shape:varint[ndim]  n_windows:varint  g_spread:zigzag varint
#     data_crc:u32  digest[8]  [mean_fp[8] if has_mean]  [std_fp[8] if has_std]
#     window table: n_windows entries, as in the full layout (`entry_dtype`)
#     crc32 of everything above : u32
#     payloads

COMPACT_MAGIC = b"\x89Kc"
COMPACT_VERSION = 2  # 2: window CRCs bound to their stream and index (windows.window_seed)
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
    return bytes(blob[:3]) == COMPACT_MAGIC


def _zigzag(v: int) -> int:
    return 2 * v if v >= 0 else -2 * v - 1


def write_compact(h: Header, entries, payloads: list[bytes]) -> bytes:
    flags = h.fmt.code | h.has_mean << 2 | h.has_std << 3 | WINDOW_MODES.index(h.config.window) << 4
    head = bytearray(COMPACT_MAGIC + bytes([COMPACT_VERSION, flags, len(h.shape)]))
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


def _corrupt_compact(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"corrupt codec stream (compact): {msg}")


class _Reader:
    """Bounds-checked cursor over the header bytes."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, k: int) -> bytes:
        if self.pos + k > len(self.buf):
            raise _corrupt_compact(f"header runs past the end of the {len(self.buf)}-byte stream (truncated?)")
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
        raise _corrupt_compact("varint longer than 9 bytes")


def read_compact(blob, config: CodecConfig | None):
    """Parse and verify a compact stream against the decoder's ``config``. Returns (header, entries,
    payload offsets, blob view) like `read_stream`."""
    buf = memoryview(blob).cast("B") if not isinstance(blob, bytes) else memoryview(blob)
    if config is None:
        raise CorruptStreamError(
            "this is a compact codec stream: it does not carry its CodecConfig; pass the encoder's config to "
            "decode(..., config=...)"
        )
    r = _Reader(buf)
    magic, version, flags, ndim = r.take(3), *r.take(3)
    check_magic_version(magic, COMPACT_MAGIC, version, COMPACT_VERSION, "compact codec stream", "version",
                        _corrupt_compact)
    dtype_code, has_mean, has_std, mode_i = flags & 3, flags >> 2 & 1, flags >> 3 & 1, flags >> 4 & 3
    if flags >> 6 or dtype_code not in FORMATS_BY_CODE:
        raise _corrupt_compact(f"bad flags byte {flags:#04x}")
    if ndim > MAX_NDIM:
        raise _corrupt_compact(f"bad ndim {ndim}")
    shape = tuple(r.varint() for _ in range(ndim))
    n_windows = r.varint()
    gz = r.varint()
    g_spread = gz >> 1 if gz % 2 == 0 else -(gz >> 1) - 1
    if abs(g_spread) >= _MAX_G:
        raise _corrupt_compact("sigma_global code out of range")
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
        raise _corrupt_compact("header checksum mismatch")
    if digest != config_digest(config):
        raise CorruptStreamError(
            "compact codec stream was written with other codec tables, marginal or CodecConfig than the config "
            "passed to decode (digest mismatch); pass the encoder's config"
        )
    if WINDOW_MODES.index(config.window) != mode_i:
        raise _corrupt_compact("window mode in header and config disagree")
    entries, offsets = parse_window_table(buf, table_start, n_windows, dt, table_end + 4, numel, config,
                                          bool(has_std))
    tables = bytes.fromhex(get_tables().sha256)
    marginal = bytes.fromhex(config.marginal_or_default.sha256)
    header = Header(FORMATS_BY_CODE[dtype_code], shape, numel, bool(has_mean), bool(has_std), config, n_windows,
                    g_spread, data_crc, tables, marginal, mean_fp, std_fp, compact=True, version=version)
    return header, entries, offsets, buf
