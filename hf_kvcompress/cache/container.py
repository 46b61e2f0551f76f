"""The framed file that `.kvc` cache files (`persist`) and prefix-store chunks (`store`) both are, and the block
table inside it: the one place that writes and checks their bytes.

A framed file is ``magic`` (8 bytes), the format version (u32, little endian), the header length (u32), a UTF-8
JSON header, the payload (every stream and tensor, at the offsets the header lists, in order, without gaps), then a
SHA-256 (or, keyed, an HMAC-SHA256) of everything before it (`frame`, `unframe`). Reads take regular files only,
bounded (`read_regular`; `read_framed`: the header first, the payload only when the sizes it declares add up). The header's values are checked with the typed helpers (`check_object`, `check_int`, ...)
and its coded blocks (rows of streams, scales, side tensors and listed elements) against the payload
(`check_blocks`) and against what the codec and the predictor say such a block holds (`check_block`) before anything
is allocated or decoded. Every failure is a `CacheFileError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import validation
from ..blockcodec import BlockCodec, CodedBlock, CodedRow
from ..blockcoder import SCALE_MAX, SCALE_MIN, expected_side, listed_problem
from ..codec import CodecConfig, CorruptStreamError, stream_info, stream_infos
from ..codec.codec_config import MAX_WINDOW
from ..config import CompressionConfig
from ..errors import CacheFileError
from ..predictors.base import Predictor

PREFIX = struct.Struct("<8sII")  # magic, version, header length
DIGEST_BYTES = 32  # the trailing SHA-256 / HMAC-SHA256
MAX_HEADER = 1 << 30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32,
          "float64": torch.float64, "int64": torch.int64}
MIN_STREAM_ENTRY = 8  # bytes per window-table entry: a stream of n bytes holds at most n / 8 windows


# ---------------------------------------------------------------------- framing


def digest(parts: list[bytes | bytearray | memoryview], key: bytes | None = None) -> bytes:
    """The trailing digest over ``parts`` (in order): SHA-256, or HMAC-SHA256 keyed by ``key``."""
    h = hashlib.sha256() if key is None else hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def frame(magic: bytes, version: int, header: dict[str, Any], payload: bytes | bytearray,
          key: bytes | None = None) -> list[bytes | bytearray]:
    """A framed file's pieces, in order (prefix, header, payload, digest): written one after another (no copy of
    the payload) or joined."""
    blob = json.dumps(header, separators=(",", ":")).encode()
    head = PREFIX.pack(magic, version, len(blob))
    return [head, blob, payload, digest([head, blob, payload], key)]


@dataclass
class Framed:
    """A framed file whose magic, version and digest are verified and whose header parsed as JSON (unchecked)."""

    version: int
    header: object
    payload: bytes


def unframe(data: bytes, magic: bytes, versions: tuple[int, ...], kind: str, key: bytes | None = None,
            version_note: Callable[[int], str] = lambda version: "") -> Framed:
    """Check a framed file's magic, length, version (``version_note``: why a refused one is refused) and digest,
    then parse its header; ``kind`` names the kind of file in the messages ("cache", "prefix chunk")."""
    version, size = check_prefix(data, len(data), magic, versions, kind, version_note)
    if not hmac.compare_digest(digest([memoryview(data)[:-DIGEST_BYTES]], key), data[-DIGEST_BYTES:]):
        keyed = " or written without this store's secret" if key is not None else ""  # only a store keys
        raise CacheFileError(f"checksum mismatch: the file is truncated or corrupt{keyed}")
    end = PREFIX.size + size
    return Framed(version, parse_header(data[PREFIX.size : end]), data[end : len(data) - DIGEST_BYTES])


def check_prefix(data: bytes | bytearray, file_bytes: int, magic: bytes, versions: tuple[int, ...], kind: str,
                 version_note: Callable[[int], str] = lambda version: "") -> tuple[int, int]:
    """The version and header length of a framed file of ``file_bytes`` bytes whose first bytes are ``data`` (at
    least its prefix, if the file is that long): its magic, version and a header that fits the file checked."""
    if not data.startswith(magic) and not magic.startswith(data):  # a prefix of the magic: truncated, below
        raise CacheFileError(f"not an hf_kvcompress {kind} file (bad magic)")
    if file_bytes < PREFIX.size + DIGEST_BYTES or len(data) < PREFIX.size:
        raise CacheFileError(f"truncated: {file_bytes} bytes")
    _magic, version, size = PREFIX.unpack_from(data, 0)
    if version not in versions:
        raise CacheFileError(f"{kind} format version {version}, this library reads {list(versions)}"
                             f"{version_note(version)}")
    if size > MAX_HEADER or PREFIX.size + size > file_bytes - DIGEST_BYTES:
        raise CacheFileError(f"header of {size} bytes does not fit a file of {file_bytes}")
    return version, size


def parse_header(blob: bytes | bytearray) -> object:
    """A framed file's JSON header, parsed (unchecked)."""
    try:  # any exception: a 4,300-digit integer is a ValueError of its own, deep nesting a RecursionError
        return json.loads(bytes(blob).decode())
    except Exception as err:
        raise CacheFileError(f"corrupt header ({type(err).__name__}: {err})") from err


