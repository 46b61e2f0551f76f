"""Bit-reproducible float64 ``exp``, ``erfc``, ``sin`` and ``cos`` in numpy: the coding tables, and the `grid`
predictor's RoPE tables and surprise multipliers.

Why not ``math.erfc`` / ``torch.special.erfc`` / numpy's ``exp``: their results may differ in the last bit
between libms, CPUs and SIMD paths, and one flipped bit can flip an integer table frequency, which breaks
decoding on another machine. These ports of fdlibm (the algorithms Java's ``StrictMath`` pins down) use only
IEEE-754 ``+ - * /``, comparisons and exponent scaling, each correctly rounded in numpy on every platform
(numpy does not contract ``a*b+c`` into FMA). Nothing here produces a subnormal: ``exp`` of arguments below
``EXP_FLOOR`` is defined as 0, so flush-to-zero/denormals-are-zero modes cannot change a result.

fdlibm: Copyright (C) 1993 by Sun Microsystems, Inc. All rights reserved. Developed at SunPro, a Sun
Microsystems, Inc. business. Permission to use, copy, modify, and distribute this software is freely granted,
provided that this notice is preserved.
"""

from __future__ import annotations

import numpy as np

# exp(x) for x < EXP_FLOOR is defined as 0 (e^-700 ~ 1e-304 is still a normal double, so no subnormals).
EXP_FLOOR = -700.0

_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_P1 = 1.66666666666666019037e-01
_P2 = -2.77777777770155933842e-03
_P3 = 6.61375632143793436117e-05
_P4 = -1.65339022054652515390e-06
_P5 = 4.13813679705723846039e-08


