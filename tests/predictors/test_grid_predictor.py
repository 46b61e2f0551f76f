"""The ``grid`` predictor: `below`'s head set on integer grids, whose float32 statistics every CPU, thread count and
matrix-library path computes bit for bit (so its files need no settled listing). Six-layer models."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fresh_tiny_model, random_ids, same_bits, tiny_calibration
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec.detmath import SINCOS_LIMIT, det_sincos
from hf_kvcompress.predictors import grid
from hf_kvcompress.predictors.base import BlockInputs, LayerValues
from hf_kvcompress.predictors.grid import GridLayer, GridPredictor, GridSession
from hf_kvcompress.predictors.registry import FITTED, head_set

LAYERS, BLOCK, RESIDUAL = 6, 16, 4
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def model6():
    return fresh_tiny_model("llama-gqa", torch.bfloat16, layers=LAYERS)


@functools.cache
def calibration() -> Calibration:
    return tiny_calibration(model6(), 512, predictors=("grid",))


def config(coder: str | None = None) -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                             lossless={"predictor": "grid", "decoded_budget": 0.0, "coder": coder})


def test_a_fit_asked_for_grid_fits_below_once():
    assert "grid" in FITTED and head_set("grid") == "below" and head_set("below") == "below"
    assert calibration().predictors == ["below"]
    assert GridPredictor(calibration()).heads_name == "below"


def test_a_saved_below_calibration_serves_grid_without_a_fit(tmp_path, monkeypatch):
    from hf_kvcompress import calibration as calibration_module

    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    calibration().save(calibration_module.calibration_dir(model6()))
    monkeypatch.setattr(Calibration, "fit", lambda *a, **k: pytest.fail("fitted again"))
    found, note = calibration_module.calibration_for(model6(), predictors=("grid",), fit=True)
    assert found is not None and found.predictors == ["below"] and note == str(calibration_module.calibration_dir(model6()))


# ---------------------------------------------------------------------- detmath sin / cos


def test_det_sincos_is_within_an_ulp_of_libm_and_pinned():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-10, 10, 20000), rng.uniform(0, SINCOS_LIMIT, 20000), np.arange(4096.0),
                        [0.0, 1e-300, math.pi / 4, math.pi / 2, SINCOS_LIMIT]])
    sin, cos = det_sincos(x)
    for got, want in ((sin, np.array([math.sin(v) for v in x])), (cos, np.array([math.cos(v) for v in x]))):
        assert (np.abs(got - want) <= np.spacing(np.abs(want))).all()
    # the bits fdlibm's algorithm gives (the same on every platform: + - * and comparisons only)
    x = np.array([1.0, 0.7853981633974483, 1000.5, 123456.789, 1500000.0, -2.5])
    sin, cos = det_sincos(x)
    assert [hex(v) for v in sin.view(np.uint64)] == [
        "0x3feaed548f090cee", "0x3fe6a09e667f3bcc", "0x3fefd948c50a7a0d", "0xbfeff50e60ab53f9", "0x3fe05a19f9bf8b6c",
        "0xbfe326af0dcfcab0"]
    assert [hex(v) for v in cos.view(np.uint64)] == [
        "0x3fe14a280fb5068c", "0x3fe6a09e667f3bcd", "0x3fb8dbff75eb664f", "0x3faa74d27c41b22a", "0xbfeb81b10301dab6",
        "0xbfe9a2f7ef858b7d"]
    assert np.signbit(det_sincos(np.array([-0.0]))[0]).all()
    for bad in (SINCOS_LIMIT * 1.0001, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="det_sincos"):
            det_sincos(np.array([0.5, bad]))


def test_the_rope_tables_refuse_positions_beyond_the_exact_range():
    frame = GridPredictor(calibration()).frame
    cos, _ = frame.cos_sin(torch.arange(5, 9))
    assert cos.dtype == torch.float32 and torch.allclose(cos, calibration().rope_frame().cos_sin(torch.arange(5, 9))[0])
    with pytest.raises(ValueError, match="beyond"):
        frame.cos_sin(torch.tensor([2_000_000]))


# ---------------------------------------------------------------------- the surprise levels


def test_levels_are_quarter_octaves_and_the_integer_thresholds_their_edges():
    levels = torch.arange(grid.LEVELS)
    assert torch.equal(grid.level_of_surprise(grid.LEVEL_SURPRISE), levels)
    assert grid.LEVEL_SURPRISE[grid.NEUTRAL_LEVEL] == 1.0 and grid.LEVEL_SURPRISE[0] == 0.25
    assert grid.LEVEL_SURPRISE[-1] == 8.0
    for elements in (16, 96, 4096):
        thresholds = grid.level_thresholds(elements)
        base = elements * 2**grid.E2_BITS
        edges = [base * 2 ** ((2 * (level - grid.NEUTRAL_LEVEL) - 1) / 4) for level in range(1, grid.LEVELS)]
        assert all(t - 1 < e <= t for t, e in zip(thresholds.tolist(), edges, strict=True))
    with pytest.raises(ValueError, match="elements per token"):
        grid.level_thresholds(grid.MAX_SURPRISE_ELEMENTS + 1)


def test_one_infinite_error_saturates_its_tokens_surprise():
    errors = torch.zeros(1, 2, 3, 16)
    errors[0, 1, 2, 5] = float("inf")
    errors[0, 0, 1, 5] = float("nan")
    sums = grid.squared_error_sums(errors)
    assert sums.dtype == torch.int64 and sums.tolist() == [[0, 0, int(grid.E2_CAP) << grid.E2_BITS]]
    assert ((sums.unsqueeze(-1) >= grid.level_thresholds(32)).sum(-1)).tolist() == [[0, 0, grid.LEVELS - 1]]


# ---------------------------------------------------------------------- exact products


def reference_means(q, exponent, weight, float64: bool) -> torch.Tensor:
    """`grid_means` written out: float64 integer products, scaled and biased in float32 (``float64``: in float64,
    rounded once to float32)."""
    folded = weight[1:].double().unsqueeze(0) * grid.pow2(exponent - 7).transpose(1, 2)
    _, column = torch.frexp(folded.abs().amax(dim=1, keepdim=True))
    shift = column.long() - 7
    sums = torch.bmm(q.double(), torch.round(folded * grid.pow2(-shift)).clamp(-127, 127))
    if float64:
        return (sums * grid.pow2(shift) + weight[0].double()).float().clamp(-grid.F32_MAX, grid.F32_MAX)
    return (sums.float() * grid.pow2(shift).float() + weight[0]).clamp(-grid.F32_MAX, grid.F32_MAX)


@pytest.mark.parametrize("features", [900, 2500])  # one exact float32 product; three chunks of `EXACT_FEATURES`
def test_grid_means_are_exact_integer_sums_under_any_threads_and_reduced_precision(features):
    """The float32 products equal a float64 reference exactly, under every thread count and a reduced-precision
    float32 matmul mode; features spanning 2^-100..2^100 (every channel its own scale)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 300, features, generator=g) * torch.logspace(-30, 30, features)
    weight = torch.randn(features + 1, 96, generator=g)
    q, exponent = grid.quantize_features(x)
    assert q.abs().max() <= grid.Q_MAX and torch.equal(q, q.round())
    assert (q.abs().amax(dim=1) >= 64).all()  # every channel uses its 7 bits
    want = reference_means(q, exponent, weight, features > grid.EXACT_FEATURES)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            assert same_bits(grid.grid_means([(q, exponent)], weight), want)
        # in pieces (as values read the layer below, then this layer's keys): the same integer sums
        pieces = [(q[..., :300], exponent[..., :300]), (q[..., 300:], exponent[..., 300:])]
        assert same_bits(grid.grid_means(pieces, weight), want)
        torch.set_float32_matmul_precision("medium")
        assert not grid.exact_float32_matmul()
        assert same_bits(grid.grid_means([(q, exponent)], weight), want)
        assert same_bits(grid.grid_means(pieces, weight), want)
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision("highest")
    with pytest.raises(ValueError, match=f"expects {features + 1} features"):
        grid.grid_means([(q[..., 1:], exponent[..., 1:])], weight)


