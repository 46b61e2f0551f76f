"""Windows: the adaptive window scheduler (integer arithmetic, so both sides agree exactly), the window plans
of every mode, per-window spread side information and the window checksums: what encoder and decoder
compute alike.

Spread is measured in *log codes*: ``lc(v) = (float32 bits of |v|) >> 20``, i.e. 8 * exponent + top three
mantissa bits, about 8 * log2|v| (eighth-octaves); zero and subnormals give 0. Per probe block of ``probe``
elements the scheduler takes the integer mean of the element codes:

- from residuals ``r = x - mean`` (metadata, causal): mean lc(|r|) + `GAUSS_BIAS` (for Gaussian r the mean
  code sits 7.35 below lc(sigma)), an estimate of the block's sigma_local;
- from ``std`` (predicted): mean lc(std), the geometric mean of the predicted spread.

A block is high locality when its spread is below ``g + 8 log2(thresholds[0])``, medium below
``g + 8 log2(thresholds[1])``, else low (``g``: sigma_global's code). Tiers switch after ``hysteresis``
consecutive disagreeing blocks; each run of one tier is cut into near-equal windows of at most the tier's
target length (multiples of ``min_window``).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from ..codec_config import CodecConfig, eighth_octaves
from ..params import (
    GAUSS_BIAS,
    SIGMA_CODE_MAX,
    SIGMA_CODE_MIN,
    ParamSource,
    bits_to_f32,
    log_codes,
    residual_codes,
    sigma_bits_of_code,
)
from ..symbols import Format

FIRST_TIER = 1  # the causal scheduler starts at medium granularity

def block_spread(codes: np.ndarray, probe: int, bias: int) -> np.ndarray:
    """Integer mean code per probe block (last block may be partial) + bias; int64."""
    n = codes.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.arange(0, n, probe)
    sums = np.add.reduceat(codes.astype(np.int64), starts)
    counts = np.diff(np.append(starts, n))
    return sums // counts + bias


class Thresholds:
    """The config's ratios as integer offsets (eighth-octaves) from sigma_global's code."""

    def __init__(self, cfg: CodecConfig, g: int) -> None:
        self.high = g + eighth_octaves(cfg.thresholds[0])
        self.medium = g + eighth_octaves(cfg.thresholds[1])
        self.smooth = g + eighth_octaves(cfg.tau_smooth)

    def raw_tier(self, spread: np.ndarray) -> np.ndarray:
        return np.where(spread < self.high, 2, np.where(spread < self.medium, 1, 0))


def hysteresis_tiers(raw: list[int], h: int, start: int) -> list[int]:
    cur, count, out = start, 0, []
    for r in raw:
        if r == cur:
            count = 0
        else:
            count += 1
            if count >= h:
                cur, count = r, 0
        out.append(cur)
    return out


def _target(cfg: CodecConfig, th: Thresholds, tier: int, mean_spread: int) -> int:
    t = cfg.tier_windows[tier]
    if tier == 1 and mean_spread >= th.smooth:  # rough medium region: half the window
        t = max(cfg.min_window, (t // 2) // cfg.min_window * cfg.min_window)
    return t


def _split(length: int, target: int, w_min: int) -> list[int]:
    """Cut a run into k = ceil(length / target) near-equal windows of whole ``w_min`` units (the first
    ones one unit longer where needed); the sub-unit remainder joins the last window."""
    k = max(1, -(-length // target))
    units, rem = divmod(length, w_min)
    k = min(k, max(1, units))
    base, extra = divmod(units, k)
    out = [(base + 1) * w_min] * extra + [base * w_min] * (k - extra)
    out[-1] += rem
    return out


def fixed_lengths(n: int, size: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    lengths = np.full(-(-n // size), size, dtype=np.int64)
    lengths[-1] = n - size * (lengths.size - 1)
    return lengths


def adaptive_lengths(spread: np.ndarray, n: int, cfg: CodecConfig, g: int) -> np.ndarray:
    """Window lengths from per-block spreads (metadata and predicted modes)."""
    if n < max(cfg.short_elements, 1) or spread.size == 0:
        return fixed_lengths(n, cfg.short_window)
    th = Thresholds(cfg, g)
    raw = th.raw_tier(spread).tolist()
    tiers = np.array(hysteresis_tiers(raw, cfg.hysteresis, raw[0]))
    cuts = np.flatnonzero(np.diff(tiers)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [tiers.size]])
    out: list[int] = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        tier = int(tiers[a])
        mean_spread = int(spread[a:b].sum()) // (b - a)
        length = min(b * cfg.probe, n) - a * cfg.probe
        out.extend(_split(length, _target(cfg, th, tier, mean_spread), cfg.min_window))
    return np.array(out, dtype=np.int64)


class CausalScheduler:
    """Causal mode: the next window's length from the spreads of blocks already decoded.

    Feed it the residual codes of each window as it is coded/decoded (`observe`); `next_length` then
    depends only on what came before, so the decoder can follow. Boundary discovery is serial.
    """

    def __init__(self, n: int, cfg: CodecConfig, g: int) -> None:
        self.n, self.cfg, self.th = n, cfg, Thresholds(cfg, g)
        self.short = n < max(cfg.short_elements, 1)
        self.pos = 0
        self.tier, self.count = FIRST_TIER, 0
        self.last_spread = g
        self._pending = np.zeros(0, dtype=np.int32)  # codes of a not yet complete probe block

    def next_length(self) -> int:
        return self._length_at(self.pos)

    def _length_at(self, pos: int) -> int:
        left = self.n - pos
        if left <= 0:
            return 0
        if self.short:
            length = self.cfg.short_window
        else:
            length = _target(self.cfg, self.th, self.tier, self.last_spread)
        if left - length < self.cfg.min_window:  # no sliver at the end
            length = left
        return min(length, left)

    def speculate(self, max_windows: int, max_elements: int) -> list[int]:
        """Lengths of the next windows if nothing observed changed the state (tier switches are rare,
        so a decoder can decode these in one batch and keep the prefix the real schedule confirms)."""
        out: list[int] = []
        pos, total = self.pos, 0
        while len(out) < max_windows and total < max_elements and (length := self._length_at(pos)) > 0:
            out.append(length)
            pos += length
            total += length
        return out

    def observe(self, codes: np.ndarray) -> None:
        """Residual codes of the window just coded (in order)."""
        self.pos += codes.size
        if self.short:
            return
        buf = np.concatenate([self._pending, codes])
        full = buf.size // self.cfg.probe * self.cfg.probe
        self._pending = buf[full:]
        if full == 0:
            return
        spread = block_spread(buf[:full], self.cfg.probe, GAUSS_BIAS)
        raw = self.th.raw_tier(spread).tolist()
        for r in raw:
            if r == self.tier:
                self.count = 0
            else:
                self.count += 1
                if self.count >= self.cfg.hysteresis:
                    self.tier, self.count = r, 0
        self.last_spread = int(spread[-1])


# ---------------------------------------------------------------------------------------------------------
# Plans, side information and checksums

CHUNK = 1 << 15  # elements per processing chunk: keeps numpy temporaries in cache


def source_residual_codes(bits: np.ndarray, src: ParamSource, a: int, b: int) -> np.ndarray:
    """`residual_codes` of elements a..b-1 (bit patterns ``bits``) against their mean in ``src``."""
    return residual_codes(bits_to_f32(bits, src.fmt), src.mean_f32(a, b))


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
