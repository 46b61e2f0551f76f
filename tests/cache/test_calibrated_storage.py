"""Calibrated storage by default (issue 48): where the model's calibration exists (given, or saved: found, never
fitted by a default save or store), `save()` and `PrefixStore` code with `CALIBRATED_STORAGE`; without one nothing
changes; ``predictor="generic"`` turns it off. Tiny six-layer model with a tokenizer, a temporary cache folder,
fits and lookups counted."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids, same_bits
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, PrefixStore
from hf_kvcompress.cache.persist import read_header
from hf_kvcompress.calibration import calibration_dir, calibration_for
from hf_kvcompress.predictors.registry import CALIBRATED_STORAGE

LOSSLESS = CompressionConfig(mode="lossless", block_tokens=16)


def filled(model, tokens: int = 70, **kwargs) -> CompressedCache:
    cache = CompressedCache(LOSSLESS, model=model, **kwargs)
    with torch.no_grad():
        model(random_ids(1, tokens, seed=3), cache=cache)
    return cache


def assert_same_kv(a: CompressedCache, b: CompressedCache) -> None:
    for x, y in zip(a.kv_layers(), b.kv_layers(), strict=True):
        assert same_bits(x.keys, y.keys) and same_bits(x.values, y.values)


def test_without_a_calibration_a_default_save_is_generic_and_fits_nothing(user_cache, model, fits, tmp_path):
    cache = filled(model)
    path = cache.save(tmp_path / "x.kvc")
    header = read_header(path)
    assert header["predictor"]["name"] == "generic" and header["calibration_sha256"] is None
    assert fits == [] and not calibration_dir(model).exists() and cache.calibration_pending


def test_a_saved_calibration_makes_the_default_save_calibrated(user_cache, model, fits, tmp_path):
    found, _ = calibration_for(model, progress=False)  # the first-use fit (its heads: what calibrated storage reads)
    assert fits
    fits.clear()
    cache = filled(model)  # calibration="auto": looked up at the save, not at construction
    assert cache.calibration_pending
    path = cache.save(tmp_path / "auto.kvc")
    header = read_header(path)
    assert header["predictor"]["name"] == CALIBRATED_STORAGE and header["calibration_sha256"] == found.digest
    assert fits == []  # found, not fitted
    loaded = CompressedCache.load(path, model=model)
    assert_same_kv(cache, loaded)
    generic = cache.save(tmp_path / "generic.kvc", predictor="generic")  # the argument that turns it off
    assert read_header(generic)["predictor"]["name"] == "generic"
    assert path.stat().st_size < generic.stat().st_size
    off = filled(model, calibration=None)  # a cache told to use none
    assert read_header(off.save(tmp_path / "none.kvc"))["predictor"]["name"] == "generic"


def test_an_unknown_or_wrongly_typed_save_predictor_is_refused(model, tmp_path):
    cache = filled(model, calibration=None)
    with pytest.raises(ValueError, match="unknown predictor 'gird'"):
        cache.save(tmp_path / "x.kvc", predictor="gird")
    with pytest.raises(TypeError, match="save: predictor"):
        cache.save(tmp_path / "x.kvc", predictor=3)


def test_the_store_codes_calibrated_chunks_where_the_calibration_exists(user_cache, model, fits, tmp_path):
    ids = random_ids(1, 64, seed=4)
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=reference)
    with PrefixStore(model, path=tmp_path / "plain", chunk_tokens=32, config=LOSSLESS) as store:
        assert store.predictor == "generic" and store.calibration is None  # none saved: nothing changes
        store.put(ids, reference)
    assert fits == []
    found, _ = calibration_for(model, progress=False)
    fits.clear()
    with PrefixStore(model, path=tmp_path / "auto", chunk_tokens=32, config=LOSSLESS) as store:
        assert store.predictor == CALIBRATED_STORAGE and store.calibration.digest == found.digest
        assert store.put(ids, reference) == 64
        cache = store.cache_for(torch.cat([ids, random_ids(1, 1, seed=5)], dim=1))  # both chunks, one token left
    with PrefixStore(model, path=tmp_path / "generic", chunk_tokens=32, config=LOSSLESS,
                     predictor="generic") as store:
        assert store.predictor == "generic"
    assert fits == [] and cache.get_seq_length() == 64
    for layer, held in zip(reference.layers, cache.kv_layers(), strict=True):
        assert same_bits(layer.keys, held.keys) and same_bits(layer.values, held.values)
