"""(mean, std) -> table id: integer arithmetic that agrees with the float semantics it stands for."""

from __future__ import annotations

import numpy as np
import torch

from hf_kvcompress.codec.params import element_params, rounded_mean
from hf_kvcompress.codec.symbols import BF16, FP16, FP32
from hf_kvcompress.codec.tables import W_BASE, get_tables


def _f32_bits(v):
    return np.asarray(v, dtype=np.float32).view(np.uint32)


def _random_means(n=200000, seed=0):
    rng = np.random.default_rng(seed)
    m = (rng.standard_normal(n) * 10.0 ** rng.uniform(-40, 38, n)).astype(np.float32)
    m[:8] = np.array([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-45, 1.5], dtype=np.float32)
    return m[np.isfinite(m)]


def test_bf16_mean_rounding_is_torch_rne():
    m = _random_means()
    sign, p, _, frac = rounded_mean(_f32_bits(m), BF16)
    ref = torch.from_numpy(np.abs(m)).to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64)
    ok = ref < 0x7F80  # torch overflows to inf, the codec clamps to max finite
    assert np.array_equal(p[ok], ref[ok])
    assert (p[~ok] == 0x7F7F).all()
    assert np.array_equal(sign, (_f32_bits(m) >> 31).astype(np.int64))
    assert (np.abs(frac) <= 0x8000).all()


def test_truncated_formats_round_into_their_truncation_bin():
    """float32: the coded pattern is x truncated toward zero; its model mean must land in that bin."""
    m = _random_means(seed=1)
    _, p, _, _ = rounded_mean(_f32_bits(m), FP32)
    trunc = (_f32_bits(np.abs(m)) >> 16).astype(np.int64)
    assert np.abs(p - np.minimum(trunc, 0x7F7F)).max() <= 1
    assert np.mean(p == np.minimum(trunc, 0x7F7F)) > 0.999
    # float16: 13-bit prefix (sign, exponent, 7 mantissa bits) of the float16 value
    m16 = m[np.abs(m) < 60000]
    _, p13, _, _ = rounded_mean(_f32_bits(m16), FP16)
    t13 = (torch.from_numpy(np.abs(m16)).to(torch.float16).view(torch.int16).numpy().astype(np.int64) & 0x7FFF) >> 3
    assert np.abs(p13 - t13).max() <= 1  # t13 rounds m to float16 first: may cross a 13-bit edge
    normal = np.abs(m16) >= 2.0**-14  # below, the half-ulp shift is only approximate (a model detail)
    hi = (_f32_bits(np.abs(m16[normal])) >> 16).astype(np.int64)  # m truncated to 7 mantissa bits
    exact13 = ((hi >> 7) - 112) << 7 | (hi & 127)
    assert np.mean(p13[normal] == exact13) > 0.999


def test_regimes_and_symmetry():
    t = get_tables()
    rng = np.random.default_rng(2)
    std = (10.0 ** rng.uniform(-4, 3, 50000)).astype(np.float32)
    ratio = rng.uniform(0, 20, std.size).astype(np.float32)
    mean = (std * ratio).astype(np.float32)
    for fmt in (BF16, FP32):
        p = element_params(_f32_bits(mean), _f32_bits(std), fmt)
        wide = p.tid >= W_BASE
        assert wide[ratio < 7.5].all()
        assert not wide[ratio > 8.5].any()
        q = element_params(_f32_bits(-mean), _f32_bits(std), fmt)
        assert np.array_equal(p.tid[wide], q.tid[wide])
        assert (p.s[wide] == -q.s[wide]).all()
        assert np.array_equal(p.cp[wide], q.cp[wide]) and np.array_equal(p.cn[wide], q.cn[wide])
    assert t.size[p.tid].min() >= 5


def test_zero_std_is_a_sharp_narrow_table():
    p = element_params(_f32_bits([0.0, 1.0, -3.5]), _f32_bits([0.0, 0.0, 0.0]), BF16)
    assert (p.tid < W_BASE).all()
    t = get_tables()
    for tid in p.tid:
        f = t.freqs[tid]
        assert f.max() > 0.99 * f.sum()