# ---------------------------------------------------------------------- bounded reads of regular files


def read_regular(path: Path | str, *, magic: bytes, follow_links: bool = True, max_bytes: int | None = None,
                 dir_fd: int | None = None) -> bytes:
    """The bytes of ``path``, a regular file (`open_regular`; ``dir_fd``: a name in that folder) of at most
    ``max_bytes``: only its prefix when it does not start with ``magic`` (`unframe` refuses it; a large foreign
    file is never read whole)."""
    fd, size = open_regular(path, follow_links=follow_links, dir_fd=dir_fd)
    try:
        if max_bytes is not None and size > max_bytes:  # a sparse or planted file: never read
            raise CacheFileError(f"{size} bytes, more than such a file holds here ({max_bytes})")
        data = read_exactly(fd, min(size, PREFIX.size))
        if data.startswith(magic):
            data += read_exactly(fd, size - len(data))
    finally:
        os.close(fd)
    return data


def read_framed(path: Path, *, magic: bytes, versions: tuple[int, ...], kind: str, payload_field: str,
                max_bytes: int, version_note: Callable[[int], str] = lambda version: "") -> Framed:
    """`unframe` of ``path``, a regular file (`open_regular`), read in two steps: its prefix and header first, then,
    only if the payload the header declares (its field ``payload_field``; the caller checks the rest) makes up the
    file's size exactly and the file holds at most ``max_bytes``, the rest. A sparse, padded or planted file is
    refused before its payload is read or allocated for."""
    fd, size = open_regular(path)
    try:
        head = read_exactly(fd, PREFIX.size)
        _version, header_bytes = check_prefix(head, size, magic, versions, kind, version_note)
        blob = read_exactly(fd, header_bytes)
        payload = check_int(check_object(parse_header(blob), "header", None).get(payload_field), payload_field, 0)
        expected = PREFIX.size + header_bytes + payload + DIGEST_BYTES
        if expected != size:
            raise CacheFileError(f"the header declares {payload} payload bytes, a file of {expected} bytes; this one "
                                 f"holds {size} (truncated, padded or corrupt)")
        if size > max_bytes:
            raise CacheFileError(f"{size} bytes, more than this machine could hold in memory ({max_bytes})")
        data = bytearray(size)
        data[: len(head) + len(blob)] = head + blob
        read_into(fd, memoryview(data)[len(head) + len(blob) :])
    finally:
        os.close(fd)
    return unframe(data, magic, versions, kind, version_note=version_note)


