"""The window scheduler: valid plans, hysteresis, exact thresholds, FTZ-proof residual codes."""

from __future__ import annotations

import numpy as np
import pytest

from hf_kvcompress.codec.ans_coder.windows import (
    CausalScheduler,
    adaptive_lengths,
    fixed_lengths,
    hysteresis_tiers,
    residual_codes,
)
from hf_kvcompress.codec.codec_config import CodecConfig, eighth_octaves


def test_eighth_octaves_exact():
    assert [eighth_octaves(r) for r in (0.1, 0.15, 0.5, 1.0, 2.0, 4.0)] == [-27, -22, -8, 0, 8, 16]


def test_hysteresis():
    assert hysteresis_tiers([0, 1, 0, 1, 1, 1, 2, 1], 2, 0) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert hysteresis_tiers([2, 2, 0, 0, 0], 1, 1) == [2, 2, 0, 0, 0]
    assert hysteresis_tiers([1, 2, 1, 2], 2, 0) == [0, 2, 2, 2]  # disagreeing blocks count even if they differ


@pytest.mark.parametrize("seed", range(20))
def test_adaptive_plans_are_valid(seed):
    rng = np.random.default_rng(seed)
    cfg = CodecConfig(coder="ans", window="metadata", short_tokens=0)
    n = int(rng.integers(1, 200000))
    g = 1000
    nb = -(-n // cfg.probe)
    # piecewise-constant spreads: runs of high / medium / low locality
    spread = np.repeat(rng.choice([g - 40, g - 15, g], size=nb // 7 + 1), 7)[:nb]
    spread = spread + rng.integers(-3, 4, nb)
    lengths = adaptive_lengths(spread, n, cfg, g)
    assert lengths.sum() == n and lengths.min() >= 1
    assert lengths.max() < max(cfg.tier_windows) + cfg.min_window
    assert (lengths[:-1] % cfg.min_window == 0).mean() > 0.99


def test_tiers_follow_spread():
    cfg = CodecConfig(coder="ans", window="metadata", short_tokens=0)
    g = 1000
    for spread, expect in ((g - 40, 4096), (g - 15, 512), (g - 25, 1024), (g + 5, 256)):
        lengths = adaptive_lengths(np.full(384, spread), 384 * 128, cfg, g)
        assert lengths[0] == expect, (spread, lengths[:3])


def test_short_inputs_use_the_fixed_medium_window():
    cfg = CodecConfig(coder="ans", window="metadata", short_tokens=512, token_elements=64, short_window=1024)
    lengths = adaptive_lengths(np.zeros(100, dtype=np.int64), 20000, cfg, 1000)
    assert np.array_equal(lengths, fixed_lengths(20000, 1024))
    sched = CausalScheduler(20000, cfg, 1000)
    assert sched.next_length() == 1024


def test_causal_scheduler_only_looks_back():
    cfg = CodecConfig(coder="ans", window="causal", short_tokens=0)
    rng = np.random.default_rng(0)
    codes = rng.integers(900, 1010, 300000).astype(np.int32)
    plan = []
    sched = CausalScheduler(codes.size, cfg, 1000)
    while (length := sched.next_length()) > 0:
        plan.append(length)
        sched.observe(codes[sched.pos : sched.pos + length])
    assert sum(plan) == codes.size
    # changing data after a window does not change that window's length
    codes2 = codes.copy()
    cut = sum(plan[:5])
    codes2[cut:] = 0
    sched = CausalScheduler(codes.size, cfg, 1000)
    plan2 = []
    while (length := sched.next_length()) > 0 and len(plan2) < 6:
        plan2.append(length)
        sched.observe(codes2[sched.pos : sched.pos + length])
    assert plan2[:6] == plan[:6]


def test_residual_codes_flush_subnormals_and_flag_non_finite():
    x = np.array([1.0, 1e-40, 2.0, np.inf, np.nan, 1.0 + 2**-23], dtype=np.float32)
    m = np.array([0.0, 0.0, 1e-40, 0.0, 0.0, 1.0], dtype=np.float32)
    c = residual_codes(x, m)
    assert c[1] == 0  # subnormal input counts as zero
    assert c[0] == c[2] - 8  # 2 - subnormal = 2
    assert c[3] == 2040 and c[4] == 2040
    assert c[5] == (104 << 3)  # 2^-23 is normal: exponent field 104
