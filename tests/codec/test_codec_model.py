"""Tables and the arithmetic behind them: reproducible, exact where it must be, accurate where it should."""

from __future__ import annotations

import math

import constriction
import numpy as np
import pytest
import torch

from hf_kvcompress.codec import tables as model
from hf_kvcompress.codec.detmath import det_erfc_nonneg, det_exp
from hf_kvcompress.codec.symbols import BF16, FP16
from hf_kvcompress.codec.tables import Marginal, default_marginal_weights


def test_det_exp_matches_libm_to_one_ulp():
    x = np.concatenate([np.linspace(-700, 0, 200001), np.linspace(0, 5, 1001)])
    got, ref = det_exp(x), np.array([math.exp(v) for v in x])
    assert np.max(np.abs(got.view(np.int64) - ref.view(np.int64))) <= 1
    assert det_exp(np.array([-701.0, -1e5]))[0] == 0.0


def test_det_erfc_accuracy():
    x = np.concatenate([np.linspace(0, 26, 100001), [0.0, 1e-300, 0.84375, 1.25, 2.857142857142857, 6.0, 28.0]])
    got = det_erfc_nonneg(x)
    ref = np.array([math.erfc(v) for v in x])
    ok = ref > 1e-290
    assert np.max(np.abs(got[ok] - ref[ok]) / ref[ok]) < 2e-15
    assert det_erfc_nonneg(np.array([30.0]))[0] == 0.0


def test_tables_hash_matches_reference():
    t = model.get_tables()
    assert t.sha256 == model.TABLES_SHA256
    assert len(t.models) == model.N_TABLES


def test_tables_independent_of_flush_to_zero():
    """Table construction must not depend on the denormal mode (FTZ/DAZ set by torch for this thread)."""
    weights = model.build_weights()
    ref = model.tables_digest(weights, default_marginal_weights().astype("<i4").tobytes())
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert np.float32(1e-40) * np.float32(1.0) == 0  # FTZ really is on for numpy too
        default_marginal_weights.cache_clear()
        again = model.tables_digest(model.build_weights(), default_marginal_weights().astype("<i4").tobytes())
    finally:
        torch.set_flush_denormal(False)
        default_marginal_weights.cache_clear()
    assert again == ref == model.TABLES_SHA256


def test_every_table_is_a_valid_distribution():
    t = model.get_tables()
    for tid, f in enumerate(t.freqs):
        assert f.sum() == model.TOTAL, tid
        assert f.min() >= 1, tid
        assert f.size == t.size[tid]
    assert (Marginal.default().weights + 1).min() >= 1  # every bf16 pattern, NaNs included


def test_quantize_is_exact_and_deterministic():
    rng = np.random.default_rng(0)
    for n in (2, 5, 100, 4608):
        masses = rng.random(n) ** 8
        masses[rng.integers(0, n, n // 3)] = 0.0
        w = model.quantize(masses, model.TOTAL - n)
        assert w.sum() == model.TOTAL - n and w.min() >= 0
        assert np.array_equal(w, model.quantize(masses.copy(), model.TOTAL - n))
    assert model.quantize(np.zeros(4), 100).sum() == 100  # degenerate input: uniform


@pytest.mark.parametrize("tid", [0, 7, 300, model.N_COUNT - 1, model.W_BASE, model.W_BASE + 200, model.N_TABLES - 1])
def test_constriction_uses_weight_plus_one_exactly(tid):
    """Categorical(weights summing to 2^24 - n, perfect=False) must code with frequency weight + 1: the
    ANS code length then equals -sum log2((w + 1) / 2^24) to within the coder's flush bits."""
    t = model.get_tables()
    f = t.freqs[tid]
    rng = np.random.default_rng(tid)
    # a skewed sample, including the rarest symbols, makes wrong frequencies visible
    syms = np.concatenate([rng.choice(f.size, 3000, p=f / f.sum()), rng.integers(0, f.size, 300)]).astype(np.int32)
    enc = constriction.stream.stack.AnsCoder()
    enc.encode_reverse(syms, t.models[tid])
    bits = enc.num_bits()
    ideal = float(np.sum(model.PRECISION - np.log2(f[syms].astype(np.float64))))
    assert abs(bits - ideal) <= 64, (bits, ideal)
    alt = (f - 1) * model.TOTAL / (model.TOTAL - f.size)  # what proportional rescaling would give
    alt_ideal = float(np.sum(model.PRECISION - np.log2(np.maximum(alt[syms], 1.0))))
    if abs(alt_ideal - ideal) > 200:
        assert abs(bits - alt_ideal) > 64


def test_tables_are_close_to_the_gaussian_they_describe():
    """Coding Gaussian data with its own (mean, std) costs at most ~0.01 bit more under the integer tables
    than under the exact mixture (std quantised to 1/8 octave, mean to 1/8 std)."""
    from hf_kvcompress import codec

    rng = np.random.default_rng(0)
    for mean, std in ((0.0, 1.0), (0.3, 1.7), (5.0, 0.2), (100.0, 0.05)):
        x = torch.from_numpy(rng.standard_normal(1 << 15) * std + mean).to(torch.bfloat16)
        _, st = codec.encode_with_stats(x, mean, std, codec.CodecConfig(coder="ans"), decode=False, exact=True)
        assert abs(st.model_bits - st.exact_codec_bits) / st.n_elements < 0.015, (mean, std)


def test_a_marginal_views_its_int32_tensor_and_keeps_no_model_for_its_frequencies():
    tensor = Marginal.from_samples(torch.randn(5000).bfloat16()).to_tensor()
    marginal = Marginal.from_tensor(tensor)
    assert np.shares_memory(marginal.weights, tensor.numpy()) and not marginal.weights.flags.writeable
    assert Marginal(tensor.numpy().astype(np.int64)).sha256 == marginal.sha256  # the same weights, however held
    for fmt in (BF16, FP16):
        assert np.array_equal(marginal.frequencies(fmt), Marginal.from_tensor(tensor).coding(fmt)[1])
        assert marginal.frequencies(fmt).dtype == np.int64
