"""The per-element model kernels are bit-exact with the numpy codec: table ids and offsets, symbols,
frequencies, the inverse mapping and the dtype symbol transforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_testutil import BACKENDS

from hf_kvcompress import kernels
from hf_kvcompress.codec.ans_coder import device
from hf_kvcompress.codec.ans_coder.entropy import symbols
from hf_kvcompress.codec.params import element_params_reference
from hf_kvcompress.codec.symbols import FORMATS, split_bits, tensor_bits
from hf_kvcompress.codec.tables import ESCAPE_GROUP, get_tables

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _stats(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Means and stds over the whole float32 range, half of the stds tied to |mean| (the W/N boundary), plus
    zeros, subnormals and extremes."""
    rng = np.random.default_rng(seed)
    with np.errstate(all="ignore"):
        mean = (rng.standard_normal(n) * 10.0 ** rng.uniform(-44, 38, n)).astype(np.float32)
        std = np.abs(rng.standard_normal(n) * 10.0 ** rng.uniform(-44, 38, n)).astype(np.float32)
        tied = (np.abs(mean) / rng.uniform(0.01, 20, n)).astype(np.float32)
    std = np.where(rng.random(n) < 0.5, std, tied)
    edges = np.array([0.0, -0.0, 1e-45, -1e-40, 3.4e38, -3.4e38, 1.0, 65504.0, 6e-8], dtype=np.float32)
    mean[: edges.size], std[: edges.size] = edges, np.abs(edges[::-1])
    return (np.where(np.isfinite(mean), mean, 0).astype(np.float32),
            np.where(np.isfinite(std), std, 1).astype(np.float32))


def _values(mean: np.ndarray, std: np.ndarray, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Mostly mean + std * noise (coded by the tables), some raw bit patterns (NaNs, infs: escapes)."""
    rng = np.random.default_rng(seed)
    with np.errstate(all="ignore"):
        v = torch.from_numpy(mean + std * rng.standard_normal(mean.size).astype(np.float32)).to(dtype)
    bits = v.view(torch.int32 if dtype == torch.float32 else torch.int16).clone()
    wild = torch.from_numpy(rng.random(mean.size) < 0.05)
    width = 32 if dtype == torch.float32 else 16
    noise = torch.from_numpy(rng.integers(-(2 ** (width - 1)), 2 ** (width - 1), mean.size)).to(bits.dtype)
    bits[wild] = noise[wild]
    return bits.view(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("steps", [8, 4, 2])
def test_element_params_match_the_codec(backend, dtype, steps):
    fmt = FORMATS[dtype]
    mean, std = _stats(1500, seed=steps)
    ref = element_params_reference(mean.view(np.uint32), std.view(np.uint32), fmt, steps)
    with kernels.forced(backend):
        got = device.element_params(torch.from_numpy(mean), torch.from_numpy(std), fmt, steps)
    for a, b in zip(ref, got):
        assert np.array_equal(np.asarray(a, np.int64), b.numpy().astype(np.int64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_model_matches_the_codec_and_inverts(backend, dtype):
    fmt = FORMATS[dtype]
    mean, std = _stats(1500, seed=7)
    x = _values(mean, std, dtype, seed=8)
    with kernels.forced(backend):
        out = device.encode_model(x, torch.from_numpy(mean), torch.from_numpy(std), 8)
        params = (out["tid"], out["cp"], out["cn"], out["s"])
        back = device.decode_bits(out["sym"], out["escaped"], params, out["raw"], fmt)
    keys, raw = split_bits(tensor_bits(x), fmt)
    p = element_params_reference(mean.view(np.uint32), std.view(np.uint32), fmt, 8)
    t = get_tables()
    valid, sym = symbols(keys, p, t, fmt)
    assert np.array_equal(out["sym"].numpy(), sym)
    assert np.array_equal(out["escaped"].numpy() == 0, valid)
    assert 0 < (~valid).sum() < valid.size
    group = np.where(valid, p.tid, ESCAPE_GROUP)
    assert np.array_equal(out["group"].numpy(), group)
    tables = device.tables_for(fmt, "cpu")
    freq = np.array([t.freqs[g][s] if g < ESCAPE_GROUP else 0 for g, s in zip(group, sym)])
    assert np.array_equal(out["freq"].numpy()[valid], freq[valid])
    cum = np.array([int(t.freqs[g][:s].sum()) if g < ESCAPE_GROUP else 0 for g, s in zip(group, sym)])
    assert np.array_equal(out["cum"].numpy()[valid], cum[valid])
    assert (out["freq"].numpy() >= 1).all() and (out["cum"].numpy() + out["freq"].numpy() <= 1 << 24).all()
    assert tables.freq[tables.off[ESCAPE_GROUP]:][: 1 << fmt.pattern_bits].sum() == 1 << 24
    if raw is not None:
        assert np.array_equal(out["raw"].numpy(), raw)
    assert torch.equal(back, x.view(back.dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_symbol_transforms_round_trip(backend, dtype):
    width = 32 if dtype == torch.float32 else 16
    rng = np.random.default_rng(1)
    raw_bits = rng.integers(-(2 ** (width - 1)), 2 ** (width - 1), 4000)
    x = torch.from_numpy(raw_bits).to(torch.int32 if width == 32 else torch.int16).view(dtype)
    with kernels.forced(backend):
        key, raw = device.split_bits(x)
        back = device.join_bits(key, raw, dtype)
    ref_key, ref_raw = split_bits(tensor_bits(x), FORMATS[dtype])
    assert np.array_equal(key.numpy(), ref_key)
    assert ref_raw is None or np.array_equal(raw.numpy(), ref_raw)
    assert torch.equal(back.view(x.view(torch.int32 if width == 32 else torch.int16).dtype),
                       x.view(torch.int32 if width == 32 else torch.int16))
    finite = torch.isfinite(x.float())
    order = torch.argsort(x.float()[finite], stable=True)
    assert (torch.diff(key[finite][order]) >= 0).all()  # keys preserve the order of values
