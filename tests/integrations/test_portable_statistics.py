"""Files and chunks coded by a predictor whose float64 arithmetic rounds differently on another CPU still decode
bit for bit: the decoder here is made to compute other statistics (every mean and std moved by up to its
bound, as another CPU's BLAS / libm could) and must give back the exact values; without the encoder's list of
uncertain elements it must fail with the documented error, never decode wrongly."""

from __future__ import annotations

import functools

import pytest
import torch
from chunk_testutil import channel_chunk
from helpers import fresh_tiny_model, random_ids, same_bits

import hf_kvcompress.blockcodec as blockcodec
import hf_kvcompress.blockcoder as blockcoder
import hf_kvcompress.predictors.linear as linear
from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.errors import CacheFileError, ChunkPayloadError
from hf_kvcompress.integrations import kv_chunk
from hf_kvcompress.integrations.kv_chunk import ChunkCoder
from hf_kvcompress.predictors.rope import RopeFrame


@functools.cache
def _model_and_calibration():
    model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6)
    calibration = Calibration.fit(model, None, ids=random_ids(1, 256, seed=4), tokens=256, chunk=128,
                                  predictors=("none", "context"), progress=False)
    return model, calibration


def _shake(monkeypatch, session_class, scale: float = 0.999) -> None:
    """Make ``session_class.predict`` return statistics moved by up to ``scale`` times its own bounds."""
    original = session_class.predict

    def predict(self, kind, head):
        mean, std = original(self, kind, head)
        if mean.dtype != torch.float64:
            return mean, std
        mean_tol, std_tol = self.bounds(kind, head)
        g = torch.Generator().manual_seed(hash((kind, head, mean.shape)) % (1 << 31))
        shift = torch.rand((2, *mean.shape), generator=g, dtype=torch.float64) * 2 - 1
        shift = torch.where(shift.abs() > 0.5, shift.sign(), shift)  # half of them at the bounds
        return mean + scale * shift[0] * mean_tol, std + scale * shift[1] * std_tol

    monkeypatch.setattr(session_class, "predict", predict)


def _wide_tolerances(monkeypatch, width: float = 2.0**-14) -> None:
    # bounds far wider than real rounding (2^-40 and 2^-44 of the terms' magnitude), so that a small cache lists
    # elements and moved statistics cross class boundaries: what the list is for
    monkeypatch.setattr(linear, "MEAN_TOLERANCE", width)
    monkeypatch.setattr(linear, "STD_TOLERANCE", width * 32)
    monkeypatch.setattr(linear, "ROUNDING_TOLERANCE", width)


@pytest.mark.parametrize("predictor", ["context", "none"])
def test_a_saved_file_decodes_where_the_predictor_rounds_otherwise(monkeypatch, tmp_path, predictor):
    model, calibration = _model_and_calibration()
    _wide_tolerances(monkeypatch)
    config = CompressionConfig(mode="lossless", block_tokens=64, lossless=LosslessConfig(save_predictor=predictor))
    cache = CompressedCache(config, calibration=calibration)
    with torch.inference_mode():
        model(random_ids(2, 150, seed=8), cache=cache, use_cache=True)
    path = cache.save(tmp_path / "x.kvc")
    from hf_kvcompress.cache.persist import read_header

    listed = sum(r["listed"]["shape"][0] for e in read_header(path)["layers"] for b in e["blocks"]
                 for r in b["rows"] if r["listed"])
    assert listed > 100  # the wide bounds make the list matter
    _shake(monkeypatch, linear.LinearSession)
    loaded = CompressedCache.load(path, calibration=calibration)
    for a, b in zip(cache.layers, loaded.layers):
        assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
    # the list is what makes it work: without it the decoder's own settlement of those elements differs
    monkeypatch.setattr(blockcodec, "_listed_of", lambda row, stream: blockcodec.np.zeros((0, 3), blockcodec.np.int32))
    with pytest.raises(CacheFileError, match="does not reproduce here"):
        CompressedCache.load(path, calibration=calibration)


