"""(mean, std) -> per-element table id and key offsets, in integer arithmetic on float32 bit patterns.

This is the part a GPU decoder must reproduce bit for bit, so it uses only integer operations (no float
maths, hence no rounding-mode, FMA or flush-to-zero dependence). See docs/codec.md for the derivation.

Per element the output is ``(tid, cp, cn, s)``; with ``Z`` the key of +0, ``size``/``half`` of table ``tid``:

- encode: ``s0 = key - (cp if key >= Z else cn)``; the element escapes unless ``0 <= s0 < size`` and the
  key is outside ``[cn + half, cp + half)`` (the W family's "too small" gap); ``sym = s0`` if ``s > 0``
  else ``size - 1 - s0`` (mirror: tables are built for a non-negative mean or offset).
- decode: ``s0 = sym`` or ``size - 1 - sym``; ``key = s0 + (cp if s0 >= half else cn)``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from .model import (
    N_LEVELS,
    N_OCT_MIN,
    N_OFFSET_LEVELS,
    N_OFFSETS,
    SUB,
    W_BASE,
    W_HALF,
    W_LOW,
    W_T_LEVELS,
    get_tables,
)
from .symbols import FP16, Format

_MAX_FINITE_BF16 = 0x7F7F
_MAX_FINITE_FP16_13 = (30 << 7) | 127


class Params(NamedTuple):
    tid: np.ndarray  # uint16
    cp: np.ndarray  # int32
    cn: np.ndarray  # int32
    s: np.ndarray  # int8, +1 or -1


def _rne_shift(v: np.ndarray, sh: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of v / 2^sh for v >= 0, 1 <= sh <= 62 (int64)."""
    sh = np.clip(sh, 1, 62)
    return (v + (np.int64(1) << (sh - 1)) - 1 + ((v >> sh) & 1)) >> sh


def rounded_mean(mean_bits: np.ndarray, fmt: Format) -> tuple[np.ndarray, ...]:
    """float32 mean bits -> (sign, grid pattern magnitude, grid exponent field, fraction) where the grid is
    the coded pattern's value set and ``fraction`` (units of 2^-16 grid ulp, in [-2^15, 2^15]) is how far
    the (shifted) mean lies above the rounded one, in magnitude."""
    mb = mean_bits.astype(np.int64)
    sign = (mb >> 31) & 1
    mag = mb & 0x7FFFFFFF
    if fmt.truncated:
        # the coded pattern is x truncated toward zero: its bin is [b, b + ulp) in magnitude, i.e. the
        # round-to-nearest bin of |x| - ulp/2. Shift the mean by half a (bfloat16-grid) ulp: 0x8000 units.
        mag = np.maximum(mag - 0x8000, 0)
    hi = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    frac = mag - (hi << 16)
    clamp = hi > _MAX_FINITE_BF16
    hi = np.where(clamp, _MAX_FINITE_BF16, hi)
    frac = np.where(clamp, 0, frac)
    if fmt is FP16:
        e8 = hi >> 7
        normal = ((e8 - 112) << 7) | (hi & 127)
        e32 = mag >> 23
        sub = np.where(e32 >= 1, _rne_shift((mag & 0x7FFFFF) | 0x800000, 129 - e32), 0)
        p = np.where(e8 >= 143, _MAX_FINITE_FP16_13, np.where(e8 >= 113, normal, sub))
        frac = np.where((e8 >= 113) & (e8 < 143), frac, 0)
    else:
        p = hi
    return sign, p, p >> 7, frac


