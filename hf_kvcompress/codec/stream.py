"""The byte format: header, window table, payloads, checksums. Parsing is bounds-checked throughout.

Layout (little-endian; see docs/codec.md for the byte-by-byte table):

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
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .config import MAX_WINDOW, WINDOW_MODES, CodecConfig
from .errors import CorruptStreamError
from .marginal import Marginal
from .symbols import FORMATS_BY_CODE, Format

MAGIC = b"\x89KVCdc\r\n"
LANES_MAGIC = b"\x89KL"  # the lanes layout (lanes.py); here so that dispatch need not import numba
VERSION = 2  # 2: window CRCs bound to their stream and index (plan.window_seed)
_PREFIX = struct.Struct("<8sHHI")
_BODY = struct.Struct("<BBBBBBHQIiIQ32s32s16s16s")
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
    body = _BODY.pack(
        h.fmt.code, len(h.shape), int(h.has_mean), int(h.has_std), WINDOW_MODES.index(h.config.window),
        entries.dtype.itemsize, 0, h.numel, h.n_windows, h.g_spread, h.data_crc,
        int(entries["nbytes"].sum(dtype=np.uint64)) if entries.size else 0,
        h.tables_sha256, h.marginal_sha256, h.mean_fp, h.std_fp,
    )
    body += struct.pack(f"<{len(h.shape)}Q", *h.shape) + struct.pack("<I", len(cfg_json)) + cfg_json
    head = _PREFIX.pack(MAGIC, VERSION, 0, len(body)) + body
    table = entries.tobytes()
    parts = [head, struct.pack("<I", zlib.crc32(head)), table, struct.pack("<I", zlib.crc32(table))]
    parts.extend(payloads)
    return b"".join(parts)


def _corrupt(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"corrupt codec stream: {msg}")


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
    if n < _PREFIX.size:
        raise _corrupt(f"{n} bytes is shorter than the {_PREFIX.size}-byte prefix (truncated or not a stream)")
    magic, version, _reserved, body_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptStreamError("not a hf_kvcompress codec stream (bad magic bytes)")
    if version > VERSION:
        raise CorruptStreamError(
            f"codec stream format version {version} is newer than this library supports ({VERSION}); upgrade"
        )
    if version < 1:
        raise _corrupt(f"invalid format version {version}")
    if body_len < _BODY.size or body_len > _MAX_BODY or _PREFIX.size + body_len + 4 > n:
        raise _corrupt(f"header length {body_len} does not fit the {n}-byte stream (truncated?)")
    head_end = _PREFIX.size + body_len
    (crc,) = struct.unpack_from("<I", buf, head_end)
    if zlib.crc32(buf[:head_end]) != crc:
        raise _corrupt("header checksum mismatch")
    (dtype_code, ndim, has_mean, has_std, mode_i, entry_size, _r, numel, n_windows, g_spread, data_crc,
     payload_len, tables_sha, marg_sha, mean_fp, std_fp) = _BODY.unpack_from(buf, _PREFIX.size)
    pos = _PREFIX.size + _BODY.size
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