def open_regular(path: Path | str, *, follow_links: bool = True, dir_fd: int | None = None) -> tuple[int, int]:
    """An open descriptor of ``path`` (``dir_fd``: relative to that folder's descriptor, as the prefix store opens
    its files) and its size, if it is a regular file: a FIFO, device or folder there is refused without blocking
    or reading (``follow_links=False``: a symbolic link too). Raises `CacheFileError`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as err:  # ELOOP: a link where links are refused
        raise CacheFileError(f"cannot read the file ({type(err).__name__}: {err.strerror})") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CacheFileError("not a regular file (a FIFO, device or folder)")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_exactly(fd: int, count: int) -> bytes:
    """Up to ``count`` bytes of ``fd`` from where it stands (fewer only if the file ends sooner)."""
    parts, left = [], count
    while left > 0:
        try:
            part = os.read(fd, min(left, 1 << 24))
        except OSError as err:
            raise CacheFileError(f"cannot read the file: {err}") from err
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_into(fd: int, view: memoryview) -> None:
    """Fill ``view`` from ``fd`` where it stands (no copy of a large payload); a file that ends sooner is refused."""
    at = 0
    while at < len(view):
        try:
            count = os.readv(fd, [view[at : at + (1 << 24)]])
        except OSError as err:
            raise CacheFileError(f"cannot read the file: {err}") from err
        if not count:
            raise CacheFileError(f"truncated while read: {at} of {len(view)} more bytes")
        at += count



# ---------------------------------------------------------------------- header values and the block table


def check_object(value: object, what: str, keys: set[str] | None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CacheFileError(f"{what} must be a JSON object, got {type(value).__name__}")
    if keys is not None and set(value) != keys:
        missing, extra = sorted(keys - set(value)), sorted(set(value) - keys)
        raise CacheFileError(f"{what}: missing fields {missing}, unknown fields {extra}")
    return value


def check_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise CacheFileError(f"{what} must be a string, got {type(value).__name__}")
    return value


def check_int(value: object, what: str, low: int, high: int = 1 << 62) -> int:
    """`validation.check_int` of a value read from a file: a `CacheFileError` (the file is bad, not an argument).
    A plain int in range passes here (a file holds thousands: not a call each); any other gets its message."""
    if type(value) is int and low <= value <= high:
        return value
    try:
        validation.check_int(what, value, minimum=low, maximum=high)
    except ValueError as err:
        raise CacheFileError(str(err)) from None
    return value  # type: ignore[return-value]  # checked above


def check_ints(values: list, what: str, low: int, high: int = 1 << 62) -> None:
    """`check_int` of every value of ``values`` (token ids)."""
    for value in values:
        check_int(value, what, low, high)


def check_extent(offset: object, length: object, where: str, cursor: list[int]) -> int:
    """Check that [offset, offset + length) is the next piece of the payload; advance the cursor."""
    if check_int(offset, f"{where} offset", 0) != cursor[0]:
        raise CacheFileError(f"{where} starts at payload byte {offset}, expected {cursor[0]} (overlap or gap)")
    cursor[0] += check_int(length, f"{where} length", 0)
    return length  # type: ignore[return-value]


def check_tensor(info: object, where: str, cursor: list[int]) -> None:
    """A tensor's entry: dtype, shape and the next extent of the payload, which its bytes fill exactly."""
    info = check_object(info, where, {"dtype", "shape", "offset", "bytes"})
    if info["dtype"] not in DTYPES:
        raise CacheFileError(f"{where}: unknown dtype {info['dtype']!r}")
    shape = info["shape"]
    if not isinstance(shape, list) or len(shape) > 8:
        raise CacheFileError(f"{where}: bad shape {shape!r}")
    count = 1
    for n in shape:
        count *= check_int(n, f"{where} shape", 0, 1 << 40)
    length = check_extent(info["offset"], info["bytes"], where, cursor)
    if count * DTYPES[info["dtype"]].itemsize != length:
        raise CacheFileError(f"{where}: {length} bytes do not hold shape {shape}")


def check_blocks(blocks: object, layer: str, start: int, tokens: int, rows: int, heads: int, dim: int,
                  config: CompressionConfig, cursor: list[int]) -> None:
    """``layer``'s blocks tile positions ``start .. tokens`` in order, full blocks but the last (streams at most
    ``dim`` elements a token)."""
    if not isinstance(blocks, list) or not blocks:
        raise CacheFileError(f"{layer} has no blocks")
    for b, block in enumerate(blocks):
        where = f"{layer}, block {b}"
        block = check_object(block, where, {"start", "tokens", "rows"})
        if block["start"] != start:
            raise CacheFileError(f"{where} starts at token {block['start']!r}, expected {start} "
                                 "(blocks missing, duplicated or out of order?)")
        count = check_int(block["tokens"], f"{where} tokens", 1, config.block_tokens)
        if count != config.block_tokens and start + count != tokens:
            raise CacheFileError(f"{where} holds {count} tokens; only the last block may hold fewer than "
                                 f"block_tokens={config.block_tokens}")
        if not isinstance(block["rows"], list) or len(block["rows"]) != rows:
            raise CacheFileError(f"{where} must hold {rows} rows")
        for r, row in enumerate(block["rows"]):
            check_row(row, f"{where}, row {r}", heads, count * dim, cursor)
        start += count
    if start != tokens:
        raise CacheFileError(f"{layer} holds {start} tokens, the header says {tokens}")


