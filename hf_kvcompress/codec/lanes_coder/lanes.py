"""The lanes stream format: batch encode / decode of many streams through the compiled kernels (`jit.py`).

Each stream is one window coded by interleaved rANS (element ``i`` in lane ``i % lanes``; per round of
``lanes`` elements their escape flags, then their symbols: `jit.encode_streams`) with the codec's own
tables at their full 24-bit precision, so rates match the ``ans`` coder. Layout (little-endian; varint = unsigned LEB128, at most 9 bytes):

    magic "\\x89KL"[3]
    flags:u8   bits 0-1 dtype code, 2 has_mean, 3 has_std, 4-6 log2(lanes), 7 zero
    ndim:u8  shape:varint[ndim]  [sigma_code:u16 if not has_std]
    digest:u32   first 4 bytes of BLAKE2b(tables, marginal, config)
    fp:u32       fingerprint of the stream's mean and std (jit.fingerprints)
    check:u32    hash of the payload words and the decoded bit patterns (jit.combine_check)
    crc32 of everything above : u32
    words: u32[2 * lanes] final lane states (low, high word), then the word stream in decoding order
    raw low bits (float32: u16 each; float16: 3 bits each, 8 per 3 bytes), padded to 4 bytes

See docs/codec_format.md section 12.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ...errors import CorruptStreamError, ParameterMismatchError
from ..codec_config import CodecConfig
from ..interface import (
    ChunkedJob,
    check_config,
    check_has_data,
    check_out,
    check_range,
    check_stat,
    check_threads,
    out_layout,
    thread_pool,
    verify_mask,
)
from ..params import (
    GAUSS_BIAS,
    SIGMA_CODE_MAX,
    SIGMA_CODE_MIN,
    bits_to_f32,
    params_kernel,
    residual_codes,
    sigma_bits_of_code,
    t_lut,
)
from ..symbols import FORMATS_BY_CODE, FP16, Format, format_of, pack_raw, raw_padded_nbytes, varint_bytes
from ..tables import Marginal, get_tables
from . import jit

MAGIC = b"\x89KL"
MAX_NDIM = 32
# lanes per stream: 8 interleaved states keep a core's pipeline busy (decode speed flat from 8 to 32 lanes,
# docs/results/codec.md 12.3) while the 8-byte final state per lane costs ~0.02 bit/scalar on a 16k-element stream
LANES_LOG2 = 3
MAX_LANES_LOG2 = 6  # the decoder keeps a round's escape flags in one 64-bit mask
_MAX_VARINT = 9


class LaneTables(NamedTuple):
    """The codec tables as flat arrays for the kernels (built once per process)."""

    cum: np.ndarray  # int32: per table, cumulative frequencies (size + 1 entries), concatenated
    coff: np.ndarray  # int64 [N_TABLES]: start of each table in cum
    size: np.ndarray  # int32 [N_TABLES]
    half: np.ndarray  # int32 [N_TABLES]
    radius: np.ndarray  # int64 [N_TABLES]
    lut: np.ndarray  # uint16 [N_TABLES * (2^LUT_BITS + 1)]: symbol holding the first slot of each bucket


def _lut_of(cum: np.ndarray) -> np.ndarray:
    """Bucket b -> symbol holding slot b << LUT_SHIFT; entry 2^LUT_BITS = last symbol (the search's bound)."""
    starts = np.arange(1 << jit.LUT_BITS, dtype=np.int64) << jit.LUT_SHIFT
    first = np.searchsorted(cum, starts, side="right") - 1
    return np.concatenate([first, [cum.size - 2]])


@functools.lru_cache(maxsize=1)
def lane_tables() -> LaneTables:
    t = get_tables()
    cums = [np.concatenate([[0], np.cumsum(f)]) for f in t.freqs]
    coff = np.concatenate([[0], np.cumsum([c.size for c in cums[:-1]])]).astype(np.int64)
    lut = np.concatenate([_lut_of(c) for c in cums]).astype(np.uint16)
    cum = np.concatenate(cums).astype(np.int32)
    return LaneTables(cum, coff, t.size.astype(np.int32), t.half.astype(np.int32), t.radius.astype(np.int64), lut)


def phat_tables(marginal: Marginal, fmt: Format) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative frequencies, bucket index) of p_hat over the format's coded patterns, kept by the marginal
    (`Marginal.memo`)."""

    def make() -> tuple[np.ndarray, np.ndarray]:
        freq = marginal.frequencies(fmt)  # not `coding`: its constriction model would be kept for nothing
        cum = np.concatenate([[0], np.cumsum(freq)])
        return cum.astype(np.int32), _lut_of(cum).astype(np.int32)

    return marginal.memo("lanes.phat", fmt, make)


@functools.lru_cache(maxsize=64)
def lanes_digest(cfg: CodecConfig) -> int:
    """32-bit digest of the tables hash, the marginal hash and the config: a decoder handed another config
    fails loudly instead of decoding garbage."""
    h = hashlib.blake2b(b"hf_kvcompress.codec lanes v1\n", digest_size=8)
    h.update(bytes.fromhex(get_tables().sha256))
    h.update(bytes.fromhex(cfg.marginal_or_default.sha256))
    h.update(json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode())
    return int.from_bytes(h.digest()[:4], "little")


def lanes_for(n: int) -> int:
    """log2 of the lane count the encoder uses for an ``n``-element stream: fewer for tiny streams, where
    8-byte final states would dominate."""
    if n <= 0:
        return 0
    return int(min(LANES_LOG2, max(0, math.floor(math.log2(max(1, n // 256))))))


def _escape_freq(cfg: CodecConfig, n: int) -> int:
    """Escape frequency (out of 2^24) of a stream: the tier of a window of its length."""
    return cfg.escape[cfg.tier_of_length(max(n, 1))] << (jit.PREC - 16)


# --------------------------------------------------------------------------------------- statistics


class Stats(NamedTuple):
    """Per-element parameters of N streams of shape ``shape``, from compact (broadcast) mean / std."""

    tid: np.ndarray | None  # None when the params are left to the device (`prepare_stats(params=False)`)
    cp: np.ndarray | None
    cn: np.ndarray | None
    sg: np.ndarray | None
    pidx: np.ndarray  # int32 [M] element -> compact index (empty: identity)
    p_row: np.ndarray  # int64 [N]: start of each stream's compact params
    fps: np.ndarray  # uint32 [N]
    mbits: np.ndarray  # uint32: the compact means' float32 bits (what the params are computed from)
    sbits: np.ndarray  # uint32: the compact stds' float32 bits
    cshape: tuple[int, ...]  # per-stream shape of the compact statistics (``pidx`` maps ``shape`` onto it)
    run: int  # > 0: ``pidx[i] == i // run`` (statistics constant along the last dim), else 0


_PARALLEL_PARAMS = 1 << 15  # below this many compact elements a second thread costs more than it saves


@functools.lru_cache(maxsize=64)
def _pidx(shape: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
    """Flat compact index of every element of a stream of ``shape`` (empty when they coincide)."""
    if tuple(cshape) == tuple(shape):
        return np.zeros(0, dtype=np.int32)
    m = math.prod(shape)
    idx = np.zeros(m, dtype=np.int64)
    i = np.arange(m, dtype=np.int64)
    xs, cs = 1, 1
    for d in range(len(shape) - 1, -1, -1):
        if cshape[d] == shape[d] and shape[d] != 1:
            idx += (i // xs % shape[d]) * cs
        xs *= shape[d]
        cs *= cshape[d]
    out = idx.astype(np.int32)
    out.setflags(write=False)
    return out


def _run_of(shape: tuple[int, ...], cshape: tuple[int, ...]) -> int:
    """``run`` > 0 when the compact index of element ``i`` is ``i // run``: statistics that are constant
    along a stream's last dimension only (the cache's per-channel statistics of ``[channels, tokens]``)."""
    if len(shape) and shape[-1] > 1 and cshape[-1] == 1 and tuple(cshape[:-1]) == tuple(shape[:-1]):
        return int(shape[-1])
    return 0


def _as_rows(arr: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int]:
    """[N or 1, *s] float32 -> (uint32 bits [rows, C], per-stream shape, rows); None -> (empty, empty, 0)."""
    if arr is None:
        return np.zeros((1, 0), dtype=np.uint32), np.zeros(0, dtype=np.int64), 0
    rows = arr.shape[0]
    return arr.view(np.uint32).reshape(rows, -1), np.asarray(arr.shape[1:], dtype=np.int64), rows


def prepare_stats(shape: tuple[int, ...], n_streams: int, mean32: np.ndarray | None, std32: np.ndarray | None,
                  sigma_bits: np.ndarray | None, fmt: Format, mean_steps: int, threads: int = 1,
                  params: bool = True) -> Stats:
    """Compact params for N streams of ``shape``; ``mean32`` / ``std32``: checked float32 arrays of ndim
    ``1 + len(shape)`` (leading dim N or 1); ``sigma_bits``: uint32 [N] per-stream std when std is None.
    Per-element statistics are turned into params on ``threads`` threads; ``params=False`` leaves them out
    (fingerprints and the compact layout only: the Triton decoder computes the params on its device)."""
    mb, mshape, mrows = _as_rows(mean32)
    sb, sshape, srows = _as_rows(std32)
    fps = np.empty(n_streams, dtype=np.uint32)
    jit.fingerprints(mb, mrows, mshape, sb, srows, sshape, n_streams, fps)
    nd = len(shape)
    m_c = mean32 if mean32 is not None else np.zeros((1,) * (nd + 1), dtype=np.float32)
    if std32 is None:
        assert sigma_bits is not None
        s_c = sigma_bits.astype(np.uint32).view(np.float32).reshape((n_streams,) + (1,) * nd)
    else:
        s_c = std32
    full = np.broadcast_shapes(m_c.shape, s_c.shape)
    rows, cshape = full[0], tuple(full[1:])
    mbits = np.ascontiguousarray(np.broadcast_to(m_c, full)).view(np.uint32).reshape(-1)
    sbits = np.ascontiguousarray(np.broadcast_to(s_c, full)).view(np.uint32).reshape(-1)
    k = mbits.size
    tid = cp = cn = sg = None
    if params:
        tid = np.empty(k, dtype=np.uint16)
        cp = np.empty(k, dtype=np.int32)
        cn = np.empty(k, dtype=np.int32)
        sg = np.empty(k, dtype=np.int8)
        _run(params_kernel, (mbits, sbits, fmt.zero_key, fmt.exp_offset, fmt.truncated, fmt is FP16, mean_steps,
                                 lane_tables().radius, t_lut(mean_steps), tid, cp, cn, sg), k,
             threads if k >= _PARALLEL_PARAMS else 1)
    c = math.prod(cshape)
    p_row = (np.arange(n_streams, dtype=np.int64) * c) if rows > 1 else np.zeros(n_streams, dtype=np.int64)
    return Stats(tid, cp, cn, sg, _pidx(tuple(shape), cshape), p_row, fps, mbits, sbits, cshape,
                 _run_of(tuple(shape), cshape))


def _check_batch_stat(value, name: str, xshape: tuple[int, ...], is_std: bool) -> np.ndarray | None:
    arr = check_stat(value, name, xshape, is_std)
    if arr is None:
        return None
    return np.ascontiguousarray(arr, dtype=np.float32)


# --------------------------------------------------------------------------------------- header


def _head(fmt: Format, shape: tuple[int, ...], has_mean: bool, has_std: bool, lanes_log2: int,
          sigma: int | None, digest: int, fp: int, check: int) -> bytes:
    flags = fmt.code | has_mean << 2 | has_std << 3 | lanes_log2 << 4
    head = bytearray(MAGIC + bytes([flags, len(shape)]))
    for d in shape:
        head += varint_bytes(d)
    if sigma is not None:
        head += struct.pack("<H", sigma)
    head += struct.pack("<III", digest, fp, check)
    return bytes(head) + struct.pack("<I", zlib.crc32(head))


class Parsed(NamedTuple):
    fmt: Format
    shape: tuple[int, ...]
    has_mean: bool
    has_std: bool
    lanes_log2: int
    sigma: int
    digest: int
    fp: int
    check: int
    data_start: int  # offset of the words in the blob


def _corrupt(msg: str) -> CorruptStreamError:
    return CorruptStreamError(f"corrupt codec stream (lanes): {msg}")


def parse_header(buf: bytes, verify: bool = True) -> Parsed:
    """Bounds-checked parse of one lanes header, its CRC verified (``verify=False``: not, for tools that
    reseal mutated streams)."""
    n = len(buf)
    if n < 5 or buf[:3] != MAGIC:
        raise CorruptStreamError("not a hf_kvcompress lanes codec stream (bad magic bytes)")
    flags, ndim = buf[3], buf[4]
    code, has_mean, has_std, ll = flags & 3, flags >> 2 & 1, flags >> 3 & 1, flags >> 4 & 7
    if flags >> 7 or code not in FORMATS_BY_CODE or ll > MAX_LANES_LOG2:
        raise _corrupt(f"bad flags byte {flags:#04x}")
    if ndim > MAX_NDIM:
        raise _corrupt(f"bad ndim {ndim}")
    pos = 5
    shape = []
    for _ in range(ndim):
        v = 0
        for i in range(_MAX_VARINT + 1):
            if i == _MAX_VARINT:
                raise _corrupt("varint longer than 9 bytes")
            if pos >= n:
                raise _corrupt(f"header runs past the end of the {n}-byte stream (truncated?)")
            b = buf[pos]
            pos += 1
            v |= (b & 0x7F) << (7 * i)
            if b < 0x80:
                break
        shape.append(v)
    sigma = 0
    if not has_std:
        if pos + 2 > n:
            raise _corrupt("header truncated")
        (sigma,) = struct.unpack_from("<H", buf, pos)
        pos += 2
    if pos + 16 > n:
        raise _corrupt(f"header runs past the end of the {n}-byte stream (truncated?)")
    digest, fp, check, crc = struct.unpack_from("<IIII", buf, pos)
    if verify and zlib.crc32(buf[: pos + 12]) != crc:
        raise _corrupt("header checksum mismatch")
    if not has_std and not SIGMA_CODE_MIN <= sigma <= SIGMA_CODE_MAX:
        raise _corrupt("bad sigma code")
    return Parsed(FORMATS_BY_CODE[code], tuple(shape), bool(has_mean), bool(has_std), ll, sigma, digest, fp,
                  check, pos + 16)


# --------------------------------------------------------------------------------------- encode


def encode_batch_impl(x: torch.Tensor, mean, std, cfg: CodecConfig, threads: int | None = None) -> list[bytes]:
    threads = check_threads(threads)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec: x must be a torch.Tensor, got {type(x).__name__}")
    check_has_data(x, "x")
    fmt = format_of(x.dtype)
    if x.dim() < 1:
        raise ValueError("codec.encode_batch: x needs a leading stream dimension [N, ...]")
    if x.dim() - 1 > MAX_NDIM:
        raise ValueError(f"codec: streams of {x.dim() - 1} dims; streams hold at most {MAX_NDIM}")
    xshape = tuple(int(d) for d in x.shape)
    n_streams, shape = xshape[0], xshape[1:]
    m = math.prod(shape)
    mean32 = _check_batch_stat(mean, "mean", xshape, False)
    std32 = _check_batch_stat(std, "std", xshape, True)
    xc = x.detach().to("cpu").contiguous()
    if fmt.dtype == torch.float32:
        bits = xc.view(torch.int32).numpy().view(np.uint32).reshape(n_streams, m)
    else:
        bits = xc.view(torch.int16).numpy().view(np.uint16).reshape(n_streams, m)
    sigma = None
    sigma_bits = None
    if std32 is None:
        sigma = _stream_sigma_codes(bits, mean32, fmt, n_streams, shape)
        sigma_bits = sigma_bits_of_code(sigma).astype(np.uint32)
    st = prepare_stats(shape, n_streams, mean32, std32, sigma_bits, fmt, cfg.mean_steps, threads)
    tab = lane_tables()
    pcum, _ = phat_tables(cfg.marginal_or_default, fmt)
    ll = lanes_for(m)
    cap = 2 * m + 2 * (1 << ll) + 1
    words = np.empty((n_streams, cap), dtype=np.uint32)
    nwords = np.empty(n_streams, dtype=np.int64)
    checks = np.empty(n_streams, dtype=np.uint32)
    _run(jit.encode_streams, (bits, m, ll, fmt.raw_bits, st.pidx, st.run, st.p_row, st.tid, st.cp, st.cn, st.sg, tab.cum,
                              tab.coff, tab.size, tab.half, pcum, _escape_freq(cfg, m), fmt.zero_key, words, nwords,
                              checks), n_streams, threads)
    digest = lanes_digest(cfg)
    out = []
    for s in range(n_streams):
        head = _head(fmt, shape, mean32 is not None, std32 is not None, ll, None if sigma is None else int(sigma[s]),
                     digest, int(st.fps[s]), int(checks[s]))
        parts = [head, words[s, cap - nwords[s]:].astype("<u4").tobytes()]
        if fmt.raw_bits:
            parts.append(pack_raw(bits[s].astype(np.int64) & ((1 << fmt.raw_bits) - 1), fmt))
        out.append(b"".join(parts))
    return out


def _stream_sigma_codes(bits: np.ndarray, mean32: np.ndarray | None, fmt: Format, n_streams: int,
                        shape: tuple[int, ...]) -> np.ndarray:
    """Per-stream sigma code when std is None: mean residual log code + bias, as the ans coder's windows."""
    x = bits_to_f32(bits.reshape(-1), fmt)
    if mean32 is None:
        mfull = np.zeros(x.size, dtype=np.float32)
    else:
        mfull = np.ascontiguousarray(np.broadcast_to(mean32, (n_streams, *shape))).reshape(-1)
    codes = residual_codes(x, mfull).reshape(n_streams, -1).astype(np.int64)
    mean_code = codes.sum(axis=1) // max(1, codes.shape[1])
    return np.clip(mean_code + GAUSS_BIAS, SIGMA_CODE_MIN, SIGMA_CODE_MAX)


