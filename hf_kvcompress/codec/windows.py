"""The adaptive window scheduler of seed 000, in integer arithmetic so both sides agree exactly.

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

import numpy as np

from .config import CodecConfig, eighth_octaves

GAUSS_BIAS = 8
FIRST_TIER = 1  # the causal scheduler starts at medium granularity


def log_codes(f32_bits: np.ndarray) -> np.ndarray:
    """lc of float32 bit patterns (sign ignored); subnormals and zero -> 0; int32."""
    lc = ((f32_bits.astype(np.int64) & 0x7FFFFFFF) >> 20).astype(np.int32)
    return np.where(lc < 8, 0, lc)


def residual_codes(x_f32: np.ndarray, mean_f32: np.ndarray) -> np.ndarray:
    """lc(|x - mean|) with explicit flush-to-zero semantics so that any IEEE float32 unit (with or without
    FTZ/DAZ) gives the same codes: subnormal inputs and results count as zero; non-finite x -> code 2040."""
    x = _ftz(np.ascontiguousarray(x_f32, dtype=np.float32))
    m = _ftz(np.ascontiguousarray(mean_f32, dtype=np.float32))
    with np.errstate(all="ignore"):
        r = x - m
    codes = log_codes(r.view(np.uint32))
    return np.where(np.isfinite(x), codes, 2040).astype(np.int32)


def _ftz(a: np.ndarray) -> np.ndarray:
    bits = a.view(np.uint32)
    return np.where((bits & 0x7F800000) == 0, np.float32(0), a)


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


def _hysteresis(raw: list[int], h: int, start: int) -> list[int]:
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
    tiers = np.array(_hysteresis(raw, cfg.hysteresis, raw[0]))
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