def element_params_reference(mean_bits: np.ndarray, std_bits: np.ndarray, fmt: Format,
                             mean_steps: int = 8) -> Params:
    """Table id and key offsets for every element (arrays of equal shape, float32 bit patterns): the
    arithmetic of docs/codec.md section 2, written for reading. `element_params` is the fast equivalent
    (tested equal); the GPU kernels port this one."""
    t = get_tables()
    z = fmt.zero_key
    sign, p, ge, frac = rounded_mean(mean_bits, fmt)
    key_m = np.where(sign == 0, z + p, z - 1 - p)
    fk = np.where(sign == 0, frac, -frac)
    gm = p & 127
    mant8 = np.where(ge >= 1, 128 | gm, gm)
    ge1 = np.maximum(ge, 1)
    ex = ge1 + fmt.exp_offset - 134  # grid value = mant8 * 2^ex
    u_exp = ge1 + fmt.exp_offset - 7  # float32 exponent field of one grid ulp at the mean

    sb = std_bits.astype(np.int64)
    es = sb >> 23
    j = (sb >> 20) & 7
    lcs = sb >> 20  # std's log code: 8 * exponent field + top 3 mantissa bits

    # W family test: t = round(8 |m_hat| / s_rep), s_rep = (17 + 2j)/16 * 2^E, in 2^-12 fixed point
    big_e = es - 127
    sh = ex - big_e + 12
    mrel = np.where(sh >= 0, mant8 << np.clip(sh, 0, 24), mant8 >> np.clip(-sh, 0, 40))
    den = 17 + 2 * j
    tl = (mrel * 128 + den * 2048) // (den * 4096)
    wide = (es > 0) & (tl < W_T_LEVELS)

    base = (es - fmt.exp_offset - W_LOW) * 128  # magnitude pattern of 2^(E - 12) on the grid
    # the table's t: |mean| / std in steps of 1 / mean_steps, on the 1/8 grid of the tables
    tk = (mrel * (16 * mean_steps) + den * 2048) // (den * 4096)
    tid_w = W_BASE + j * W_T_LEVELS + np.minimum(tk * (8 // mean_steps), W_T_LEVELS - 1)
    cp_w = z + base - W_HALF
    cn_w = z - base - W_HALF
    s_w = 1 - 2 * sign

    # std = 0 or subnormal: the sharpest table (its log code would otherwise read as ~2^-127, which is
    # many ulps of a zero or subnormal mean)
    level = np.where(es == 0, 0, np.clip(lcs - SUB * u_exp - SUB * N_OCT_MIN, 0, N_LEVELS - 1))
    q = (np.abs(fk) * 16 + 32768) >> 16
    with_off = level < N_OFFSET_LEVELS
    tid_n = np.where(with_off, level * N_OFFSETS + q, N_OFFSET_LEVELS * N_OFFSETS + level - N_OFFSET_LEVELS)
    s_n = np.where(with_off & (fk < 0), -1, 1)
    cp_n = key_m - t.radius[tid_n]

    tid = np.where(wide, tid_w, tid_n).astype(np.uint16)
    cp = np.where(wide, cp_w, cp_n).astype(np.int32)
    cn = np.where(wide, cn_w, cp_n).astype(np.int32)
    s = np.where(wide, s_w, s_n).astype(np.int8)
    return Params(tid, cp, cn, s)


# ---------------------------------------------------------------------------------------------------------
# Fast path: the same function with fewer, cheaper numpy passes (int32 lanes, one table look-up for the W
# test, the N family computed only on the elements that need it). Equality with the reference is tested on
# random and edge-case bit patterns; keep the two in step.

SH_MIN, SH_MAX = -9, 24  # beyond these the W test's shifted mantissa saturates (see the reference)


@functools.lru_cache(maxsize=4)
def t_lut(mean_steps: int) -> np.ndarray:
    """t of the W table (0..63), or 255 for "N regime" (the 1/8-step t reaches 64), indexed by
    ``(clip(sh) - SH_MIN) << 11 | j << 8 | mant8``: the reference's integer formula on every input."""
    sh = np.arange(SH_MIN, SH_MAX + 1, dtype=np.int64)[:, None, None]
    j = np.arange(8, dtype=np.int64)[None, :, None]
    mant8 = np.arange(256, dtype=np.int64)[None, None, :]
    mrel = np.where(sh >= 0, mant8 << np.clip(sh, 0, 24), mant8 >> np.clip(-sh, 0, 40))
    den = 17 + 2 * j
    tl = (mrel * 128 + den * 2048) // (den * 4096)
    tk = (mrel * (16 * mean_steps) + den * 2048) // (den * 4096)
    t = np.minimum(tk * (8 // mean_steps), W_T_LEVELS - 1)
    return np.where(tl < W_T_LEVELS, t, 255).astype(np.uint8).reshape(-1)


def element_params(mean_bits: np.ndarray, std_bits: np.ndarray, fmt: Format, mean_steps: int = 8) -> Params:
    """`element_params_reference` for finite float32 mean / std bit patterns, fast."""
    mean_bits = np.ascontiguousarray(mean_bits).astype(np.uint32, copy=False)
    std_bits = np.ascontiguousarray(std_bits).astype(np.uint32, copy=False)
    z = fmt.zero_key
    if fmt is FP16:  # rarely used: the reference's rounding, then the same fast tail
        sign64, p64, _, frac64 = rounded_mean(mean_bits, fmt)
        neg = sign64.astype(bool)
        p = p64.astype(np.int32)
        frac = frac64.astype(np.int32)
    else:
        m = mean_bits.view(np.int32)
        neg = m < 0
        mag = m & 0x7FFFFFFF  # finite: <= 0x7F7FFFFF, so the additions below stay inside int32
        if fmt.truncated:
            mag = np.maximum(mag - 0x8000, 0)
        p = (mag + (0x7FFF + ((mag >> 16) & 1))) >> 16
        frac = None
        if p.size and p.max() > _MAX_FINITE_BF16:  # |mean| beyond the largest finite value: clamp
            frac = np.where(p > _MAX_FINITE_BF16, 0, mag - (p << 16))
            p = np.minimum(p, _MAX_FINITE_BF16)
    ge = p >> 7
    ge1 = np.maximum(ge, 1)
    mant8 = (p & 127) | (np.minimum(ge, 1) << 7)
    s = std_bits.view(np.int32)
    lcs = (s >> 20) & 0xFFF  # unsigned semantics (a -0.0 std reads as exponent 256, like the reference)
    es = lcs >> 3
    j = lcs & 7
    sh = np.clip(ge1 - es + (fmt.exp_offset + 5), SH_MIN, SH_MAX)
    t = t_lut(mean_steps)[((sh - SH_MIN) << 11) | (j << 8) | mant8]
    narrow = (t == 255) | (es == 0)

    tid = (W_BASE + (j << 6) + t).astype(np.uint16)
    base = (es - (fmt.exp_offset + W_LOW)) << 7
    cp = (z - W_HALF) + base
    cn = (z - W_HALF) - base
    sg = (1 - 2 * neg.view(np.int8)).astype(np.int8)  # +1 / -1 (np.where on bool is 5x slower here)
    idx = np.flatnonzero(narrow)
    if idx.size:
        pn, gn, negn = p[idx], ge1[idx], neg[idx]
        if frac is None:  # only the narrow elements need the sub-ulp offset
            magn = mag[idx]
            fr = magn - (pn << 16)
        else:
            fr = frac[idx]
        key_m = np.where(negn, z - 1 - pn, z + pn)
        fk = np.where(negn, -fr, fr)
        u_exp = gn + (fmt.exp_offset - 7)
        level = np.clip(lcs[idx] - SUB * u_exp - SUB * N_OCT_MIN, 0, N_LEVELS - 1)
        level[es[idx] == 0] = 0
        q = (np.abs(fk) * 16 + 32768) >> 16
        with_off = level < N_OFFSET_LEVELS
        tid_n = np.where(with_off, level * N_OFFSETS + q, N_OFFSET_LEVELS * N_OFFSETS - N_OFFSET_LEVELS + level)
        cp_n = key_m - get_tables().radius[tid_n]
        tid[idx] = tid_n
        cp[idx] = cp_n
        cn[idx] = cp_n
        sg[idx] = np.where(with_off & (fk < 0), -1, 1)
    return Params(tid, cp.astype(np.int32, copy=False), cn.astype(np.int32, copy=False), sg)
