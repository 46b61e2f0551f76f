"""The ``huff`` coder (`CodecConfig(coder="huff")`): each element's sign and exponent as one Huffman-coded symbol
against a context from the caller's mean and std, its mantissa bits stored as they are (DFloat11 / ZipNN style,
with per-stream tables and a per-channel exponent reference). Built for decode speed: a table look-up and a
dozen integer operations per element, four streams decoded in lock step (`kernels`). Model-free: mean and std only
choose each element's context, so any statistics decode (the same ones bit for bit).

Layout of one stream (little-endian; varint = unsigned LEB128):

    magic "\\x89KH"[3]
    flags:u8   bits 0-1 dtype code, 2 has_mean, 3 has_std
    ndim:u8  shape:varint[ndim]
    fp:u32     low 32 bits of the fingerprint of the elements' contexts (`kernels.context_fingerprint`)
    nseg:varint, then per segment: gap:varint (unused symbols since the last segment's end), count:varint,
        lengths:u4[count] (two a byte, low nibble first; 0: unused), the code lengths of its symbols
    nbits:varint   payload: per element its code then its mantissa bits, LSB first, in ceil(nbits / 8) bytes
                   (no segment: a stored stream, each element's bits as they are, when coding would not be smaller)
    crc32 of everything above : u32

docs/codec_format.md section 13.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ...errors import ConfigTypeError, CorruptStreamError, ParameterMismatchError
from ..codec_config import CodecConfig
from ..interface import (
    ChunkedJob,
    Coder,
    check_out,
    check_stats,
    check_tensor,
    check_threads,
    describe,
    out_layout,
    triton_device,
    verify_mask,
)
from ..registry import register
from ..symbols import FORMATS_BY_CODE, Format, format_of, varint_bytes
from ..tables import Marginal
from . import kernels

MAGIC = b"\x89KH"
#: exponent bits, mantissa bits (the sign is the remaining top bit) per dtype code
FIELDS = {1: (8, 7), 2: (5, 10), 3: (8, 23)}
#: unused symbols between two used ones that start a new segment of the length table (a segment's header costs
#: ~2 bytes, the nibbles it skips gap / 2)
SEGMENT_GAP = 6
_ERRORS = {
    kernels.ERR_TABLE: "its code lengths do not form a code",
    kernels.ERR_CODE: "a bit pattern no code starts with",
    kernels.ERR_LENGTH: "its codes do not end at the payload's end",
}


class Layout(NamedTuple):
    """What a stream's kernels need of its format: ``ntab`` code tables of ``alphabet`` symbols (an offset of
    ``ew`` bits and a sign-xor bit), ``raw`` bits after each code, ``width`` bits an element, codes up to
    ``max_len`` bits, their lengths written as nibbles (`length_segments`) or, ``paired``, in static codes by pairs
    of symbols (`kernels.length_pairs`: mhuff version 2)."""

    ntab: int
    alphabet: int
    ew: int
    raw: int
    width: int
    max_len: int
    paired: bool = False


class Spec(NamedTuple):
    """One coder of this family (huff, mhuff): its name, magic bytes, `Layout` per dtype code, contexts and
    per-stream encoder ``(bits, ctx, rows, run, layout) -> (words, nbits, lengths [ntab, alphabet])``."""

    name: str
    magic: bytes
    layouts: dict
    contexts: Callable
    encode_stream: Callable


class Header(NamedTuple):
    fmt: Format
    shape: tuple[int, ...]
    has_mean: bool
    has_std: bool
    prefix: bytes  # magic, flags and shape: what every stream of a batch repeats


class Contexts(NamedTuple):
    """Each element's context ``ms << EW | ref``: ``ctx[crow[s], r]`` for row ``r`` of ``run`` elements of
    stream ``s``."""

    ctx: np.ndarray  # uint32 [1 or N, rows]
    crow: np.ndarray  # int64 [N]
    rows: int
    run: int


def _corrupt(msg: str, name: str = "huff") -> CorruptStreamError:
    return CorruptStreamError(f"corrupt {name} codec stream: {msg}")


def contexts(mean32: np.ndarray | None, std32: np.ndarray | None, fmt: Format, shape: tuple[int, ...],
             n_streams: int) -> Contexts:
    """The contexts of N streams of ``shape`` from checked float32 mean / std (``[N or 1, *broadcastable]``):
    ``ref``, the exponent field of ``max(|mean|, std)`` in ``fmt`` (float16: rebiased, clipped to 0..31), and
    ``ms``, the sign bit of the mean (0 without one). Statistics constant along the trailing dims give one
    context per row of them (the cache's per-channel statistics: one per channel); other shapes one per element."""
    ew, _ = FIELDS[fmt.code]
    nd, m = len(shape), math.prod(shape)
    zero = np.zeros((1,) * (nd + 1), np.float32)
    mean = zero if mean32 is None else mean32
    std = zero if std32 is None else std32
    if any(c != 1 for t in (mean, std) for c in t.shape[1:][-1:]) and m:  # varies along the last dim: per element
        return element_contexts(mean, std, fmt, shape, n_streams)
    a = np.maximum(np.abs(mean), std)
    ref = (a.view(np.uint32) >> 23) & 0xFF
    if fmt.code == 2:
        ref = np.clip(ref.astype(np.int64) - 112, 0, 31).astype(np.uint32)
    ms = np.broadcast_to(mean.view(np.uint32) >> 31, a.shape)
    ctx = (ms << ew) | ref
    lead, cshape = ctx.shape[0], ctx.shape[1:]
    last = max((i + 1 for i, c in enumerate(cshape) if c != 1), default=0)
    if tuple(cshape[:last]) == tuple(shape[:last]):
        rows = math.prod(shape[:last])
        run = math.prod(shape[last:]) if rows else 0
    else:  # statistics that vary inside a row: one context per element
        ctx = np.broadcast_to(ctx, (lead, *shape))
        rows, run = m, 1
    ctx = np.ascontiguousarray(ctx, dtype=np.uint32).reshape(lead, rows)
    crow = np.arange(n_streams, dtype=np.int64) if lead > 1 else np.zeros(n_streams, np.int64)
    return Contexts(ctx, crow, rows, run)


def element_contexts(mean: np.ndarray, std: np.ndarray, fmt: Format, shape: tuple[int, ...], n_streams: int,
                     fill: Callable | None = None) -> Contexts:
    """One context per element from statistics ``[N or 1, *broadcastable]`` (zero arrays for missing ones), in
    one compiled pass: ``fill(mean [N or 1, m or 1], std [...], out [N or 1, m])`` (default huff's
    `kernels.element_contexts`, the same values as the numpy form of `contexts`)."""
    lead = max(mean.shape[0], std.shape[0])
    flat = [t.reshape(1, 1) if t.size == 1 else np.broadcast_to(t, (t.shape[0], *shape)).reshape(t.shape[0], -1)
            for t in (mean, std)]  # a copy only where a statistic broadcasts inside a stream
    ctx = np.empty((lead, math.prod(shape)), np.uint32)
    if fill is None:
        kernels.element_contexts(*flat, fmt.code == 2, FIELDS[fmt.code][0], ctx)
    else:
        fill(*flat, ctx)
    crow = np.arange(n_streams, dtype=np.int64) if lead > 1 else np.zeros(n_streams, np.int64)
    return Contexts(ctx, crow, ctx.shape[1], 1)


def _prefix(fmt: Format, shape: tuple[int, ...], has_mean: bool, has_std: bool, magic: bytes = MAGIC) -> bytes:
    flags = fmt.code | (4 if has_mean else 0) | (8 if has_std else 0)
    return magic + bytes((flags, len(shape))) + b"".join(varint_bytes(d) for d in shape)


def _bits(x: torch.Tensor) -> np.ndarray:
    """``x`` ``[N, ...]`` as a contiguous ``[N, m]`` array of its bit patterns (uint16 / uint32)."""
    x = x.detach().to("cpu").contiguous()
    wide = x.dtype == torch.float32
    flat = x.view(torch.int32 if wide else torch.int16).numpy().view(np.uint32 if wide else np.uint16)
    return flat.reshape(x.shape[0], -1) if x.shape[0] else flat.reshape(0, math.prod(x.shape[1:]))


def encode_batch_impl(x: torch.Tensor, mean, std, threads: int | None = None) -> list[bytes]:
    return encode_family(x, mean, std, SPEC)


def encode_family(x: torch.Tensor, mean, std, spec: Spec, threads: int | None = None) -> list[bytes]:
    """`Coder.encode_batch` of a coder of this family (``spec``)."""
    check_tensor(x)
    check_threads(threads)
    fmt = format_of(x.dtype)
    if x.dim() < 1:
        raise ValueError(f"codec.encode_batch: x needs a leading batch dim, got {describe(x)}")
    xshape = tuple(x.shape)
    shape = xshape[1:]
    mean32, std32 = check_stats(mean, std, xshape)
    lay = spec.layouts[fmt.code]
    cx = spec.contexts(mean32, std32, fmt, shape, xshape[0])
    fps = np.empty(xshape[0], np.uint32)
    kernels.fingerprints(cx.ctx, cx.crow, cx.rows, cx.run, fps)
    prefix = _prefix(fmt, shape, mean32 is not None, std32 is not None, spec.magic)
    out = []
    for s, bits in enumerate(_bits(x)):
        words, nbits, lengths = spec.encode_stream(bits, cx.ctx[cx.crow[s]], cx.rows, cx.run, lay)
        tables = [*map(length_pairs if lay.paired else length_segments, lengths)]
        if lay.paired:  # their byte count first: a parser skips them
            tables.insert(0, varint_bytes(sum(map(len, tables))))
        coded = [*tables, varint_bytes(max(int(nbits), 0)),
                 words.view(np.uint8)[: (int(nbits) + 7) // 8]]  # nbits -1: no code of max_len bits exists
        if bits.size and (nbits < 0 or sum(len(c) for c in coded) >= bits.nbytes + 3 + 3 * lay.ntab):  # stored
            coded = [varint_bytes(lay.ntab)] * lay.paired + [varint_bytes(0)] * lay.ntab + [varint_bytes(8 * bits.nbytes),
                                                    bits.astype(bits.dtype.newbyteorder("<"))]
        body = b"".join((prefix, struct.pack("<I", int(fps[s])), *(bytes(c) if not isinstance(c, bytes) else c
                                                                    for c in coded)))
        out.append(body + struct.pack("<I", zlib.crc32(body)))
    return out


def length_segments(lengths: np.ndarray) -> bytes:
    """The code lengths as runs of used symbols (a gap of `SEGMENT_GAP` or more unused symbols starts a new one):
    nseg varint, then per segment the gap since the last one's end, its count and its lengths as nibbles
    (`kernels.length_segments`, compiled: one per table of every stream)."""
    return kernels.length_segments(np.ascontiguousarray(lengths, dtype=np.uint8), SEGMENT_GAP).tobytes()


def length_pairs(lengths: np.ndarray) -> bytes:
    """The code lengths in mhuff version 2's form (`kernels.length_pairs`: segments of used pairs of symbols, their
    lengths in static codes; compiled)."""
    return kernels.length_pairs(np.ascontiguousarray(lengths, dtype=np.uint8), kernels.PAIR_GAP).tobytes()


def parse_prefix(blob, spec: Spec | None = None) -> Header:
    """The checked magic, flags and shape of a stream (of ``spec``'s coder, default huff)."""
    spec = spec or SPEC
    name = spec.name
    buf = bytes(blob[: 5 + 9 * 32])
    if len(buf) < 5 or buf[:3] != spec.magic:
        raise _corrupt(f"not a {name} stream (magic bytes)", name)
    flags, ndim = buf[3], buf[4]
    if flags & 0xF0 or (flags & 3) not in FORMATS_BY_CODE:
        raise _corrupt(f"unknown flags {flags:#x}", name)
    if ndim > 32:
        raise _corrupt(f"{ndim} dims", name)
    shape, at = [], 5
    for _ in range(ndim):
        v, shift = 0, 0
        while True:
            if at >= len(buf) or shift > 56:
                raise _corrupt("header cut short", name)
            byte = buf[at]
            at += 1
            v |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        shape.append(v)
    if math.prod(shape) > 1 << 40:
        raise _corrupt(f"shape {shape} too large", name)
    return Header(FORMATS_BY_CODE[flags & 3], tuple(shape), bool(flags & 4), bool(flags & 8), buf[:at])


def _crc_ok(blob) -> bool:
    return len(blob) >= 4 and zlib.crc32(blob[:-4]) == int.from_bytes(bytes(blob[-4:]), "little")


class _Parsed(NamedTuple):
    b8: np.ndarray
    b64: np.ndarray
    fp: np.ndarray
    tat: np.ndarray
    pstart: np.ndarray
    pbits: np.ndarray
    stored: np.ndarray


def _parse_all(blobs: Sequence, head: Header, check: np.ndarray, spec: Spec) -> _Parsed:
    """Every stream joined in one 8-byte aligned buffer (padded for the decoder's reads past a damaged stream's
    end), its header fields parsed and checked (the crc32 where the mask ``check`` is set)."""
    n = len(blobs)
    for i, b in enumerate(blobs):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise TypeError(f"codec.decode_batch: stream {i} must be bytes, got {type(b).__name__}")
    sizes = np.fromiter((len(b) for b in blobs), np.int64, n)
    start = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1], out=start[1:])
    total = int(sizes.sum())
    b64 = np.zeros((total + kernels.PAD_BYTES) // 8 + 2, np.uint64)
    b8 = b64.view(np.uint8)
    b8[:total] = np.frombuffer(b"".join(blobs), np.uint8)
    fields = [np.zeros(n, t) for t in (np.uint32, np.int64, np.int64, np.int64, np.bool_)]
    m = math.prod(head.shape)
    lay = spec.layouts[head.fmt.code]
    bad = kernels.parse_headers(b8, start, sizes, np.frombuffer(head.prefix, np.uint8), m, lay.ntab, lay.alphabet,
                                lay.width, lay.raw, lay.max_len, lay.paired, *fields)
    if bad >= 0:
        other = parse_prefix(blobs[bad], spec)  # the clearer error first: another shape, dtype or statistics
        if other.prefix != head.prefix:
            raise ValueError(f"codec.decode_batch: stream {bad} holds {other.fmt.name} {other.shape} (mean "
                             f"{other.has_mean}, std {other.has_std}), stream 0 {head.fmt.name} {head.shape} (mean "
                             f"{head.has_mean}, std {head.has_std}); a batch needs one shape, dtype and stats")
        raise _corrupt(f"stream {bad}: its header or length does not add up", spec.name)
    for i in np.flatnonzero(check).tolist():
        lo, hi = int(start[i]), int(start[i] + sizes[i])
        if hi - lo < 4 or zlib.crc32(b8[lo : hi - 4]) != int(b8[hi - 4 : hi].view("<u4")[0]):
            raise _corrupt(f"stream {i}: crc32 does not match", spec.name)
    return _Parsed(b8, b64, *fields)


class Prepared(NamedTuple):
    """A batch decode's host work, whichever decoder runs next (`DecodeJob`, `huff_triton`): the first stream's
    header, every stream parsed and checked, the elements' contexts (fingerprints checked) and the layout."""

    head: Header
    parsed: _Parsed
    cx: Contexts
    lay: Layout


def prepare_decode(blobs: Sequence, mean, std, out: torch.Tensor | None, verify, spec: Spec) -> Prepared:
    """Parse and check a batch (`_parse_all`: headers, lengths, crc32 where ``verify`` says), check ``out`` and the
    statistics, and compute the contexts, checked against each stream's fingerprint (`ParameterMismatchError`)."""
    if not isinstance(blobs, (list, tuple)) or not blobs:
        raise ValueError(f"codec.decode_batch: blobs must be a non-empty list of streams, got {describe(blobs)}")
    head = parse_prefix(blobs[0], spec)
    check = verify_mask(verify, len(blobs))
    if check[0]:  # before its shape is believed; not again with the others
        if not _crc_ok(blobs[0]):
            raise _corrupt("stream 0: crc32 does not match", spec.name)
        check[0] = 0
    fmt, shape, n = head.fmt, head.shape, len(blobs)
    xshape = (n, *shape)
    check_out(out, fmt, xshape)
    mean32, std32 = _decode_stats(mean, std, xshape, head)
    parsed = _parse_all(blobs, head, check, spec)
    cx = spec.contexts(mean32, std32, fmt, shape, n)
    fps = np.empty(n, np.uint32)
    kernels.fingerprints(cx.ctx, cx.crow, cx.rows, cx.run, fps)
    wrong = np.flatnonzero(fps != parsed.fp)
    if wrong.size:
        raise ParameterMismatchError(f"codec.decode_batch: stream {int(wrong[0])}: mean / std differ from the "
                                     "encoder's (their contexts' fingerprint does not match)")
    return Prepared(head, parsed, cx, spec.layouts[fmt.code])


def decode_batch_impl(blobs: Sequence, mean, std, out: torch.Tensor | None = None, threads: int | None = None,
                      verify: bool | Sequence[bool] = True, spec: Spec | None = None) -> torch.Tensor:
    """`Coder.decode_batch` of a coder of this family (``spec``, default huff's): the Triton decoder
    (`huff_triton`) where `interface.triton_device` says so (a CUDA ``mean`` / ``std`` / ``out`` with Triton, or the
    kernels forced to Triton), else the numba decoder on the host (``threads`` of them)."""
    threads = check_threads(threads)
    device = triton_device(mean, std, out)
    if device is not None:
        return decode_batch_triton(blobs, mean, std, spec or SPEC, device=device, out=out, verify=verify)
    job = DecodeJob(blobs, mean, std, out, verify, chunks=threads, spec=spec)
    return job.start(threads - 1).finish() if threads > 1 else job.finish()


def decode_batch_triton(blobs: Sequence, mean, std, spec: Spec | None = None, device: str | torch.device = "cpu",
                        out: torch.Tensor | None = None, verify: bool | Sequence[bool] = True) -> torch.Tensor:
    """`decode_batch_impl` with the decoding on ``device`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``): parsed
    and checked here (`prepare_decode`), decoded by `huff_triton.decode_prepared`; the numba decoder's bits and
    errors. The result lands in ``out`` (any device) or in a new tensor on ``device``."""
    from . import huff_triton  # optional dependency, imported when a kernel runs as Triton

    spec = spec or SPEC
    prep = prepare_decode(blobs, mean, std, out, verify, spec)
    return huff_triton.decode_prepared(prep, f"corrupt {spec.name} codec stream", _ERRORS, torch.device(device), out)


class DecodeJob(ChunkedJob):
    """One `decode_batch`, parsed and checked here, whose kernel runs in chunks of streams (multiples of four,
    `interface.ChunkedJob`): the cache's decode ahead (`Coder.start_decode_batch`) and `decode_batch` itself."""

    def __init__(self, blobs: Sequence, mean, std, out: torch.Tensor | None, verify, chunks: int = 1,
                 spec: Spec | None = None):
        spec = spec or SPEC
        head, parsed, cx, lay = prepare_decode(blobs, mean, std, out, verify, spec)
        fmt, shape, n = head.fmt, head.shape, len(blobs)
        host, flat, base, a_step, b_step = _destination(out, fmt, (n, *shape), cx)
        args = (parsed.b8, parsed.b64, parsed.pstart, parsed.pbits, parsed.stored, parsed.tat, lay.alphabet,
                lay.ntab, lay.max_len, lay.paired, cx.ctx, cx.crow, cx.rows, cx.run, lay.ew, lay.raw, flat, base, a_step,
                b_step, np.zeros(n, np.int32))
        groups = -(-n // 4) if math.prod(shape) else 0
        k = max(1, min(chunks, groups))
        self._setup(kernels.decode_streams, args, sorted({min(n, 4 * (groups * i // k)) for i in range(k + 1)}),
                    host, out, f"corrupt {spec.name} codec stream", _ERRORS)


def _decode_stats(mean, std, xshape: tuple[int, ...], head: Header):
    """Checked float32 mean / std of a decode, as the stream says it was encoded (with or without each)."""
    try:
        mean32, std32 = check_stats(mean, std, xshape)
    except ConfigTypeError:
        raise
    except ValueError as err:  # NaN, inf or a negative std: statistics no encoder took, so not the stream's
        if "broadcast" in str(err) or "more dims" in str(err) or "meta device" in str(err):
            raise
        raise ParameterMismatchError(f"codec.decode_batch: {err}: not the statistics the streams were encoded "
                                     "with") from err
    for name, given, has in (("mean", mean32, head.has_mean), ("std", std32, head.has_std)):
        if (given is not None) != has:
            raise CorruptStreamError(f"stream was encoded {'with' if has else 'without'} a {name}; pass "
                                     f"{'it' if has else f'{name}=None'} to decode")
    return mean32, std32


def _destination(out: torch.Tensor | None, fmt: Format, xshape: tuple[int, ...], cx: Contexts):
    """Where the kernel writes: (the tensor written, its flat bit view, each stream's base, row step, element
    step): ``out`` itself when it is a CPU tensor whose streams' elements step as the contexts' rows and runs,
    else a new contiguous tensor (copied into ``out`` after)."""
    shape = xshape[1:]
    if out is not None and out.device.type == "cpu":
        layout = out_layout(out, shape)
        if layout is not None:
            flat, base, orun, between, within = layout
            step = within if orun >= math.prod(shape) or between == orun * within else between if orun == 1 else 0
            if step:  # the stream's elements step evenly
                return out, flat, base, cx.run * step, step
            if orun == cx.run:
                return out, flat, base, between, within
    host = torch.empty(xshape, dtype=fmt.dtype)
    flat, base, _, _, within = out_layout(host, shape)
    return host, flat, base, cx.run * within, within


def _encode_stream(bits: np.ndarray, ctx: np.ndarray, rows: int, run: int, lay: Layout):
    words, nbits, lengths = kernels.encode_stream(bits, ctx, rows, run, lay.ew, lay.raw)
    return words, nbits, [lengths]


SPEC = Spec("huff", MAGIC, {code: Layout(1, 2 << ew, ew, mw, 1 + ew + mw, kernels.MAX_LEN)
                            for code, (ew, mw) in FIELDS.items()}, contexts, _encode_stream)


# --------------------------------------------------------------------------------------- the coder


@register
class HuffCoder(Coder):
    """Per-stream Huffman tables of (sign, exponent) against a context, mantissa raw: see the module docstring."""

    name = "huff"
    magic = (MAGIC,)
    windows = ("fixed",)
    batched = True
    reads_marginal = False  # escapes do not exist: sign and exponent are Huffman-coded, the mantissa raw

    def check_config(self, cfg: CodecConfig) -> None:
        if cfg.window != "fixed":
            raise ValueError(f"CodecConfig(coder='huff') codes each stream with one table: window must be 'fixed', "
                             f"got {cfg.window!r} (adaptive windows: coder='ans')")

    def encode_batch(self, x, mean, std, cfg: CodecConfig, threads: int | None = None) -> list[bytes]:
        return encode_batch_impl(x, mean, std, threads)

    def decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                     threads: int | None = None, verify: bool | Sequence[bool] = True) -> torch.Tensor:
        device = next((t.device for t in (mean, std) if isinstance(t, torch.Tensor) and t.is_cuda), None)
        x = decode_batch_impl(blobs, mean, std, out=out, threads=threads, verify=verify)
        return x if out is not None or device is None else x.to(device)

    def start_decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                           threads: int = 1, verify: bool | Sequence[bool] = True, chunks: int = 8) -> DecodeJob | None:
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in (mean, std)) or \
                triton_device(mean, std, out) is not None:
            return None  # decoded where the layer's read runs `decode_batch` (on the device with Triton)
        check_threads(threads)
        return DecodeJob(blobs, mean, std, out, verify, chunks).start(threads)

    def decode(self, blob, mean, std, config: CodecConfig | None, marginal: Marginal | None = None,
               threads: int = 1, workers: int = 1) -> torch.Tensor:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"codec: blob must be bytes, got {type(blob).__name__}")
        return decode_batch_impl([blob], mean, std)[0]

    def stream_infos(self, blobs, config: CodecConfig | None,
                     marginal: Marginal | None = None) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(head.fmt.dtype, head.shape) for head in map(parse_prefix, blobs)]

    def payload_bytes(self, blob: bytes, n: int, fmt: Format) -> int:
        return len(blob) - len(parse_prefix(blob).prefix) - 8  # fingerprint and crc: the rest codes the elements