def test_columns_scaled_beyond_float32_go_through_float64():
    """Weights of 2^120 on features of 2^100 (a column scale near 2^213), and of 2^-30 on features of 2^-100 (near
    2^-137): those columns in float64 (the huge one clamped to float32's largest), the others in float32."""
    g = torch.Generator().manual_seed(2)
    for size, scale, want_big in ((2.0**100, 2.0**120, True), (2.0**-100, 2.0**-30, False)):
        q, exponent = grid.quantize_features(torch.randn(1, 20, 8, generator=g) * size)
        weight = torch.randn(9, 2, generator=g)
        weight[1:, 0] *= scale
        weight[0, 0] = 0.0
        got = grid.grid_means([(q, exponent)], weight)
        assert (got[..., 0].abs() == grid.F32_MAX).all() if want_big else (got[..., 0].abs() < 2.0**-100).all()
        assert (got[..., 0] != 0).all()
        assert same_bits(got[..., 0], reference_means(q, exponent, weight, True)[..., 0])
        assert same_bits(got[..., 1], reference_means(q, exponent, weight, False)[..., 1])


def test_quantizing_subnormal_and_huge_channels_is_exact():
    """The smallest subnormals (2^-149, -2^-148: max 0.5 * 2^-147, scale 2^-154, beyond float32's range, applied in
    two steps) and the largest floats (scale 2^121): every q the exact rounding of x / scale."""
    x = torch.tensor([[[2.0**-149, 3 * 2.0**125, 0.0], [-(2.0**-148), -(2.0**126) - 2.0**103, 0.0]]])
    q, exponent = grid.quantize_features(x)
    assert exponent.tolist() == [[[-147, 127, 0]]]
    x[0, 0, 2], x[0, 1, 2] = float("nan"), float("inf")  # read as 0
    assert same_bits(grid.quantize_features(x)[0], q)
    assert q.tolist() == [[[32.0, 96.0, 0.0], [-64.0, -64.0, 0.0]]]  # -(2^126 + 2^103) / 2^120 rounds to -64


