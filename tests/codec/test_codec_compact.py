"""Compact stream headers, the mean_steps table grid, and the fast element_params against its reference."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from codec_testutil import (
    DTYPES,
    PARAM_TRIPLES,
    as_version1,
    assert_bit_exact,
    params_bulk,
    params_inputs,
    realistic,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError, Marginal
from hf_kvcompress.codec.params import element_params, element_params_reference
from hf_kvcompress.codec.symbols import BF16, FP16, FP32

COMPACT = CodecConfig(coder="ans", header="compact", fixed_window=65536)


def _per_element(shape=(64, 256), seed=0, dtype=torch.bfloat16):
    """A cache-like stream: per-element mean and std (a predictor's), x = mean + std * noise."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(shape, generator=g) * 0.8
    std = torch.rand(shape, generator=g) * 0.6 + 0.2
    x = (mean + std * torch.randn(shape, generator=g)).to(dtype)
    return x, mean, std


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", ["fixed", "metadata", "predicted", "causal"])
def test_compact_round_trip(dtype, window):
    x, mean, std = realistic((1, 2, 40, 64), seed=1, dtype=dtype)
    cfg = CodecConfig(coder="ans", header="compact", window=window, short_tokens=0, tier_windows=(64, 256, 1024), probe=64)
    for m, s in ((mean, std), (None, None), (mean, None)):
        blob = codec.encode(x, m, s, cfg)
        assert_bit_exact(codec.decode(blob, m, s, config=cfg), x)
        n = x.numel()
        assert_bit_exact(codec.decode_range(blob, 100, n - 7, m, s, config=cfg), x.reshape(-1)[100 : n - 7])


@pytest.mark.parametrize("windows", [1, 2, 4])
def test_compact_header_is_small(windows):
    x, mean, std = _per_element()
    cfg = CodecConfig(coder="ans", header="compact", fixed_window=-(-x.numel() // windows))
    _, st_compact = codec.encode_with_stats(x, mean, std, cfg)
    _, st_full = codec.encode_with_stats(x, mean, std, CodecConfig(coder="ans", fixed_window=cfg.fixed_window))
    assert st_compact.n_windows == windows
    assert st_compact.header_bytes <= 48  # + 8 bytes per window + 4 CRC bytes
    assert st_compact.header_bytes + st_compact.table_bytes <= 64 + 8 * windows
    assert st_full.header_bytes > 400
    assert st_compact.payload_bytes == st_full.payload_bytes  # same coded bits, other framing


def test_compact_needs_the_config():
    x, mean, std = _per_element((16, 64))
    blob = codec.encode(x, mean, std, COMPACT)
    with pytest.raises(CorruptStreamError, match="config"):
        codec.decode(blob, mean, std)
    others = [CodecConfig(coder="ans", header="compact", fixed_window=4096), CodecConfig(coder="ans", header="compact", mean_steps=4,
                                                                           fixed_window=65536),
              CodecConfig(coder="ans", header="compact", fixed_window=65536, escape=(256, 128, 32)),
              CodecConfig(coder="ans", header="compact", fixed_window=65536, marginal=Marginal.from_samples(x))]
    for other in others:
        with pytest.raises(CorruptStreamError, match="digest mismatch"):
            codec.decode(blob, mean, std, config=other)
    with pytest.raises(CorruptStreamError, match="fingerprint"):
        codec.decode(blob, mean + 1e-3, std, config=COMPACT)
    with pytest.raises(CorruptStreamError, match="fingerprint"):
        codec.decode(blob, mean, std * 2, config=COMPACT)


def test_full_stream_governs_its_own_config():
    """Full streams are self-describing: a config passed to decode only supplies the marginal, so a caller
    that switched settings (e.g. to compact) still reads what it stored before."""
    x, mean, std = _per_element((16, 64))
    cfg = CodecConfig(coder="ans", mean_steps=4)
    blob = codec.encode(x, mean, std, cfg)
    assert_bit_exact(codec.decode(blob, mean, std), x)
    assert_bit_exact(codec.decode(blob, mean, std, config=cfg), x)
    assert_bit_exact(codec.decode(blob, mean, std, config=CodecConfig(coder="ans", header="compact", fixed_window=65536)), x)
    with_marginal = CodecConfig(coder="ans", marginal=Marginal.from_samples(x))
    blob = codec.encode(x, mean, std, with_marginal)
    assert_bit_exact(codec.decode(blob, mean, std, config=with_marginal), x)
    with pytest.raises(CorruptStreamError, match="marginal"):
        codec.decode(blob, mean, std, config=cfg)
    with pytest.raises(ValueError, match="marginal"):
        codec.decode(blob, mean, std, config=cfg, marginal=with_marginal.marginal)


def test_compact_with_marginal_in_config():
    x, mean, std = _per_element((16, 64))
    cfg = CodecConfig(coder="ans", header="compact", marginal=Marginal.from_samples(x))
    blob = codec.encode(x, mean, std, cfg)
    assert_bit_exact(codec.decode(blob, mean, std, config=cfg), x)


def test_default_stream_bytes_are_stable():
    """The full layout of the default config is unchanged by the compact / mean_steps additions, and
    format version 2 differs from version 1 only in its version field and window CRC seeds: written back
    as version 1, a stream has the digest of one written before all three (and still decodes)."""
    # the inputs as committed: `realistic`'s torch.randn draws other bits under other CPU kernels (AVX2 / AVX-512
    # against ATEN_CPU_CAPABILITY=default), the stream of the same inputs is the same bytes everywhere
    inputs = load_file(str(Path(__file__).resolve().parents[1] / "fixtures" / "stable_stream_input.safetensors"))
    x, mean, std = inputs["x"], inputs["mean"], inputs["std"]
    blob = codec.encode(x, mean, std, CodecConfig(coder="ans"))
    assert hashlib.sha256(blob).hexdigest() == STABLE_SHA256
    old = as_version1(blob, x, mean, std, None)
    assert hashlib.sha256(old).hexdigest() == STABLE_SHA256_V1
    assert_bit_exact(codec.decode(old, mean, std), x)
    assert_bit_exact(codec.decode_range(old, 10, 300, mean, std), x.reshape(-1)[10:300])


STABLE_SHA256 = "b97b4e2a864478721865cf66450a70ac243282b3ee16cfdc1456186c5219e592"
STABLE_SHA256_V1 = "c3189767e84fa44561e312b5ffeffad9fc1774a175c8210164c376bd68a25a45"


@pytest.mark.parametrize("steps", [8, 4, 2])
def test_mean_steps_round_trip_and_cost(steps):
    x, mean, std = _per_element(seed=2)
    cfg = CodecConfig(coder="ans", header="compact", fixed_window=65536, mean_steps=steps)
    blob, st = codec.encode_with_stats(x, mean, std, cfg)
    assert_bit_exact(codec.decode(blob, mean, std, config=cfg), x)
    base = codec.encode_with_stats(x, mean, std, CodecConfig(coder="ans", header="compact", fixed_window=65536))[1]
    extra = (st.model_bits - base.model_bits) / x.numel()
    assert 0 <= extra < {8: 1e-9, 4: 0.006, 2: 0.02}[steps]


def test_mean_steps_validated():
    for bad in (3, 16, 0, True, "4"):
        with pytest.raises(ValueError, match="mean_steps"):
            CodecConfig(coder="ans", mean_steps=bad)
    with pytest.raises(ValueError, match="header"):
        CodecConfig(coder="ans", header="tiny")


# ------------------------------------------------------------------ fast element_params == reference

def _edge_bits() -> np.ndarray:
    vals = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.1754944e-38, 1.0, -1.0, 1.5, 3.0e38, -3.3e38, 3.4028235e38,
                     65504.0, 65520.0, 6.1e-5, 5.96e-8, 2.0**-24, 0.999, 1.0039062, 1.0078125], dtype=np.float32)
    return vals.view(np.uint32)


@pytest.mark.parametrize("fmt", [BF16, FP16, FP32], ids=lambda f: f.name)
@pytest.mark.parametrize("steps", [8, 4, 2])
def test_fast_params_equal_reference_on_edges(fmt, steps):
    e = _edge_bits()
    mean, std = np.meshgrid(e, np.concatenate([e[:2], np.abs(e.view(np.float32)).astype(np.float32).view(np.uint32)]))
    mean, std = mean.reshape(-1), std.reshape(-1)
    a, b = element_params(mean, std, fmt, steps), element_params_reference(mean, std, fmt, steps)
    for u, v in zip(a, b):
        assert np.array_equal(np.asarray(u, np.int64), np.asarray(v, np.int64))


@settings(max_examples=60, deadline=None)
@given(PARAM_TRIPLES, st.sampled_from([BF16, FP16, FP32]), st.sampled_from([8, 4, 2]))
def test_fast_params_equal_reference(triples, fmt, steps):
    mean, std = params_inputs(triples)
    a = element_params(mean.view(np.uint32), std.view(np.uint32), fmt, steps)
    b = element_params_reference(mean.view(np.uint32), std.view(np.uint32), fmt, steps)
    for u, v in zip(a, b):
        assert np.array_equal(np.asarray(u, np.int64), np.asarray(v, np.int64))


def test_fast_params_equal_reference_bulk():
    mean, std = params_bulk()
    for fmt in (BF16, FP16, FP32):
        for steps in (8, 4):
            a = element_params(mean.view(np.uint32), std.view(np.uint32), fmt, steps)
            b = element_params_reference(mean.view(np.uint32), std.view(np.uint32), fmt, steps)
            for u, v in zip(a, b):
                assert np.array_equal(np.asarray(u, np.int64), np.asarray(v, np.int64))