def det_exp(x: np.ndarray) -> np.ndarray:
    """fdlibm ``e_exp.c`` for finite float64 ``x <= 700``; ``x < EXP_FLOOR`` gives exactly 0."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    # k = round(x / ln2) as fdlibm does it (truncate x/ln2 +- 0.5), k = +-1 on (0.5 ln2, 1.5 ln2]
    k = np.trunc(_INV_LN2 * x + np.where(x < 0, -0.5, 0.5))
    k = np.where(ax < 1.0397207708399179, np.sign(x), k)  # 1.5*ln2 (fdlibm compares high words: same split)
    k = np.where(ax <= 0.34657359027997264, 0.0, k)  # 0.5*ln2
    hi = x - k * _LN2_HI  # exact: k*ln2_hi has trailing zero bits
    lo = k * _LN2_LO
    r = hi - lo
    rr = r * r
    c = r - rr * (_P1 + rr * (_P2 + rr * (_P3 + rr * (_P4 + rr * _P5))))
    y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)
    # y * 2^k with 2^k built from its bits: exact, since y in (0.7, 1.5) and k >= -1010 keep it normal
    k = np.where(x < EXP_FLOOR, 0, k.astype(np.int64))
    scale = ((k + 1023) << 52).view(np.float64)
    return np.where(x < EXP_FLOOR, 0.0, y * scale)


_ERX = 8.45062911510467529297e-01
_PP = (1.28379167095512558561e-01, -3.25042107247001499370e-01, -2.84817495755985104766e-02,
       -5.77027029648944159157e-03, -2.37630166566501626084e-05)
_QQ = (3.97917223959155352819e-01, 6.50222499887672944485e-02, 5.08130628187576562776e-03,
       1.32494738004321644526e-04, -3.96022827877536812320e-06)
_PA = (-2.36211856075265944077e-03, 4.14856118683748331666e-01, -3.72207876035701323847e-01,
       3.18346619901161753674e-01, -1.10894694282396677476e-01, 3.54783043256182359371e-02,
       -2.16637559486879084300e-03)
_QA = (1.06420880400844228286e-01, 5.40397917702171048937e-01, 7.18286544141962662868e-02,
       1.26171219808761642112e-01, 1.36370839120290507362e-02, 1.19844998467991074170e-02)
_RA = (-9.86494403484714822705e-03, -6.93858572707181764372e-01, -1.05586262253232909814e01,
       -6.23753324503260060396e01, -1.62396669462573470355e02, -1.84605092906711035994e02,
       -8.12874355063065934246e01, -9.81432934416914548592e00)
_SA = (1.96512716674392571292e01, 1.37657754143519042600e02, 4.34565877475229228821e02,
       6.45387271733267880336e02, 4.29008140027567833386e02, 1.08635005541779435134e02,
       6.57024977031928170135e00, -6.04244152148580987438e-02)
_RB = (-9.86494292470009928597e-03, -7.99283237680523006574e-01, -1.77579549177547519889e01,
       -1.60636384855821916062e02, -6.37566443368389627722e02, -1.02509513161107724954e03,
       -4.83519191608651397019e02)
_SB = (3.03380607434824582924e01, 3.25792512996573918826e02, 1.53672958608443695994e03,
       3.19985821950859553908e03, 2.55305040643316442583e03, 4.74528541206955367215e02,
       -2.24409524465858183362e01)


def _horner(s: np.ndarray, coeffs: tuple[float, ...], lead_one: bool) -> np.ndarray:
    """c0 + s*(c1 + s*(...)) in fdlibm's evaluation order; ``lead_one`` prepends a constant 1."""
    acc = np.full_like(s, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = c + s * acc
    return 1.0 + s * acc if lead_one else acc


def det_erfc_nonneg(x: np.ndarray) -> np.ndarray:
    """fdlibm ``erfc`` for finite ``x >= 0`` (the only branch the tables need; callers fold signs)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    # |x| < 0.84375 (fdlibm: high word < 0x3feb0000)
    m = x < 0.84375
    if m.any():
        xs = x[m]
        z = xs * xs
        y = _horner(z, _PP, False) / _horner(z, _QQ, True)
        small = xs < 0.25
        out_m = np.where(small, 1.0 - (xs + xs * y), 0.5 - (xs * y + (xs - 0.5)))
        out_m = np.where(xs < 2.0**-56, 1.0 - xs, out_m)
        out[m] = out_m
    # 0.84375 <= x < 1.25
    m = (x >= 0.84375) & (x < 1.25)
    if m.any():
        s = x[m] - 1.0
        p = _horner(s, _PA, False)
        q = _horner(s, _QA, True)
        out[m] = (1.0 - _ERX) - p / q
    # 1.25 <= x < 28: erfc = exp(-z*z - 0.5625) * exp((z - x)(z + x) + R/S) / x, z = x with low word zeroed
    m = (x >= 1.25) & (x < 28.0)
    if m.any():
        xs = x[m]
        s = 1.0 / (xs * xs)
        near = xs < 2.857142857142857  # 1/0.35 (fdlibm: high word < 0x4006DB6D)
        r = np.where(near, _horner(s, _RA, False), _horner(s, _RB, False))
        sd = np.where(near, _horner(s, _SA, True), _horner(s, _SB, True))
        z = (xs.view(np.uint64) & np.uint64(0xFFFFFFFF00000000)).view(np.float64)
        e = det_exp(-z * z - 0.5625) * det_exp((z - xs) * (z + xs) + r / sd)
        out[m] = e / xs
    return out  # x >= 28: 0


# ---------------------------------------------------------------------- sin / cos (fdlibm k_sin.c, k_cos.c, e_rem_pio2.c)


def _bits(word: int) -> float:
    """The float64 whose IEEE bits are ``word`` (fdlibm states its constants by their bits)."""
    return float(np.array([word], dtype=np.uint64).view(np.float64)[0])


# pi/2 in three 33-bit parts and their tails (e_rem_pio2.c): n * part is exact for n < 2^20
_INV_PIO2 = _bits(0x3FE45F306DC9C883)
_PIO2 = ((_bits(0x3FF921FB54400000), _bits(0x3DD0B4611A626331)),
         (_bits(0x3DD0B4611A600000), _bits(0x3BA3198A2E037073)),
         (_bits(0x3BA3198A2E000000), _bits(0x397B839A252049C1)))
_S = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
      2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
_C = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
      -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)

#: the largest |x| `det_sincos` takes (~2^20 pi/2 = 1,647,099): fdlibm's "medium" range reduction (high word
#: <= 0x413921fb), where n < 2^20 keeps every n * (33-bit part of pi/2) exact; beyond it fdlibm switches to the
#: Payne-Hanek reduction, which is not ported
SINCOS_LIMIT = _bits(0x413921FB00000000)


def _exponent(x: np.ndarray) -> np.ndarray:
    """The biased IEEE exponent of float64 ``x`` (fdlibm's ``(high word >> 20) & 0x7ff``)."""
    return ((x.view(np.uint64) >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64)


def _rem_pio2(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``t >= 0`` as ``n pi/2 + (y0 + y1)``: fdlibm's medium case (Cody-Waite with a second and third part of pi/2
    where the first cancels more than 16 / 49 bits); |t| <= pi/4 gives n = 0, y0 = t, y1 = 0."""
    n = np.trunc(t * _INV_PIO2 + 0.5)
    j = _exponent(t)
    (p1, p1t), (p2, p2t), (p3, p3t) = _PIO2
    r = t - n * p1
    w = n * p1t
    y0 = r - w
    second = (j - _exponent(y0)) > 16
    t2 = r
    r2 = t2 - n * p2
    w2 = n * p2t - ((t2 - r2) - n * p2)
    y02 = r2 - w2
    third = second & ((j - _exponent(y02)) > 49)
    t3 = r2
    r3 = t3 - n * p3
    w3 = n * p3t - ((t3 - r3) - n * p3)
    y03 = r3 - w3
    r = np.where(third, r3, np.where(second, r2, r))
    w = np.where(third, w3, np.where(second, w2, w))
    y0 = np.where(third, y03, np.where(second, y02, y0))
    y1 = (r - y0) - w
    small = t <= _bits(0x3FE921FB54442D18)  # pi/4: no reduction
    return (np.where(small, 0.0, n).astype(np.int64), np.where(small, t, y0), np.where(small, 0.0, y1))


def _kernel_sin(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """fdlibm ``__kernel_sin(x, y, iy=1)`` on |x| <= pi/4 (the tail form serves y = 0 too)."""
    z = x * x
    v = z * x
    r = _S[1] + z * (_S[2] + z * (_S[3] + z * (_S[4] + z * _S[5])))
    return x - ((z * (0.5 * y - v * r) - y) - v * _S[0])


def _kernel_cos(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """fdlibm ``__kernel_cos`` on |x| <= pi/4."""
    z = x * x
    r = z * (_C[0] + z * (_C[1] + z * (_C[2] + z * (_C[3] + z * (_C[4] + z * _C[5])))))
    ax = np.abs(x)
    # qx: x/4 with the low word cleared (fdlibm INSERT_WORDS(qx, ix - 0x00200000, 0)), 0.28125 above 0.78125
    qx = (ax.view(np.uint64) & np.uint64(0xFFFFFFFF00000000)).view(np.float64) * 0.25
    qx = np.where(ax > _bits(0x3FE9000000000000), 0.28125, qx)
    near = 1.0 - (0.5 * z - (z * r - x * y))
    far = (1.0 - qx) - ((0.5 * z - qx) - (z * r - x * y))
    return np.where(ax < _bits(0x3FD3333300000000), near, far)  # |x| < 0.3


def det_sincos(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sin x, cos x)`` for float64 ``|x| <= SINCOS_LIMIT`` (within an ulp of the true values, fdlibm's
    algorithm), the same bits on every platform; ValueError for non-finite or larger arguments."""
    x = np.asarray(x, dtype=np.float64)
    t = np.abs(x)
    if not bool(np.all(t <= SINCOS_LIMIT)):  # NaN fails the comparison too
        raise ValueError(f"det_sincos: arguments must be finite with |x| <= {SINCOS_LIMIT:.6g} (fdlibm's medium "
                         "range reduction), got one beyond")
    n, y0, y1 = _rem_pio2(t)
    s, c = _kernel_sin(y0, y1), _kernel_cos(y0, y1)
    quadrant = n & 3
    sin = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [s, c, -s], -c)
    cos = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [c, -s, -c], s)
    return np.where(np.signbit(x), -sin, sin), cos  # sin(-0.0) = -0.0
