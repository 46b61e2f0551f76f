"""Bit-reproducible float64 ``exp`` and ``erfc`` in numpy, for building the coding tables.

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
