"""Property tests: every tensor comes back bit for bit, whatever the shape, dtype, values, stats and mode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from codec_testutil import (
    DTYPES,
    assert_bit_exact,
    from_patterns,
    pattern_sample,
    realistic,
    special_patterns,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig

MODES = ("fixed", "metadata", "predicted", "causal")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def configs(draw) -> CodecConfig:
    w_min = draw(st.sampled_from([1, 8, 64]))
    k = draw(st.sampled_from([1, 2, 4]))
    return CodecConfig(coder="ans",
        window=draw(st.sampled_from(MODES)),
        fixed_window=draw(st.sampled_from([1, 3, 64, 1000])),
        min_window=w_min,
        tier_windows=(w_min, w_min * k, w_min * k * 2),
        probe=draw(st.sampled_from([8, 16, 128])),
        hysteresis=draw(st.integers(1, 3)),
        short_tokens=draw(st.sampled_from([0, 0, 512])),
        token_elements=draw(st.sampled_from([1, 64])),
        short_window=draw(st.sampled_from([7, 64, 1024])),
        thresholds=draw(st.sampled_from([(0.1, 0.5), (0.5, 1.5), (0.9, 1.1)])),
        escape=tuple(draw(st.lists(st.integers(1, 32768), min_size=3, max_size=3))),
        sigma_global=draw(st.sampled_from([None, None, 0.5])),
    )


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    if ndim and draw(st.booleans()):  # sometimes a longer last dim, still odd-sized
        shape = (*shape[:-1], draw(st.integers(1, 1500)))
    n = math.prod(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = 10.0 ** draw(st.floats(-6, 6))
    offset = draw(st.floats(-1e3, 1e3)) * draw(st.sampled_from([0.0, 1e-3, 1.0]))
    x = torch.from_numpy(rng.standard_normal(n) * scale + offset).to(dtype)
    frac_random = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    width = 32 if dtype == torch.float32 else 16
    rand_bits = rng.integers(0, 2**width, n, dtype=np.uint64).astype(np.int64)
    x = torch.where(torch.from_numpy(rng.random(n) < frac_random), from_patterns(rand_bits, dtype), x)
    if n:
        sp = special_patterns(dtype)
        pos = rng.integers(0, n, min(n, len(sp)))
        x[torch.from_numpy(pos)] = from_patterns(sp[: len(pos)], dtype)
    x = x.reshape(shape)
    stat_shape = draw(st.sampled_from(["none", "scalar", "last", "full"]))
    mean = std = None
    if stat_shape != "none":
        sshape = () if stat_shape == "scalar" else shape if stat_shape == "full" else (
            (1,) * (ndim - 1) + shape[-1:] if ndim else ())
        k = math.prod(sshape)
        mean = torch.from_numpy(rng.standard_normal(k) * scale + offset).float().reshape(sshape)
        std = torch.from_numpy(np.abs(rng.standard_normal(k)) * scale * draw(st.sampled_from([0.0, 0.01, 1, 10]))
                               ).float().reshape(sshape)
        which = draw(st.sampled_from(["both", "both", "mean", "std"]))
        mean, std = (mean if which != "std" else None), (std if which != "mean" else None)
    return x, mean, std, draw(configs())


@SETTINGS
@given(cases(), st.data())
def test_round_trip_bit_exact(case, data):
    x, mean, std, cfg = case
    blob = codec.encode(x, mean, std, cfg)
    assert_bit_exact(codec.decode(blob, mean, std), x)
    n = x.numel()
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    part = codec.decode_range(blob, start, stop, mean, std)
    assert_bit_exact(part, x.reshape(-1)[start:stop])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_every_pattern_round_trips(dtype, mode):
    """All 2^16 patterns (bf16, fp16) or a wide sample of float32 patterns, with and without stats."""
    pats = pattern_sample(dtype)
    x = from_patterns(pats, dtype).reshape(-1, 64) if pats.size % 64 == 0 else from_patterns(pats, dtype)
    cfg = CodecConfig(coder="ans", window=mode, short_tokens=0)
    for mean, std in ((None, None), (torch.tensor(0.3), torch.tensor(2.0)), (1e4, 0.0), (-2.5, 1e-3)):
        blob = codec.encode(x, mean, std, cfg)
        assert_bit_exact(codec.decode(blob, mean, std), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_realistic_all_modes_and_stat_shapes(dtype):
    x, offset, scale = realistic((2, 3, 200, 64), dtype=dtype)
    for mode in MODES:
        cfg = CodecConfig(coder="ans", window=mode, short_tokens=0)
        for mean, std in ((offset, scale), (None, scale), (offset, None), (None, None), (x.float(), scale)):
            blob = codec.encode(x, mean, std, cfg)
            assert_bit_exact(codec.decode(blob, mean, std), x)


@pytest.mark.parametrize("coder", sorted(codec.CODERS))
def test_empty_and_scalar(coder):
    cfg = CodecConfig(coder=coder)
    for dtype in DTYPES:
        for shape in ((0,), (3, 0, 2), ()):
            x = torch.zeros(shape, dtype=dtype)
            assert_bit_exact(codec.decode(codec.encode(x, config=cfg), config=cfg), x)
            assert_bit_exact(codec.decode(codec.encode(x, 0.0, 1.0, cfg), 0.0, 1.0, config=cfg), x)


def test_non_contiguous_and_mean_dtypes():
    x = torch.randn(64, 48).to(torch.bfloat16).t()  # non-contiguous
    mean = torch.zeros(48, 1, dtype=torch.float64)
    std = torch.ones(1, 64, dtype=torch.bfloat16)
    blob = codec.encode(x, mean, std, CodecConfig(coder="ans"))
    assert_bit_exact(codec.decode(blob, mean, std), x.contiguous())
    # the same values in another dtype are the same mean (fingerprints use the float32 values)
    assert_bit_exact(codec.decode(blob, mean.float(), std.float()), x.contiguous())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_round_trip_bit_exact_lanes(case, data):
    """The same cases through the lanes coder (one window per stream: the drawn window settings do not
    apply, the escape weights do)."""
    x, mean, std, drawn = case
    cfg = CodecConfig(coder="lanes", escape=drawn.escape, mean_steps=data.draw(st.sampled_from([8, 4, 2])))
    blob = codec.encode(x, mean, std, cfg)
    assert_bit_exact(codec.decode(blob, mean, std, config=cfg), x)
    n = x.numel()
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    assert_bit_exact(codec.decode_range(blob, start, stop, mean, std, config=cfg), x.reshape(-1)[start:stop])


def test_stream_infos_is_stream_info_of_each_stream_in_one_call():
    from hf_kvcompress.errors import CorruptStreamError

    blobs, want = [], []
    for coder in sorted(codec.CODERS):
        for dtype in DTYPES:
            for shape in ((0,), (3, 5), (2, 1, 4)):
                blobs.append(codec.encode(torch.zeros(shape, dtype=dtype), config=CodecConfig(coder=coder)))
                want.append((dtype, shape))
    assert codec.stream_infos(blobs) == want == [codec.stream_info(b) for b in blobs]  # mixed coders
    one = [b for b in blobs if codec.coder_of_stream(b) is codec.coder_of_stream(blobs[-1])]
    assert codec.stream_infos(one) == [codec.stream_info(b) for b in one]  # one coder: one call
    assert codec.stream_infos([]) == []
    with pytest.raises(CorruptStreamError):
        codec.stream_infos([*one, b"not a stream"])
