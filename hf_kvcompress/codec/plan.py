"""What encoder and decoder compute alike: models, window plans, per-window spreads, checksums."""

from __future__ import annotations

import functools
import struct
import zlib

import numpy as np
import torch

from .broadcast import SIGMA_CODE_MAX, SIGMA_CODE_MIN, ParamSource, sigma_bits_of_code
from .coder import Models
from .config import CodecConfig
from .marginal import Marginal
from .model import get_tables
from .symbols import FP16, Format
from .windows import GAUSS_BIAS, CausalScheduler, adaptive_lengths, block_spread, fixed_lengths, log_codes
from .windows import residual_codes as _residual_codes

CHUNK = 1 << 15  # elements per processing chunk: keeps numpy temporaries in cache


@functools.lru_cache(maxsize=32)
def _models_cached(fmt: Format, marginal: Marginal, escape: tuple[int, int, int]) -> Models:
    model, freq = marginal.coding(fmt)
    return Models.build(get_tables(), model, freq, escape, fmt)


def models_for(fmt: Format, cfg: CodecConfig) -> Models:
    return _models_cached(fmt, cfg.marginal_or_default, cfg.escape)


def bits_to_f32(bits: np.ndarray, fmt: Format) -> np.ndarray:
    """Full bit patterns -> float32 values (exact conversions)."""
    if fmt is FP16:
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    if fmt.raw_bits:  # float32
        return bits.astype(np.uint32).view(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def residual_codes(bits: np.ndarray, src: ParamSource, a: int, b: int) -> np.ndarray:
    return _residual_codes(bits_to_f32(bits, src.fmt), src.mean_f32(a, b))


def chunks_of(lengths: np.ndarray, chunk: int = CHUNK) -> list[tuple[int, int, int, int]]:
    """Consecutive windows grouped into chunks of >= ``chunk`` elements: (w0, w1, a, b)."""
    out = []
    cum = np.concatenate([[0], np.cumsum(lengths)])
    w0 = 0
    nw = lengths.size
    while w0 < nw:
        w1 = int(np.searchsorted(cum, cum[w0] + chunk, side="left"))
        w1 = min(max(w1, w0 + 1), nw)
        out.append((w0, w1, int(cum[w0]), int(cum[w1])))
        w0 = w1
    return out


def predicted_spread(src: ParamSource, n: int, probe: int) -> np.ndarray:
    """Per probe block: integer mean of lc(std) (the predicted sigma_local)."""
    step = max(probe, (1 << 20) // probe * probe)
    parts = [block_spread(src.std_codes(a, min(n, a + step)), probe, 0) for a in range(0, n, step)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def global_spread(cfg: CodecConfig, src: ParamSource, res_codes: np.ndarray | None) -> int:
    if cfg.sigma_global is not None:
        return int(log_codes(np.array([cfg.sigma_global], dtype=np.float32).view(np.uint32))[0])
    if src.std_bits is not None:
        return src.std_code_mean()
    if res_codes is not None and res_codes.size:
        return int(res_codes.astype(np.int64).sum()) // res_codes.size + GAUSS_BIAS
    return 0


def planned_lengths(cfg: CodecConfig, n: int, src: ParamSource, g: int, res_codes: np.ndarray | None):
    """Window lengths for the non-causal modes (the encoder's view; the decoder recomputes fixed and
    predicted, reads metadata)."""
    mode = cfg.window
    if mode == "fixed":
        return fixed_lengths(n, cfg.fixed_window)
    if mode == "predicted":
        if src.std_bits is None:
            return fixed_lengths(n, cfg.short_window)
        return adaptive_lengths(predicted_spread(src, n, cfg.probe), n, cfg, g)
    if mode == "metadata":
        assert res_codes is not None
        return adaptive_lengths(block_spread(res_codes, cfg.probe, GAUSS_BIAS), n, cfg, g)
    # causal: replay the decoder's scheduler over the known residuals
    assert res_codes is not None
    sched = CausalScheduler(n, cfg, g)
    out = []
    while (length := sched.next_length()) > 0:
        out.append(length)
        sched.observe(res_codes[sched.pos : sched.pos + length])
    return np.array(out, dtype=np.int64)


def window_sigma_codes(res_codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-window sigma side information when std is None: mean residual code + bias (a geometric-mean
    estimate of the window's spread), clamped to normal float32 codes."""
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mean = np.add.reduceat(res_codes.astype(np.int64), starts) // lengths
    return np.clip(mean + GAUSS_BIAS, SIGMA_CODE_MIN, SIGMA_CODE_MAX)


def window_sigma_bits(codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.repeat(sigma_bits_of_code(codes), lengths)


def le_bits(bits: np.ndarray, fmt: Format) -> bytes:
    """Bit patterns as little-endian 2- or 4-byte words: the bytes the checksums cover."""
    return bits.astype("<u4" if fmt.dtype == torch.float32 else "<u2").tobytes()


def data_crc(bits: np.ndarray, fmt: Format) -> int:
    return zlib.crc32(le_bits(bits, fmt))


def window_seed(version: int, stream_crc: int, w: int) -> int:
    """Start value of window ``w``'s CRC. From format version 2 on it is bound to the stream (its data CRC)
    and the window's index, so a window spliced in from another stream or position fails even where only
    that window is decoded (`decode_range`); version 1 started every window at 0."""
    return zlib.crc32(struct.pack("<IQ", stream_crc, w)) if version >= 2 else 0


def window_crc(payload, bits: np.ndarray, fmt: Format, seed: int) -> int:
    """CRC32 of a window's payload followed by its decoded bits (so a payload that decodes to other values
    is caught even if its bytes were re-checksummed), started at ``seed`` (`window_seed`)."""
    return zlib.crc32(le_bits(bits, fmt), zlib.crc32(payload, seed))


def window_crcs_of(buf, offsets: np.ndarray, bits: np.ndarray, lengths: np.ndarray, fmt: Format, version: int,
                   stream_crc: int, first: int = 0) -> np.ndarray:
    """`window_crc` of windows ``first, first + 1, ...`` whose payloads lie at ``offsets`` in ``buf``."""
    out = np.empty(lengths.size, dtype=np.uint32)
    pos = 0
    for w, m in enumerate(lengths.tolist()):
        lo, hi = int(offsets[w]), int(offsets[w + 1])
        out[w] = window_crc(buf[lo:hi], bits[pos : pos + m], fmt, window_seed(version, stream_crc, first + w))
        pos += m
    return out