# --------------------------------------------------------------------------------------- decode

def _executor(n: int, name: str = "kvc-lanes") -> ThreadPoolExecutor:
    return thread_pool(n, name)





def _run(kernel, args: tuple, n_streams: int, threads: int) -> None:
    """``kernel(*args, s_lo, s_hi)`` over all streams (or elements): one call, or one per thread on
    contiguous shares (the kernels release the GIL)."""
    nt = min(threads, n_streams)
    if nt <= 1:
        kernel(*args, 0, n_streams)
        return
    cuts = [n_streams * k // nt for k in range(nt + 1)]
    # the calling thread takes the first share: one hand-off fewer, and no core waits idle on the pool
    futs = [_executor(nt - 1).submit(kernel, *args, cuts[k], cuts[k + 1]) for k in range(1, nt)]
    try:
        kernel(*args, cuts[0], cuts[1])
    finally:
        for f in futs:
            f.result()


_PADS = (b"", b"\0", b"\0\0", b"\0\0\0")

_ERRORS = {
    jit.ERR_WORDS_SHORT: "the word stream ends early",
    jit.ERR_WORDS_LEFT: "words left over after the last element",
    jit.ERR_STATE: "a lane did not return to its initial state",
    jit.ERR_KEY: "a decoded value lies outside the dtype",
    jit.ERR_HASH: "checksum of the payload and decoded data does not match",
}


class Batch(NamedTuple):
    """Parsed, verified streams of one `decode_batch` call, laid out for the kernels."""

    fmt: Format
    shape: tuple[int, ...]
    m: int  # elements per stream
    st: Stats
    buf8: np.ndarray  # every blob, each stream's words 4-byte aligned
    buf32: np.ndarray  # the same bytes as little-endian u32
    wstart: np.ndarray  # int64 [N]: first word of each stream in buf32
    wcount: np.ndarray  # int64 [N]
    rstart: np.ndarray  # int64 [N]: first raw byte in buf8
    lanes_log2: np.ndarray  # int64 [N]
    checks: np.ndarray  # uint32 [N]


def prepare_decode(blobs, mean, std, cfg: CodecConfig, threads: int, params: bool = True) -> Batch:
    """Parse and verify N streams and their statistics (everything but the entropy decoding); ``params``:
    whether to compute the per-element params on the host (the Triton decoder computes its own)."""
    if isinstance(blobs, (bytes, bytearray, memoryview)) or not hasattr(blobs, "__len__"):
        raise TypeError(f"codec.decode_batch: blobs must be a sequence of bytes, got {type(blobs).__name__}")
    n_streams = len(blobs)
    if n_streams == 0:
        raise ValueError("codec.decode_batch: no streams given (the output shape would be unknown)")
    for i, b in enumerate(blobs):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise TypeError(f"codec: blobs[{i}] must be bytes, got {type(b).__name__}")
    sizes = np.fromiter(map(len, blobs), dtype=np.int64, count=n_streams)
    h0 = parse_header(bytes(blobs[0]))
    # one compiled pass pays from ~8 streams on (the stream-by-stream predictors decode batches of one or two)
    hd = _headers_like_first(blobs, sizes, h0) if n_streams >= 8 else None
    if hd is None:  # few streams, or a header differs from the first's layout or fails a check: parse each
        hd = _headers_one_by_one(blobs, sizes, h0)
    fmt, shape = h0.fmt, h0.shape
    if (hd.digest != lanes_digest(cfg)).any():
        raise CorruptStreamError(
            "lanes codec stream was written with other codec tables, marginal or CodecConfig than the config "
            "passed to decode (digest mismatch); pass the encoder's config"
        )
    for name, v, present in (("mean", mean, h0.has_mean), ("std", std, h0.has_std)):
        if v is None and present:
            raise CorruptStreamError(f"stream was encoded with a {name}; pass the same {name} to decode")
        if v is not None and not present:
            raise CorruptStreamError(f"stream was encoded without a {name}; pass {name}=None to decode")
    xshape = (n_streams, *shape)
    m = math.prod(shape)
    nraw = raw_padded_nbytes(m, fmt) if fmt.raw_bits else 0
    wbytes = sizes - hd.data - nraw
    if (wbytes < 0).any() or (wbytes % 4).any():
        i = int(np.flatnonzero((wbytes < 0) | (wbytes % 4 != 0))[0])
        raise _corrupt(f"stream {i}: payload of {int(sizes[i] - hd.data[i])} bytes does not fit its raw bits")
    # before allocating: each element carries at least the information of a valid escape flag, so a
    # stream of w words cannot hold more than 32 w / that many elements (a corrupt shape fails here)
    cap = 32 * (int(wbytes.min()) // 4 + 1) / -math.log2(1.0 - min(cfg.escape) / 65536.0)
    if m > 2 * cap:
        raise _corrupt(f"{m} elements cannot fit in {int(wbytes.min())} bytes of words (truncated shape field?)")
    for name, v in (("mean", mean), ("std", std)):
        if isinstance(v, torch.Tensor):
            check_has_data(v, name)  # a clear error, not a fingerprint mismatch
    try:
        mean32 = _check_batch_stat(mean, "mean", xshape, False)
        std32 = _check_batch_stat(std, "std", xshape, True)
    except ValueError as err:
        raise ParameterMismatchError(
            f"the mean/std passed to decode cannot be the ones used to encode ({err}); decoding would produce garbage"
        ) from None
    sigma_bits = None
    if std32 is None:
        sigma_bits = sigma_bits_of_code(hd.sigma).astype(np.uint32)
    st = prepare_stats(shape, n_streams, mean32, std32, sigma_bits, fmt, cfg.mean_steps, threads, params)
    bad = np.flatnonzero(hd.fp != st.fps)
    if bad.size:
        raise ParameterMismatchError(
            f"the mean or std passed to decode differs from the one used to encode (fingerprint mismatch in "
            f"stream {int(bad[0])}); decoding would produce garbage"
        )
    buf8, wstart = hd.buf8, hd.start + hd.data
    buf32 = buf8.view("<u4")
    wcount = wbytes // 4
    rstart = wstart + wbytes
    wstart //= 4
    return Batch(fmt, shape, m, st, buf8, buf32, wstart, wcount, rstart, hd.lanes, hd.check)


class Headers(NamedTuple):
    """The streams of one batch joined in one buffer (``start[s]``: offset of stream ``s``; its words 4-byte
    aligned at ``start[s] + data[s]``) and their header fields, one array each."""

    buf8: np.ndarray
    start: np.ndarray  # int64
    data: np.ndarray  # int64: header length
    lanes: np.ndarray  # int64: log2 of the lane count
    sigma: np.ndarray  # int64
    digest: np.ndarray  # uint32
    fp: np.ndarray  # uint32
    check: np.ndarray  # uint32


def _join(blobs, sizes: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every blob in one byte buffer, zero pads before each so that its words (at ``data`` bytes) are 4-byte
    aligned, and a pad after the last so the buffer reads as u32: (buffer, start of each blob)."""
    # blob i starts 4-aligned minus data[i]; so blob i - 1 ends at size - data of it (mod 4), and the pad between
    # them only depends on the two headers' lengths and the earlier blob's size
    pads = np.empty(sizes.size, dtype=np.int64)
    pads[0] = -data[0] % 4
    pads[1:] = -(sizes[:-1] - data[:-1] + data[1:]) % 4
    ends = np.cumsum(pads + sizes)
    start = ends - sizes
    parts: list = [None] * (2 * sizes.size + 1)
    parts[0:-1:2] = [_PADS[p] for p in pads.tolist()]
    parts[1::2] = blobs
    parts[-1] = _PADS[-int(ends[-1]) % 4]
    return np.frombuffer(b"".join(parts), dtype=np.uint8), start


def _headers_like_first(blobs, sizes: np.ndarray, h0: Parsed) -> Headers | None:
    """`Headers` when every stream's header has the first one's layout (the usual batch: one shape, dtype and
    statistics), checked in one compiled pass (`jit.check_headers`); None if any header is not like it."""
    n = sizes.size
    data = np.full(n, h0.data_start, dtype=np.int64)
    buf8, start = _join(blobs, sizes, data)
    like = buf8[start[0] : start[0] + h0.data_start - 16].copy()
    sigma_at = -1 if h0.has_std else h0.data_start - 18
    lanes = np.empty(n, dtype=np.int64)
    sigma = np.zeros(n, dtype=np.int64)
    digest, fp, check = (np.empty(n, dtype=np.uint32) for _ in range(3))
    bad = jit.check_headers(buf8, start, sizes, like, 0x70, MAX_LANES_LOG2, sigma_at, SIGMA_CODE_MIN, SIGMA_CODE_MAX,
                            jit.CRC_TABLE, lanes, sigma, digest, fp, check)
    if bad >= 0:
        return None
    return Headers(buf8, start, data, lanes, sigma, digest, fp, check)


def _headers_one_by_one(blobs, sizes: np.ndarray, first: Parsed | None = None) -> Headers:
    """`Headers` from parsing every header on its own (``first``: the first already parsed): raises the error
    of the first bad one."""
    h0 = first if first is not None else parse_header(bytes(blobs[0]))
    heads = [h0, *(parse_header(bytes(b)) for b in blobs[1:])]
    for i, h in enumerate(heads):
        if (h.fmt, h.shape, h.has_mean, h.has_std) != (h0.fmt, h0.shape, h0.has_mean, h0.has_std):
            raise ValueError(
                f"codec.decode_batch: stream {i} holds {h.fmt.name} {h.shape} (mean {h.has_mean}, std "
                f"{h.has_std}), stream 0 {h0.fmt.name} {h0.shape}; a batch needs one shape, dtype and stats"
            )
    data = np.array([h.data_start for h in heads], dtype=np.int64)
    buf8, start = _join(blobs, sizes, data)
    fields = {name: np.array([getattr(h, name) for h in heads], dtype=dtype)
              for name, dtype in (("lanes_log2", np.int64), ("sigma", np.int64), ("digest", np.uint32),
                                  ("fp", np.uint32), ("check", np.uint32))}
    return Headers(buf8, start, data, fields["lanes_log2"], fields["sigma"], fields["digest"], fields["fp"],
                   fields["check"])







def decode_batch_impl(blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                      threads: int | None = None, verify=True) -> torch.Tensor:
    threads = check_threads(threads)
    job = DecodeJob(blobs, mean, std, cfg, out, verify, threads)
    _run(jit.decode_streams, job.args, job.streams, threads)
    return job.result(mean, std)


class DecodeJob(ChunkedJob):
    """One `decode_batch`, parsed and checked (`prepare_decode`), whose kernel work can run in pieces: chunks of
    streams that any thread may take. `start` hands chunks to background threads and returns at once;
    `finish` takes what is left on the calling thread, waits for the rest and returns the tensor (raising as
    `decode_batch`); `cancel` hands out nothing more and waits for the chunks already running. A cache uses it
    to decode layer ``l + 1`` on a second core while layer ``l`` computes (`cache.coded.LosslessCoding`)."""

    def __init__(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None, verify=True, chunks: int = 1,
                 threads: int = 1):
        bt = prepare_decode(blobs, mean, std, cfg, threads)
        fmt, m, st = bt.fmt, bt.m, bt.st
        self.streams = n_streams = bt.wstart.size
        xshape = (n_streams, *bt.shape)
        check_out(out, fmt, xshape)
        layout = out_layout(out, bt.shape) if out is not None and out.device.type == "cpu" else None
        host = out if layout is not None else torch.empty(xshape, dtype=fmt.dtype)
        if layout is None:
            layout = out_layout(host, bt.shape)
            assert layout is not None  # a contiguous tensor folds
        flat, obase, orun, ohi, olo = layout
        tab = lane_tables()
        pcum, plut = phat_tables(cfg.marginal_or_default, fmt)
        args = (bt.buf8, bt.buf32, bt.wstart, bt.wcount, bt.rstart, m, bt.lanes_log2, st.pidx, st.run, st.p_row,
                st.tid, st.cp, st.cn, st.sg, tab.cum, tab.coff, tab.size, tab.half, tab.lut, pcum, plut,
                _escape_freq(cfg, m), fmt.zero_key, fmt.pattern_bits, fmt.raw_bits, bt.checks,
                verify_mask(verify, n_streams), flat, obase, orun, ohi, olo, np.zeros(n_streams, dtype=np.int32))
        self._setup(jit.decode_streams, args, sorted({n_streams * k // max(1, chunks) for k in range(max(1, chunks) + 1)}),
                    host, out, "corrupt codec stream (lanes)", _ERRORS)


def raise_errors(err: np.ndarray) -> None:
    """`CorruptStreamError` naming the first stream whose kernel error code is not 0."""
    if err.any():
        i = int(np.flatnonzero(err)[0])
        raise _corrupt(f"stream {i}: {_ERRORS.get(int(err[i]), 'decode failed')}")


# --------------------------------------------------------------------------------------- single streams


def encode_one(x: torch.Tensor, mean, std, cfg: CodecConfig) -> bytes:
    """`codec.encode` for ``coder="lanes"``: a batch of one (the same bytes as `encode_batch` gives it)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec: x must be a torch.Tensor, got {type(x).__name__}")
    format_of(x.dtype)
    shape = tuple(int(d) for d in x.shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"codec: x has {len(shape)} dims; streams hold at most {MAX_NDIM}")
    return encode_batch_impl(x.reshape((1, *shape)), _one(check_stat(mean, "mean", shape, False), shape),
                             _one(check_stat(std, "std", shape, True), shape), cfg)[0]


def _one(arr: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | None:
    """A checked stat of one stream -> a batch of one (check_stat gives 0-d stats one dim)."""
    if arr is None:
        return None
    return arr.reshape((1, *(arr.shape if len(shape) else ())))


def _one_stats(blob, mean, std, config: CodecConfig | None):
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"codec: blob must be bytes, got {type(blob).__name__}")
    if config is None:
        raise CorruptStreamError(
            "this is a lanes codec stream: it does not carry its CodecConfig; pass the encoder's config to "
            "decode(..., config=...)"
        )
    if not isinstance(config, CodecConfig):
        raise TypeError(f"codec: config must be a CodecConfig or None, got {type(config).__name__}")
    h = parse_header(bytes(blob))
    out = []
    for name, v, present in (("mean", mean, h.has_mean), ("std", std, h.has_std)):
        if v is None and present:
            raise CorruptStreamError(f"stream was encoded with a {name}; pass the same {name} to decode")
        if v is not None and not present:
            raise CorruptStreamError(f"stream was encoded without a {name}; pass {name}=None to decode")
        if isinstance(v, torch.Tensor):
            check_has_data(v, name)  # a clear error, not a fingerprint mismatch
        try:
            arr = check_stat(v, name, h.shape, name == "std")
        except ValueError:
            raise ParameterMismatchError(
                f"the {name} passed to decode differs from the one used to encode (it does not fit the stream's "
                f"shape {h.shape}); decoding would produce garbage"
            ) from None
        out.append(_one(arr, h.shape))
    return h, out[0], out[1]


def decode_one(blob, mean, std, config: CodecConfig | None) -> torch.Tensor:
    """`codec.decode` of one lanes stream."""
    _h, m, s = _one_stats(blob, mean, std, config)
    assert config is not None
    return decode_batch_impl([blob], m, s, config)[0]


def decode_range_one(blob, start: int, stop: int, mean, std, config: CodecConfig | None) -> torch.Tensor:
    """`codec.decode_range` of one lanes stream: the stream is one window, so all of it is decoded."""
    h, m, s = _one_stats(blob, mean, std, config)
    assert config is not None
    n = math.prod(h.shape)
    check_range(start, stop, n)
    return decode_batch_impl([blob], m, s, config)[0].reshape(-1)[start:stop].clone()


def stream_info_one(blob, config: CodecConfig | None) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of a lanes stream from its checked header, verified against ``config``'s digest
    (the payload is not decoded)."""
    if config is None:
        raise CorruptStreamError("a lanes codec stream does not carry its CodecConfig; pass config=")
    head = parse_header(bytes(blob))
    if head.digest != lanes_digest(check_config(config)):
        raise CorruptStreamError(
            "lanes codec stream was written with other codec tables, marginal or CodecConfig than the config "
            "passed (digest mismatch)"
        )
    return head.fmt.dtype, head.shape
