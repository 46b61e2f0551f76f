"""(mean, std) -> per-element table id and key offsets, in integer arithmetic on float32 bit patterns.

This is the part a GPU decoder must reproduce bit for bit, so it uses only integer operations (no float
maths, hence no rounding-mode, FMA or flush-to-zero dependence). See docs/codec_format.md section 2 for the
derivation. One definition serves every path: `element_params_xp` is written against an array namespace
(numpy or torch, the reference of the host and of the device), `element_param` is the same function element
by element for numba (the fast host path, `element_params`, and the lanes coder), and the Triton port
(`device_triton`) reads its constants from `tables`; the tests prove all of them equal bit for bit.

Per element the output is ``(tid, cp, cn, s)``; with ``Z`` the key of +0, ``size``/``half`` of table ``tid``:

- encode: ``s0 = key - (cp if key >= Z else cn)``; the element escapes unless ``0 <= s0 < size`` and the
  key is outside ``[cn + half, cp + half)`` (the W family's "too small" gap); ``sym = s0`` if ``s > 0``
  else ``size - 1 - s0`` (mirror: tables are built for a non-negative mean or offset).
- decode: ``s0 = sym`` or ``size - 1 - sym``; ``key = s0 + (cp if s0 >= half else cn)``.

Also here: `ParamSource`, the params of any flat range of ``x`` from a compact (broadcast) mean / std, and
the spread log codes windows and side information are measured in.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numba as nb
import numpy as np
import torch

from .symbols import FP16, Format
from .tables import (
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

_MAX_FINITE_BF16 = 0x7F7F
_MAX_FINITE_FP16_13 = (30 << 7) | 127


class Params(NamedTuple):
    tid: np.ndarray  # uint16
    cp: np.ndarray  # int32
    cn: np.ndarray  # int32
    s: np.ndarray  # int8, +1 or -1


# The reference, written once against an array namespace ``xp``: numpy (host) or torch (any device). Only
# operators and ``xp.where`` / ``xp.clip`` / ``abs``, which both give the same integer results; inputs are
# int64 arrays holding float32 bit patterns as non-negative values (`_u32`).


def _u32(bits, xp):
    """float32 bit patterns (uint32 or int32 array / tensor) -> int64 with the unsigned values."""
    wide = bits.astype(np.int64) if xp is np else bits.to(torch.int64)
    return wide & 0xFFFFFFFF


def _rne_shift(v, sh, xp):
    """Round-to-nearest-even of v / 2^sh for v >= 0, 1 <= sh <= 62 (int64)."""
    sh = xp.clip(sh, 1, 62)
    return (v + (1 << (sh - 1)) - 1 + ((v >> sh) & 1)) >> sh


def _rounded_mean(mb, fmt: Format, xp):
    sign = (mb >> 31) & 1
    mag = mb & 0x7FFFFFFF
    if fmt.truncated:
        # the coded pattern is x truncated toward zero: its bin is [b, b + ulp) in magnitude, i.e. the
        # round-to-nearest bin of |x| - ulp/2. Shift the mean by half a (bfloat16-grid) ulp: 0x8000 units.
        mag = xp.clip(mag - 0x8000, 0, None)
    hi = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    frac = mag - (hi << 16)
    clamp = hi > _MAX_FINITE_BF16
    hi = xp.where(clamp, _MAX_FINITE_BF16, hi)
    frac = xp.where(clamp, 0, frac)
    if fmt is FP16:
        e8 = hi >> 7
        normal = ((e8 - 112) << 7) | (hi & 127)
        e32 = mag >> 23
        sub = xp.where(e32 >= 1, _rne_shift((mag & 0x7FFFFF) | 0x800000, 129 - e32, xp), 0)
        p = xp.where(e8 >= 143, _MAX_FINITE_FP16_13, xp.where(e8 >= 113, normal, sub))
        frac = xp.where((e8 >= 113) & (e8 < 143), frac, 0)
    else:
        p = hi
    return sign, p, p >> 7, frac


def rounded_mean(mean_bits, fmt: Format, xp=np) -> tuple:
    """float32 mean bits -> (sign, grid pattern magnitude, grid exponent field, fraction) where the grid is
    the coded pattern's value set and ``fraction`` (units of 2^-16 grid ulp, in [-2^15, 2^15]) is how far
    the (shifted) mean lies above the rounded one, in magnitude."""
    return _rounded_mean(_u32(mean_bits, xp), fmt, xp)


def _w_test(mant8, sh, j, mean_steps: int, xp):
    """The W family test and table t: ``tl = round(8 |m_hat| / s_rep)`` with ``s_rep = (17 + 2j)/16 * 2^E``
    in 2^-12 fixed point (W when ``tl < W_T_LEVELS``), and the table's t, ``|mean| / std`` in steps of
    ``1 / mean_steps`` on the 1/8 grid of the tables."""
    mrel = xp.where(sh >= 0, mant8 << xp.clip(sh, 0, 24), mant8 >> xp.clip(-sh, 0, 40))
    den = 17 + 2 * j
    tl = (mrel * 128 + den * 2048) // (den * 4096)
    tk = (mrel * (16 * mean_steps) + den * 2048) // (den * 4096)
    return tl, xp.clip(tk * (8 // mean_steps), None, W_T_LEVELS - 1)


def element_params_xp(mean_bits, std_bits, fmt: Format, mean_steps: int, radius, xp) -> tuple:
    """(tid, cp, cn, s) per element as int64 arrays of ``xp`` (numpy or torch): the arithmetic of
    docs/codec_format.md section 2, written for reading. ``radius``: the tables' R per table id, an int64 array of
    ``xp`` (on the inputs' device)."""
    z = fmt.zero_key
    sign, p, ge, frac = rounded_mean(mean_bits, fmt, xp)
    key_m = xp.where(sign == 0, z + p, z - 1 - p)
    fk = xp.where(sign == 0, frac, -frac)
    gm = p & 127
    mant8 = xp.where(ge >= 1, 128 | gm, gm)
    ge1 = xp.clip(ge, 1, None)
    ex = ge1 + fmt.exp_offset - 134  # grid value = mant8 * 2^ex
    u_exp = ge1 + fmt.exp_offset - 7  # float32 exponent field of one grid ulp at the mean

    sb = _u32(std_bits, xp)
    es = sb >> 23
    j = (sb >> 20) & 7
    lcs = sb >> 20  # std's log code: 8 * exponent field + top 3 mantissa bits

    big_e = es - 127
    tl, t = _w_test(mant8, ex - big_e + 12, j, mean_steps, xp)
    wide = (es > 0) & (tl < W_T_LEVELS)
    base = (es - fmt.exp_offset - W_LOW) * 128  # magnitude pattern of 2^(E - 12) on the grid
    tid_w = W_BASE + j * W_T_LEVELS + t
    cp_w = z + base - W_HALF
    cn_w = z - base - W_HALF
    s_w = 1 - 2 * sign

    # std = 0 or subnormal: the sharpest table (its log code would otherwise read as ~2^-127, which is
    # many ulps of a zero or subnormal mean)
    level = xp.where(es == 0, 0, xp.clip(lcs - SUB * u_exp - SUB * N_OCT_MIN, 0, N_LEVELS - 1))
    q = (abs(fk) * 16 + 32768) >> 16
    with_off = level < N_OFFSET_LEVELS
    tid_n = xp.where(with_off, level * N_OFFSETS + q, N_OFFSET_LEVELS * N_OFFSETS + level - N_OFFSET_LEVELS)
    s_n = xp.where(with_off & (fk < 0), -1, 1)
    cp_n = key_m - radius[tid_n]
    return (xp.where(wide, tid_w, tid_n), xp.where(wide, cp_w, cp_n), xp.where(wide, cn_w, cp_n),
            xp.where(wide, s_w, s_n))


def element_params_reference(mean_bits: np.ndarray, std_bits: np.ndarray, fmt: Format,
                             mean_steps: int = 8) -> Params:
    """`element_params_xp` on numpy arrays of float32 bit patterns (equal shapes). `element_params` is the
    fast equivalent (tested equal)."""
    tid, cp, cn, s = element_params_xp(mean_bits, std_bits, fmt, mean_steps, _radius64(), np)
    return Params(tid.astype(np.uint16), cp.astype(np.int32), cn.astype(np.int32), s.astype(np.int8))


# ---------------------------------------------------------------------------------------------------------
# Fast path: the same function element by element, compiled by numba (shared with the lanes coder, which
# calls `params_kernel` on its threads). The W test goes through a look-up table of the reference's integer
# formula (`t_lut`), the N family is computed only where it is needed.

SH_MIN, SH_MAX = -9, 24  # beyond these the W test's shifted mantissa saturates (see the reference)
_jit = nb.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


@functools.lru_cache(maxsize=4)
def t_lut(mean_steps: int) -> np.ndarray:
    """t of the W table (0..63), or 255 for "N regime" (the 1/8-step t reaches 64), indexed by
    ``(clip(sh) - SH_MIN) << 11 | j << 8 | mant8``: the reference's integer formula on every input."""
    sh = np.arange(SH_MIN, SH_MAX + 1, dtype=np.int64)[:, None, None]
    j = np.arange(8, dtype=np.int64)[None, :, None]
    mant8 = np.arange(256, dtype=np.int64)[None, None, :]
    tl, t = _w_test(mant8, sh, j, mean_steps, np)
    return np.where(tl < W_T_LEVELS, t, 255).astype(np.uint8).reshape(-1)


@nb.njit(cache=True, nogil=True, inline="always")
def _rne_shift_1(v, sh):
    sh = min(max(sh, 1), 62)
    return (v + (np.int64(1) << (sh - 1)) - 1 + ((v >> sh) & 1)) >> sh


@nb.njit(cache=True, nogil=True, inline="always")
def element_param(mb, sb, zero_key, exp_offset, truncated, is_fp16, radius, tlut):
    """(mean bits, std bits) as non-negative int64 -> (tid, cp, cn, s): `element_params_xp` for one element
    (the W test through its look-up table ``tlut`` = `t_lut`), tested equal to it."""
    # rounded mean (`rounded_mean`)
    sign = (mb >> 31) & 1
    mag = mb & 0x7FFFFFFF
    if truncated:
        mag = max(mag - 0x8000, 0)
    hi = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    frac = mag - (hi << 16)
    if hi > _MAX_FINITE_BF16:
        hi = _MAX_FINITE_BF16
        frac = 0
    if is_fp16:
        e8 = hi >> 7
        if e8 >= 143:
            p = np.int64(_MAX_FINITE_FP16_13)
            frac = 0
        elif e8 >= 113:
            p = ((e8 - 112) << 7) | (hi & 127)
        else:
            e32 = mag >> 23
            p = _rne_shift_1((mag & 0x7FFFFF) | 0x800000, 129 - e32) if e32 >= 1 else np.int64(0)
            frac = 0
    else:
        p = hi
    ge = p >> 7
    ge1 = max(ge, 1)
    mant8 = (p & 127) | (min(ge, 1) << 7)
    lcs = (sb >> 20) & 0xFFF  # std's log code (a -0.0 std reads as exponent 256, like the reference)
    es = lcs >> 3
    j = lcs & 7
    sh = min(max(ge1 - es + (exp_offset + 5), SH_MIN), SH_MAX)
    t = np.int64(tlut[((sh - SH_MIN) << 11) | (j << 8) | mant8])
    z = zero_key
    if t != 255 and es != 0:  # W family
        base = (es - (exp_offset + W_LOW)) << 7
        return W_BASE + (j << 6) + t, (z - W_HALF) + base, (z - W_HALF) - base, 1 - 2 * sign
    if sign == 0:
        key_m = z + p
        fk = frac
    else:
        key_m = z - 1 - p
        fk = -frac
    if es == 0:
        level = np.int64(0)
    else:
        u_exp = ge1 + (exp_offset - 7)
        level = min(max(lcs - SUB * u_exp - SUB * N_OCT_MIN, 0), N_LEVELS - 1)
    q = (abs(fk) * 16 + 32768) >> 16
    if level < N_OFFSET_LEVELS:
        tid = level * N_OFFSETS + q
        s = -1 if fk < 0 else 1
    else:
        tid = N_OFFSET_LEVELS * N_OFFSETS + level - N_OFFSET_LEVELS
        s = 1
    c = key_m - radius[tid]
    return tid, c, c, s


@_jit
def params_kernel(mean_bits, std_bits, zero_key, exp_offset, truncated, is_fp16, mean_steps, radius, tlut,
                  tid, cp, cn, sg, lo, hi):
    """`element_param` over elements ``lo..hi-1`` of equal-length uint32 arrays, into preallocated outputs
    (``mean_steps`` is in ``tlut``; kept in the signature so that callers state it)."""
    for i in range(lo, hi):
        t, a, b, s = element_param(np.int64(mean_bits[i]), np.int64(std_bits[i]), zero_key, exp_offset,
                                   truncated, is_fp16, radius, tlut)
        tid[i] = t
        cp[i] = a
        cn[i] = b
        sg[i] = s


@functools.lru_cache(maxsize=1)
def _radius64() -> np.ndarray:
    return get_tables().radius.astype(np.int64)


def element_params(mean_bits: np.ndarray, std_bits: np.ndarray, fmt: Format, mean_steps: int = 8) -> Params:
    """`element_params_reference` for finite float32 mean / std bit patterns (arrays of equal shape), fast."""
    shape = np.shape(mean_bits)
    mb = np.ascontiguousarray(mean_bits).astype(np.uint32, copy=False).reshape(-1)
    sb = np.ascontiguousarray(std_bits).astype(np.uint32, copy=False).reshape(-1)
    n = mb.size
    tid, cp = np.empty(n, dtype=np.uint16), np.empty(n, dtype=np.int32)
    cn, sg = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int8)
    params_kernel(mb, sb, fmt.zero_key, fmt.exp_offset, fmt.truncated, fmt is FP16, mean_steps, _radius64(),
                  t_lut(mean_steps), tid, cp, cn, sg, 0, n)
    return Params(*(a.reshape(shape) for a in (tid, cp, cn, sg)))