def check_row(row: object, where: str, heads: int, elements: int, cursor: list[int]) -> None:
    row = check_object(row, where, {"scales", "streams", "side", "listed"})
    streams, scales = row["streams"], row["scales"]
    if not isinstance(streams, list) or len(streams) != 2 * heads:
        raise CacheFileError(f"{where} must hold {2 * heads} streams")
    if not isinstance(scales, list) or len(scales) != 2 * heads:
        raise CacheFileError(f"{where} must hold {2 * heads} std scales")
    for scale in scales:
        check_int(scale, f"{where} std scale", SCALE_MIN, SCALE_MAX)
    for s, stream in enumerate(streams):
        if not isinstance(stream, list) or len(stream) != 2:
            raise CacheFileError(f"{where}, stream {s}: expected [offset, length]")
        length = check_extent(stream[0], stream[1], f"{where}, stream {s}", cursor)
        # a stream of n bytes lists at most n / 8 windows of at most MAX_WINDOW elements (the codec's bound):
        # refuses a block claiming more tokens than its streams can hold before anything is allocated
        if elements > MAX_WINDOW * (length // MIN_STREAM_ENTRY):
            raise CacheFileError(f"{where}, stream {s}: {length} bytes cannot hold the {elements} elements claimed")
    side = check_object(row["side"], f"{where} side", None)
    for name, info in side.items():
        check_tensor(info, f"{where} side {name!r}", cursor)
    if row["listed"] is not None:
        check_tensor(row["listed"], f"{where} listed", cursor)


def check_streams(blocks: list[CodedBlock], config: CodecConfig) -> None:
    """Each stream of a layer's ``blocks`` must declare its block's dtype and channel-major shape (under
    ``config``, the layer's codec settings): one codec call for the layer's streams, one per stream only to name
    a stream that does not parse."""
    try:
        infos = iter(stream_infos([blob for block in blocks for row in block.rows for blob in row.blobs],
                                  config=config))
    except (CorruptStreamError, TypeError):
        infos = None
    for block in blocks:
        where = f"layer {block.layer}, block at token {block.start}"
        for r, row in enumerate(block.rows):
            for s, blob in enumerate(row.blobs):
                try:
                    dtype, shape = next(infos) if infos is not None else stream_info(blob, config=config)
                except (CorruptStreamError, TypeError) as err:
                    raise CacheFileError(f"{where}, row {r}, stream {s}: {err}") from err
                dim = block.dim if s < block.heads else block.value_dim  # key streams first (`stream_order`)
                if dtype != block.dtype or shape != (dim, block.tokens):
                    raise CacheFileError(f"{where}, row {r}, stream {s}: holds {dtype} {list(shape)}, the header "
                                         f"says {block.dtype} {[dim, block.tokens]}")


def check_block(block: CodedBlock, predictor: Predictor, sides: dict[tuple, dict]) -> None:
    """Side data must be what the predictor sends for such a block (names, per-row shapes, dtypes; ``sides``
    memoises them per shape), listed elements in range."""
    where = f"layer {block.layer}, block at token {block.start}"
    shape = (block.layer, block.heads, block.tokens, block.dim, block.dtype, block.value_dim)
    if shape not in sides:
        sides[shape] = expected_side(predictor, *shape[:5], value_dim=block.value_dim)
    expected = sides[shape]
    for r, row in enumerate(block.rows):
        got = {name: (t.dtype, tuple(t.shape)) for name, t in row.side.items()}
        if got != expected:
            raise CacheFileError(f"{where}, row {r}: side data {got}, the '{predictor.name}' predictor needs {expected}")
        check_listed(row.listed, f"{where}, row {r}", 2 * block.heads, block.tokens * max(block.dim, block.value_dim))


def check_listed(listed: torch.Tensor | None, where: str, streams: int, elements: int) -> None:
    """A portable predictor's listed elements (`blockcoder.settle_stream`): int32 ``[n, 4]``, (stream, element) pairs
    strictly increasing and in range."""
    if listed is None:
        return
    if listed.dtype != torch.int32 or listed.dim() != 2 or listed.shape[1] != 4:
        raise CacheFileError(f"{where}: listed elements must be int32 [n, 4], got {listed.dtype} {list(listed.shape)}")
    if not listed.shape[0]:
        return
    stream, element = listed[:, 0].long().numpy(), listed[:, 1].long().numpy()
    if int(element.min()) < 0 or int(element.max()) >= elements:
        raise CacheFileError(f"{where}: listed elements out of range ({streams} streams of {elements} elements)")
    problem = listed_problem(stream * elements + element, streams * elements)
    if problem is not None:
        raise CacheFileError(f"{where}: listed elements {problem} ({streams} streams of {elements} elements)")


# ---------------------------------------------------------------------- payload: tensors and coded rows


def write_blocks(blocks: list[CodedBlock], payload: bytearray) -> list[dict[str, Any]]:
    """The block entries of ``blocks`` (in order), their streams and tensors appended to ``payload``."""
    return [{"start": b.start, "tokens": b.tokens, "rows": [write_row(row, payload) for row in b.rows]}
            for b in blocks]


def write_row(row: CodedRow, payload: bytearray) -> dict[str, Any]:
    streams = []
    for blob in row.blobs:
        streams.append([len(payload), len(blob)])
        payload += blob
    side = {name: write_tensor(tensor, payload) for name, tensor in row.side.items()}
    listed = None if row.listed is None else write_tensor(row.listed, payload)
    return {"scales": list(row.scales), "streams": streams, "side": side, "listed": listed}


def write_tensor(tensor: torch.Tensor, payload: bytearray) -> dict[str, Any]:
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    entry = {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape), "offset": len(payload),
             "bytes": len(data)}
    payload += data
    return entry