# ---------------------------------------------------------------------- sessions


def block_inputs(layer: int, start: int, tokens: int, batch: int, seed: int, extreme: bool = False):
    cal = calibration()
    heads, dim = cal.meta["model"]["kv_heads"], cal.meta["model"]["head_dim"]
    g = torch.Generator().manual_seed(seed)
    below_k, below_v, keys, values = (torch.randn(batch, heads, tokens, dim, generator=g).bfloat16() for _ in range(4))
    if extreme:  # NaN, infinities, the largest finite values, subnormals, -0.0 in features and in observed values
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3e38, -3.3e38, 1e-40, -0.0])
        for x in (below_k, below_v, keys, values):
            x[0, 0, 1, : specials.numel()] = specials.bfloat16()
            x[-1, -1, -1, 3] = float("inf")
    surprise = grid.LEVEL_SURPRISE[torch.randint(0, grid.LEVELS, (batch, tokens), generator=g)]
    below = None if layer == 0 else LayerValues(below_k, below_v, surprise)
    return BlockInputs(layer, batch, torch.arange(start, start + tokens), below), keys, values


def run_blocks(sessions, blocks) -> list[torch.Tensor]:
    """Every block's statistics (predict_kind, observe_kind) and surprise, a kind at a time as a decoder does."""
    heads = calibration().meta["model"]["kv_heads"]
    out: list[list[torch.Tensor]] = [[] for _ in blocks]
    for kind in "kv":
        for i, session in enumerate(sessions):
            out[i] += list(session.predict_kind(kind, heads))
        for session, (_, keys, values) in zip(sessions, blocks, strict=True):
            session.observe_kind(kind, keys if kind == "k" else values)
    for i, (session, (_, keys, values)) in enumerate(zip(sessions, blocks, strict=True)):
        out[i].append(session.finish(keys, values).surprise)
    return [torch.cat([t.flatten() for t in o]) for o in out]