# ---------------------------------------------------------------------------------------------------------
# Spread codes, and params from compact (broadcast) statistics.


def log_codes(f32_bits: np.ndarray) -> np.ndarray:
    """lc of float32 bit patterns (sign ignored): 8 * exponent + top three mantissa bits, about
    8 * log2|v| (eighth-octaves); subnormals and zero -> 0; int32."""
    lc = ((f32_bits.astype(np.int64) & 0x7FFFFFFF) >> 20).astype(np.int32)
    return np.where(lc < 8, 0, lc)


SIGMA_CODE_MIN, SIGMA_CODE_MAX = 8, 2039  # normal, finite float32 log codes


def sigma_bits_of_code(codes: np.ndarray) -> np.ndarray:
    """A window sigma code (8 * exponent + 3 mantissa bits) -> float32 bits of its sub-octave midpoint."""
    return (codes.astype(np.int64) << 20) | (1 << 19)


class ParamSource:
    """Maps flat element ranges of a tensor of ``shape`` to the compact mean/std arrays."""

    def __init__(self, shape: tuple[int, ...], mean: np.ndarray | None, std: np.ndarray | None, fmt: Format,
                 mean_steps: int = 8):
        self.fmt = fmt
        self.mean_steps = mean_steps
        nd = len(shape)
        mean_c = np.zeros((1,) * nd, dtype=np.float32) if mean is None else mean
        std_c = None if std is None else std
        cshape = np.broadcast_shapes(mean_c.shape, std_c.shape) if std_c is not None else mean_c.shape
        self.mean_bits = np.ascontiguousarray(np.broadcast_to(mean_c, cshape)).view(np.uint32).reshape(-1)
        self.std_bits = None
        self._compact: Params | None = None
        if std_c is not None:
            self.std_bits = np.ascontiguousarray(np.broadcast_to(std_c, cshape)).view(np.uint32).reshape(-1)
        # collapse dims into groups of [extent, x stride, compact stride (0: broadcast)], innermost first;
        # neighbouring dims that are both kept or both broadcast merge into one group
        groups: list[list[int]] = []
        xs, cs = 1, 1
        for d in range(nd - 1, -1, -1):
            ext, kept = shape[d], cshape[d] == shape[d]
            if ext != 1:
                if groups and (groups[-1][2] != 0) == kept:
                    groups[-1][0] *= ext
                else:
                    groups.append([ext, xs, cs if kept else 0])
            xs *= ext
            cs *= cshape[d]
        self._groups = [(g[0], g[1], g[2]) for g in groups if g[2] != 0]
        self._identity = cshape == tuple(shape)
        self._scalar = not self._groups

    @property
    def compact(self) -> Params:
        """Params of the compact mean / std, computed on first use (a device path may never need them)."""
        if self._compact is None:
            assert self.std_bits is not None
            self._compact = element_params(self.mean_bits, self.std_bits, self.fmt, self.mean_steps)
        return self._compact

    def index(self, a: int, b: int) -> np.ndarray | slice | None:
        """Compact flat indices of elements a..b-1 (a slice when contiguous, None when scalar)."""
        if self._identity:
            return slice(a, b)
        if self._scalar:
            return None
        i = np.arange(a, b, dtype=np.int64)
        idx = np.zeros(b - a, dtype=np.int64)
        for ext, xs, cs in self._groups:
            idx += (i // xs % ext) * cs
        return idx

    @staticmethod
    def _take(arr: np.ndarray, idx, n: int) -> np.ndarray:
        if idx is None:
            return np.broadcast_to(arr[:1], (n,))
        return arr[idx]

    def params(self, a: int, b: int, sigma_bits: np.ndarray | None = None) -> Params:
        """Params of elements a..b-1; ``sigma_bits`` (per element) when std is None."""
        idx = self.index(a, b)
        n = b - a
        if self.std_bits is not None:
            c = self.compact
            return Params(*(self._take(arr, idx, n) for arr in c))
        assert sigma_bits is not None
        return element_params(self._take(self.mean_bits, idx, n), sigma_bits, self.fmt, self.mean_steps)

    def mean_f32(self, a: int, b: int) -> np.ndarray:
        return self._take(self.mean_bits, self.index(a, b), b - a).view(np.float32)

    def std_f32(self, a: int, b: int) -> np.ndarray:
        assert self.std_bits is not None
        return self._take(self.std_bits, self.index(a, b), b - a).view(np.float32)

    def std_codes(self, a: int, b: int) -> np.ndarray:
        assert self.std_bits is not None
        return log_codes(self._take(self.std_bits, self.index(a, b), b - a))

    def std_code_mean(self) -> int:
        """Integer mean of lc(std) over the compact array (equal to the mean over all elements, since
        broadcasting repeats every compact entry equally often)."""
        assert self.std_bits is not None
        codes = log_codes(self.std_bits)
        return int(codes.astype(np.int64).sum()) // max(1, codes.size)


# ---------------------------------------------------------------------------------------------------------
# Portable statistics: float32 means / stds that come out bit for bit on every CPU.
#
# A predictor whose arithmetic rounds differently on another CPU (BLAS summation order, libm's cos / pow) gives
# means that differ in their last bits. The params above read a mean only through (sign, grid pattern, offset
# level q, sign of the offset) and a std only through its log code (exponent and top three mantissa bits), so
# two means in the same class code identically. `settle` maps each float64 statistic to a canonical float32 of
# its class; the few elements whose class another machine could see differently (the value lies within the
# predictor's error bound of a class boundary) are listed with the encoder's canonical bits, and the decoder
# takes those from the list (docs/lossless.md, "Where a saved file decodes").

_MEAN_CELL = 2048  # every boundary of a mean's class lies at a multiple of 2^11 in |bits| (tested exhaustively)
_STD_CELL_BITS = 20  # a std's class is bits >> 20 (its log code `lcs`)


@nb.njit(cache=True, nogil=True, inline="always")
def _mean_class(mb, zero_key, exp_offset, truncated, is_fp16, radius, tlut):
    # the params under a zero std (the N family with offsets: every mean dependence is visible) identify the class
    t, c, _, s = element_param(mb, np.int64(0), zero_key, exp_offset, truncated, is_fp16, radius, tlut)
    return (t << 40) ^ (c << 2) ^ (s + 1)


@nb.njit(cache=True, nogil=True)
def _canonical_edge(mb, zero_key, exp_offset, truncated, is_fp16, radius, tlut):
    """The canonical mean of a multiple of 2^11 (it may belong to the cell below) or of a non-finite value."""
    mag = mb & 0x7FFFFFFF
    if mag >= 0x7F800000:
        return mb  # infinities and NaN stay as they are (the codec refuses them)
    sign = mb & 0x80000000
    centre = mag | (_MEAN_CELL // 2)
    want = _mean_class(mb, zero_key, exp_offset, truncated, is_fp16, radius, tlut)
    if _mean_class(sign | centre, zero_key, exp_offset, truncated, is_fp16, radius, tlut) == want:
        return sign | centre
    if centre >= _MEAN_CELL and _mean_class(sign | (centre - _MEAN_CELL), zero_key, exp_offset, truncated,
                                            is_fp16, radius, tlut) == want:
        return sign | (centre - _MEAN_CELL)  # a boundary point that belongs to the cell below
    return mb  # (-0.0): no canonical neighbour; kept, and listed by `settle` unless its value is exact


@nb.njit(cache=True, nogil=True, inline="always")
def _cell_centre(mb):
    # inside a cell (one class: every boundary lies on a multiple of 2^11): its centre; else -1
    mag = mb & 0x7FFFFFFF
    if mag >= 0x7F800000 or not (mag & (_MEAN_CELL - 1)):
        return np.int64(-1)
    return (mb & 0x80000000) | (mag & ~np.int64(_MEAN_CELL - 1)) | (_MEAN_CELL // 2)


@nb.njit(cache=True, nogil=True, inline="always")
def _canonical_std(sb):
    if (sb & 0x7F800000) == 0x7F800000:
        return sb
    return (sb & ~np.int64((1 << _STD_CELL_BITS) - 1)) | (1 << (_STD_CELL_BITS - 1))


@_jit
def settle_kernel(m, lo, hi, s, slo, shi, zero_key, exp_offset, truncated, is_fp16, radius, tlut, out_m, out_s,
                  ambiguous):
    """Canonical bits of float32 means ``m`` / stds ``s`` (uint32 bit arrays) and whether the range
    ``lo..hi`` (``slo..shi``) around each holds more than one class."""
    # the canonical mean is `_cell_centre`, else `_canonical_edge`, spelled out at each use: wrapped in one more
    # function (inlined or not), numba made every element ~20x slower
    for i in range(m.size):
        cm = _cell_centre(np.int64(m[i]))
        if cm < 0:
            cm = _canonical_edge(np.int64(m[i]), zero_key, exp_offset, truncated, is_fp16, radius, tlut)
        cs = _canonical_std(np.int64(s[i]))
        out_m[i] = cm
        out_s[i] = cs
        wide = False
        if lo[i] != hi[i]:  # ranges that round to one float32 (nearly all) hold one class
            for end in (lo[i], hi[i]):
                ce = _cell_centre(np.int64(end))
                if ce < 0:
                    ce = _canonical_edge(np.int64(end), zero_key, exp_offset, truncated, is_fp16, radius, tlut)
                wide = wide or ce != cm
        if slo[i] != shi[i]:
            wide = wide or _canonical_std(np.int64(slo[i])) != cs or _canonical_std(np.int64(shi[i])) != cs
        ambiguous[i] = wide


@_jit
def canonical_kernel(m, s, zero_key, exp_offset, truncated, is_fp16, radius, tlut, out_m, out_s):
    """`settle_kernel` without the ranges (the decoder's call: nothing to list)."""
    for i in range(m.size):
        cm = _cell_centre(np.int64(m[i]))
        if cm < 0:
            cm = _canonical_edge(np.int64(m[i]), zero_key, exp_offset, truncated, is_fp16, radius, tlut)
        out_m[i] = cm
        out_s[i] = _canonical_std(np.int64(s[i]))


def _bits32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32)


def settle(mean: np.ndarray, std: np.ndarray, mean_tol: np.ndarray | None, std_tol: np.ndarray | None, fmt: Format,
           mean_steps: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 ``mean`` / ``std`` (equal shapes) whose values another machine reproduces only within
    ``mean_tol`` / ``std_tol`` (float64 bounds, broadcastable) -> float32 canonical mean and std of the same
    shape (same params as the rounded statistics) and the flat indices of the elements whose class is not
    certain (another machine might settle them elsewhere: the encoder sends their canonical bits). Tolerances
    None: the canonical values only (the decoder, which takes the uncertain ones from the encoder's list)."""
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    n = mean.size
    out_m, out_s = np.empty(n, dtype=np.uint32), np.empty(n, dtype=np.uint32)
    if mean_tol is None:
        canonical_kernel(_bits32(mean), _bits32(std), fmt.zero_key, fmt.exp_offset, fmt.truncated, fmt is FP16,
                         _radius64(), t_lut(mean_steps), out_m, out_s)
        return (out_m.view(np.float32).reshape(mean.shape), out_s.view(np.float32).reshape(std.shape),
                np.zeros(0, dtype=np.int64))
    mean_tol, std_tol = np.broadcast_to(mean_tol, mean.shape), np.broadcast_to(std_tol, std.shape)
    ambiguous = np.empty(n, dtype=np.bool_)
    # an exact value (zero tolerance) is its own range: m - 0 and m + 0 differ for m = -0.0
    settle_kernel(_bits32(mean), _bits32(np.where(mean_tol > 0, mean - mean_tol, mean)),
                  _bits32(np.where(mean_tol > 0, mean + mean_tol, mean)), _bits32(std),
                  _bits32(np.where(std_tol > 0, std - std_tol, std)), _bits32(np.where(std_tol > 0, std + std_tol, std)), fmt.zero_key, fmt.exp_offset, fmt.truncated,
                  fmt is FP16, _radius64(), t_lut(mean_steps), out_m, out_s, ambiguous)
    return (out_m.view(np.float32).reshape(mean.shape), out_s.view(np.float32).reshape(std.shape),
            np.flatnonzero(ambiguous))


# ---------------------------------------------------------------------------------------------------------
# Residual log codes (the spread side information of both coders when std is None; the ans windows' scheduler)

GAUSS_BIAS = 8


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


def bits_to_f32(bits: np.ndarray, fmt: Format) -> np.ndarray:
    """Full bit patterns -> float32 values (exact conversions)."""
    if fmt is FP16:
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    if fmt.raw_bits:  # float32
        return bits.astype(np.uint32).view(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)