def test_a_file_of_float32_statistics_would_not_survive_the_same_rounding(monkeypatch, tmp_path):
    """The control: the same shaking applied to unsettled statistics (rounded to float32 as version 2 coded
    them) fails, so the test above can fail."""
    model, calibration = _model_and_calibration()
    _wide_tolerances(monkeypatch)
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=64), calibration=calibration)
    with torch.inference_mode():
        model(random_ids(1, 100, seed=9), cache=cache, use_cache=True)

    def plain(mean, std, factors, bounds, dtype, config):
        stds = torch.stack([std[b] * f for b, f in enumerate(factors)])
        return mean.float(), stds.float(), [blockcodec.np.zeros((0, 3), blockcodec.np.int32)] * mean.shape[0]

    monkeypatch.setattr(blockcoder, "settle_stream", plain)
    path = cache.save(tmp_path / "x.kvc", predictor="context")
    _shake(monkeypatch, linear.LinearSession)
    with pytest.raises(CacheFileError, match="does not reproduce here"):
        CompressedCache.load(path, calibration=calibration)


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_chunk_decodes_where_the_predictor_rounds_otherwise(monkeypatch, calibrated):
    model, calibration = _model_and_calibration()
    if calibrated:
        _wide_tolerances(monkeypatch, 2.0**-27)  # wide, but the body stays compressed
        coder, session = ChunkCoder(calibration), linear.LinearSession
        keys = [layer.keys for layer in _prefill(model)]
        values = [layer.values for layer in _prefill(model)]
        chunk = torch.stack([torch.stack([k[0].transpose(0, 1).reshape(k.shape[2], -1) for k in keys]),
                             torch.stack([v[0].transpose(0, 1).reshape(v.shape[2], -1) for v in values])])
    else:
        monkeypatch.setattr(kv_chunk, "ROUNDING_TOLERANCE", 2.0**-22)  # wide, but the body stays compressed
        coder = ChunkCoder(rope=RopeFrame.standard(10000.0, 16), kv_heads=2, head_dim=16)
        session, chunk = kv_chunk._RelativeStatsSession, channel_chunk((2, 3, 96, 32))
    payload = coder.encode(chunk, **({"first_position": 0} if calibrated else {}))
    assert kv_chunk.parse_header(payload).mode == (kv_chunk.MODE_CONTEXT if calibrated else kv_chunk.MODE_STATS)
    _shake(monkeypatch, session)
    assert same_bits(coder.decode(payload), chunk)
    resettle = blockcoder.resettle_stream
    monkeypatch.setattr(blockcoder, "resettle_stream", lambda mean, std, factors, listed, dtype, config:
                        resettle(mean, std, factors, [listed[0][:0]], dtype, config))
    with pytest.raises(ChunkPayloadError):
        coder.decode(payload)


@functools.cache
def _prefill(model):
    cache = CompressedCache(CompressionConfig(mode="none"))
    with torch.inference_mode():
        model(random_ids(1, 80, seed=10), cache=cache, use_cache=True)
    return cache.layers


def test_only_bytes_that_leave_the_process_use_portable_statistics(monkeypatch, tmp_path):
    """Generation codes float32 statistics (faster; its blocks never leave the process); save and load code and
    read float64 settled ones."""
    model, calibration = _model_and_calibration()
    seen = []
    original = linear.LinearSession.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self.portable)

    monkeypatch.setattr(linear.LinearSession, "__init__", record)
    config = CompressionConfig(mode="lossless", block_tokens=32, lossless=LosslessConfig(predictor="context"))
    cache = CompressedCache(config, calibration=calibration)
    with torch.inference_mode():
        model(random_ids(1, 100, seed=12), cache=cache, use_cache=True)
    assert seen and not any(seen)
    # reading the cache's blocks for the file decodes them with generation's sessions; the file's are portable
    seen.clear()
    path = cache.save(tmp_path / "x.kvc", predictor="context")
    assert True in seen
    seen.clear()
    CompressedCache.load(path, calibration=calibration)
    assert True in seen