def read_blocks(kv: dict[str, Any], payload: bytes, coding: BlockCodec, layer: int, dtype: torch.dtype,
                device: torch.device, predictor: Predictor, sides: dict[tuple, dict]) -> list[CodedBlock]:
    """The blocks of a checked layer entry (``kv``: its ``heads``, ``key_dim``, ``value_dim`` and ``blocks``,
    `check_blocks`) as blocks of ``coding``, their streams copied out of ``payload`` and each checked against the
    codec and ``predictor`` (`check_streams`, `check_block`) before any is decoded."""
    out = []
    for b in kv["blocks"]:
        rows = [read_row(row, payload) for row in b["rows"]]
        out.append(CodedBlock(layer, b["start"], b["tokens"], rows, kv["heads"], kv["key_dim"], dtype, device,
                              value_dim=kv["value_dim"]))
    check_streams(out, coding.codec_for(layer))
    for block in out:
        check_block(block, predictor, sides)
    return out


def read_row(entry: dict[str, Any], payload: bytes) -> CodedRow:
    """A row of a checked header (`check_row`): its streams and side tensors, copied out of the payload."""
    view = memoryview(payload)
    blobs = [bytes(view[offset : offset + length]) for offset, length in entry["streams"]]
    side = {name: read_tensor(info, view) for name, info in entry["side"].items()}
    listed = None if entry["listed"] is None else read_tensor(entry["listed"], view)
    return CodedRow(blobs, array("b", entry["scales"]), side, listed)  # checked to lie in [SCALE_MIN, SCALE_MAX]


def read_tensor(info: dict[str, Any], view: memoryview) -> torch.Tensor:
    raw = bytearray(view[info["offset"] : info["offset"] + info["bytes"]])
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(DTYPES[info["dtype"]]).reshape(info["shape"]).clone()