@pytest.mark.parametrize("layer", [0, 3])
def test_blocks_of_a_layer_together_give_each_blocks_own_bits(layer):
    """Three same-shaped blocks in one `GridLayer` (one batched product), a shorter fourth in its own, against a
    session per block: the same bits; head by head (the encoder's `predict` / `observe`) too."""
    predictor = GridPredictor(calibration())
    blocks = [block_inputs(layer, 13 * i, 13, 2, seed=i, extreme=i == 1) for i in range(3)]
    blocks.append(block_inputs(layer, 39, 5, 2, seed=7))
    together = predictor.sessions([b[0] for b in blocks])
    assert len({id(s.layer) for s in together}) == 2 and all(isinstance(s, GridSession) for s in together)
    alone = run_blocks([predictor.session(b[0]) for b in blocks], blocks)
    for a, b in zip(run_blocks(together, blocks), alone, strict=True):
        assert same_bits(a, b)
        assert torch.isfinite(a).all()
    heads = calibration().meta["model"]["kv_heads"]
    for (inputs, keys, values), want in zip(blocks, alone, strict=True):
        session, got = predictor.session(inputs), []
        for kind, x in (("k", keys), ("v", values)):
            pairs = [session.predict(kind, h) for h in range(heads)]
            got += [torch.stack([m for m, _ in pairs]), torch.stack([s for _, s in pairs])]
            for h in range(heads):
                session.observe(kind, h, x[:, h])
        got.append(session.finish(keys, values).surprise)
        assert same_bits(torch.cat([t.flatten() for t in got]), want)
    with pytest.raises(RuntimeError, match="before every key head"):
        predictor.session(blocks[0][0]).predict("v", 0)


def test_statistics_are_belows_on_the_grid():
    """Surprises on the level grid (what a grid layer below passes up): the spread is below's (its float32 tables and
    pow, within rounding); the 7-bit features and weights put the means within ~1 % of below's float means."""
    from hf_kvcompress.predictors.below import BelowPredictor

    inputs, keys, values = block_inputs(2, 40, 24, 1, seed=3)
    session, below = GridPredictor(calibration()).session(inputs), BelowPredictor(calibration()).session(inputs)
    heads = calibration().meta["model"]["kv_heads"]
    for kind, x in (("k", keys), ("v", values)):
        mean, std = session.predict_kind(kind, heads)
        want_mean, want_std = below.predict_kind(kind, heads)
        assert (mean - want_mean).abs().mean() <= 0.02 * want_mean.abs().mean()
        if kind == "k":  # values: the surprise of this layer's keys, below's RMS against grid's level
            assert torch.allclose(std, want_std, rtol=1e-5)
        session.observe_kind(kind, x)
        below.observe_kind(kind, x)


# ---------------------------------------------------------------------- every CPU alike

SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
from hf_kvcompress.calibration import Calibration
from test_grid_predictor import statistics
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
blocks = torch.load({blocks!r}, weights_only=False)  # this test's own file
torch.save(statistics(blocks, Calibration.load({cal!r})), {result!r})
"""


def statistics(blocks, cal: Calibration | None = None) -> torch.Tensor:
    """Every block's grid statistics and finished surprise, flat (``cal``: the tests' calibration by default)."""
    cal = cal or calibration()
    predictor, heads, out = GridPredictor(cal), cal.meta["model"]["kv_heads"], []
    for inputs, keys, values in blocks:
        session = predictor.session(inputs)
        for kind, x in (("k", keys), ("v", values)):
            out += [t.flatten() for t in session.predict_kind(kind, heads)]
            session.observe_kind(kind, x)
        out.append(session.finish(keys, values).surprise.flatten())
    return torch.cat(out)


def test_statistics_are_the_same_bits_under_any_threads_cpu_capability_and_without_onednn(tmp_path):
    blocks = [block_inputs(layer, 100 * layer, 301, 2, seed=layer, extreme=layer == 4) for layer in range(LAYERS)]
    want = statistics(blocks)
    assert torch.isfinite(want).all()
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            assert same_bits(statistics(blocks), want)
    finally:
        torch.set_num_threads(threads)
    with torch.backends.mkldnn.flags(enabled=False):
        assert same_bits(statistics(blocks), want)
    calibration().save(tmp_path / "cal")
    torch.save(blocks, tmp_path / "blocks.pt")
    script = SCRIPT.format(tests=str(ROOT / "tests"), here=str(Path(__file__).resolve().parent), cal=str(tmp_path / "cal"), blocks=str(tmp_path / "blocks.pt"),
                           result=str(tmp_path / "result.pt"))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "3"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=300)
    assert same_bits(torch.load(tmp_path / "result.pt"), want)


# ---------------------------------------------------------------------- the cache


@pytest.mark.parametrize("coder", ["lanes", "huff"])
def test_generation_is_exact_and_decodes_a_layer_in_one_grid_layer(monkeypatch, coder):
    model, ids = model6(), random_ids(1, 70, seed=5)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "output_logits": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        want = model.generate(ids, cache=DynamicCache(), **kwargs)
        cache = CompressedCache(config(coder), model=model, calibration=calibration())
        got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want.logits, got.logits))
    assert len(cache.layers[0].blocks) >= 4
    built = []
    original = GridLayer.__init__

    def counted(self, heads, multipliers, frame, inputs):
        built.append(len(inputs))
        original(self, heads, multipliers, frame, inputs)

    monkeypatch.setattr(GridLayer, "__init__", counted)
    with torch.no_grad():
        model(got.sequences[:, -1:], cache=cache)
    assert built == [len(cache.layers[0].blocks)] * LAYERS  # every block of a layer in one batched product


def test_save_load_round_trip_is_exact_and_lists_nothing(tmp_path):
    from hf_kvcompress.cache.persist import read_header

    model, ids = model6(), random_ids(2, 60, seed=2)
    reference, cache = DynamicCache(), CompressedCache(config(), model=model, calibration=calibration())
    with torch.no_grad():
        model(ids[:, :50], cache=reference)
        model(ids[:, :50], cache=cache)
    path = cache.save(tmp_path / "grid.kvc", predictor="grid")
    header = read_header(path)
    rows = [r for e in header["layers"] for b in e["blocks"] for r in b["rows"]]
    assert rows and not any(r["listed"] for r in rows)  # float32 statistics every CPU computes: nothing settled
    loaded = CompressedCache.load(path, model=model, calibration=calibration(), config=config())
    for a, b in zip(cache.kv_layers(), loaded.kv_layers(), strict=True):
        assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
    with torch.no_grad():
        want = model(ids[:, 50:], cache=reference).logits
        got = model(ids[:, 50:], cache=loaded).logits
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))


def test_a_save_codes_grid_blocks_a_kind_at_a_time_with_the_bytes_of_stream_by_stream(tmp_path, monkeypatch):
    from hf_kvcompress import blockcoder

    model, ids = model6(), random_ids(2, 60, seed=3)
    cache = CompressedCache(config(), model=model, calibration=calibration())
    with torch.no_grad():
        model(ids, cache=cache)
    per_stream = []
    original = blockcoder._scaled
    monkeypatch.setattr(blockcoder, "_scaled", lambda *a, **k: per_stream.append(1) or original(*a, **k))
    stacked = cache.save(tmp_path / "stacked.kvc", predictor="grid").read_bytes()
    assert not per_stream  # every grid stream scaled and coded from stacked tensors
    monkeypatch.setattr(GridSession, "stacks_kind", False)  # the encoder's stream-by-stream path
    one_by_one = cache.save(tmp_path / "streams.kvc", predictor="grid").read_bytes()
    assert per_stream and stacked == one_by_one
