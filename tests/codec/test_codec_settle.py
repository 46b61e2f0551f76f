"""Portable statistics (`codec.params.settle`): canonical float32 means / stds code exactly like the statistics
they stand for, and values another machine computes within the bounds settle alike or are listed."""

from __future__ import annotations

import numpy as np
import pytest

from hf_kvcompress.codec.params import element_params, settle
from hf_kvcompress.codec.symbols import BF16, FP16, FP32

FORMATS = [BF16, FP16, FP32]


def _params(mean_bits: np.ndarray, std_bits: np.ndarray, fmt) -> tuple[np.ndarray, ...]:
    return tuple(element_params(mean_bits.astype(np.uint32), std_bits.astype(np.uint32), fmt))


@pytest.mark.slow  # 3 x 21 s on 2 loaded cores (2026-12-04): outside the fast tier (README)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_canonical_statistics_give_the_same_params(fmt):
    """Every low half-word of the mean under many grid values, both signs, zero / subnormal / normal stds of
    every sub-octave (W and N families): the canonical pair's params equal the original's."""
    rng = np.random.default_rng(7)
    hi = np.concatenate([rng.integers(0, 0x7F80, 24), [0, 1, 127, 128, 0x3800, 0x387F, 0x3880, 0x4780, 0x7F7F]])
    low = np.arange(1 << 16, dtype=np.int64)
    mean_bits = ((hi[:, None].astype(np.int64) << 16) | low[None, :]).reshape(-1)
    mean_bits = np.concatenate([mean_bits, mean_bits | (1 << 31)])
    for exponent in [0, 1, *rng.integers(90, 140, 2).tolist(), 250]:
        for sub in range(8):
            std_bits = np.full(mean_bits.size, (exponent << 23) | (sub << 20), dtype=np.int64)
            std_bits |= rng.integers(0, 1 << 20, mean_bits.size)
            mean, std = mean_bits.astype(np.uint32).view(np.float32), std_bits.astype(np.uint32).view(np.float32)
            canon_mean, canon_std, listed = settle(mean.astype(np.float64), std.astype(np.float64), None, None, fmt)
            assert listed.size == 0
            want = _params(mean_bits, std_bits, fmt)
            got = _params(canon_mean.view(np.uint32), canon_std.view(np.uint32), fmt)
            for a, b in zip(want, got):
                np.testing.assert_array_equal(a, b)


def _near_boundaries(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Means and stds around the places where their class changes (grid values, offset thresholds, sub-octave
    edges, zero) and elsewhere."""
    grid = rng.integers(0x3000, 0x4300, n).astype(np.int64) << 16
    edge = grid | (rng.integers(0, 32, n) * 2048)  # every multiple of 2^11 in the low half-word
    mean = edge.astype(np.uint32).view(np.float32).astype(np.float64) * rng.choice([-1.0, 1.0], n)
    mean[: n // 8] = 0.0
    std_edge = (rng.integers(100, 140, n).astype(np.int64) << 23) | (rng.integers(0, 8, n) << 20)
    std = std_edge.astype(np.uint32).view(np.float32).astype(np.float64)
    jitter = rng.uniform(-1, 1, (2, n)) * 2.0**-30
    mean, std = mean * (1 + jitter[0]) + jitter[0] * 1e-30, std * (1 + jitter[1])
    anywhere = rng.random(n) < 0.75  # most elements lie nowhere near a boundary
    mean[anywhere] = rng.standard_normal(int(anywhere.sum())) * 3
    std[anywhere] = rng.uniform(0.01, 2, int(anywhere.sum()))
    return mean, std


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_values_within_the_bounds_settle_alike_unless_listed(fmt):
    rng = np.random.default_rng(11)
    mean, std = _near_boundaries(rng, 200_000)
    mean_tol, std_tol = np.abs(mean) * 2.0**-24 + 2.0**-60, std * 2.0**-22
    canon_mean, canon_std, listed = settle(mean, std, mean_tol, std_tol, fmt)
    assert 0 < listed.size < mean.size // 2  # the quarter placed at boundaries, and few others
    unlisted = np.ones(mean.size, dtype=bool)
    unlisted[listed] = False
    for trial in range(4):
        shift = rng.uniform(-1, 1, (2, mean.size))
        if trial == 0:
            shift = np.sign(shift)  # the bounds themselves
        other_mean, other_std, _ = settle(mean + shift[0] * mean_tol, std + shift[1] * std_tol, None, None, fmt)
        same = (other_mean.view(np.uint32) == canon_mean.view(np.uint32)) & (
            other_std.view(np.uint32) == canon_std.view(np.uint32))
        assert same[unlisted].all(), np.flatnonzero(~same & unlisted)[:5]
        if trial == 0:  # the list is needed: at the bounds, listed elements settle elsewhere
            assert not same[listed].all()


def test_exact_values_are_never_listed():
    """Zero tolerance (a statistic computed exactly) lists nothing, even on a class boundary."""
    mean = np.array([0.0, -0.0, 1.0, 0.5, -2.0, 1.0 + 2.0**-12])
    std = np.array([1.0, 0.5, 0.625, 2.0**-130, 3.0, 1.0])
    _, _, listed = settle(mean, std, np.zeros(6), np.zeros(6), BF16)
    assert listed.size == 0
