"""``calibration="auto"`` looks the model's calibration up (or fits it) only when something uses it: at
construction when the in-generation predictor reads one, else on the first save whose predictor does (or
`CompressedCache.resolve_calibration`). Tiny six-layer models with a tokenizer, a temporary cache folder, the
lookups counted where the cache calls them."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids

import hf_kvcompress.cache.cache as cache_module
from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress.cache.cache import PENDING_NOTE, PENDING_ON_REQUEST_NOTE
from hf_kvcompress.cache.persist import read_header
from hf_kvcompress.calibration import calibration_dir
from hf_kvcompress_eval.env import walk_held_bytes

LOSSLESS = CompressionConfig(mode="lossless", block_tokens=16)
#: files saved with the calibrated `context` predictor unless told otherwise (the default saves with `generic`)
CONTEXT_SAVE = CompressionConfig(mode="lossless", block_tokens=16, lossless=LosslessConfig(save_predictor="context"))


def lossless(**settings) -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=16, lossless=LosslessConfig(**settings))


@pytest.fixture
def lookups(monkeypatch):
    """Counts the cache's calls of `calibration_for` (the real one still runs)."""
    calls = []
    real = cache_module.calibration_for

    def counting(model, **kwargs):
        calls.append(model)
        return real(model, **kwargs)

    monkeypatch.setattr(cache_module, "calibration_for", counting)
    return calls


def filled(config: CompressionConfig, model, tokens: int = 40, **kwargs) -> CompressedCache:
    cache = CompressedCache(config, model=model, **kwargs)
    with torch.no_grad():
        model(random_ids(1, tokens), cache=cache)
    return cache


def held_bytes_walked(cache: CompressedCache) -> int:
    return walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])


def test_the_default_cache_looks_nothing_up_at_construction(user_cache, model, lookups, capsys):
    for config in (CompressionConfig(mode="lossless"), LOSSLESS):
        cache = CompressedCache(config, model=model)
        assert lookups == [] and cache.calibration is None and cache.calibration_pending
        assert cache.stats()["calibration"] == PENDING_NOTE  # the default save looks one up (never fits it)
    assert not (user_cache / "calibrations").exists()
    assert "hf_kvcompress:" not in capsys.readouterr().err  # no first-use line, no progress bar

    cache = filled(LOSSLESS, model, tokens=70)  # sealed blocks, coded without a calibration
    stats = cache.stats()
    assert lookups == [] and stats["predictor"] == "generic" and stats["calibration"] == PENDING_NOTE
    assert stats["calibration_bytes"] == 0 and stats["held_bytes"] == held_bytes_walked(cache)


@pytest.mark.parametrize("predictor", ["context", "none", "below"])
def test_a_calibrated_generation_predictor_looks_up_at_construction(user_cache, model, lookups, tmp_path, predictor):
    cache = CompressedCache(lossless(predictor=predictor), model=model)
    assert lookups == [model] and not cache.calibration_pending and cache.calibration is not None
    assert cache.stats()["calibration"].startswith("fitted on first use")
    assert cache.stats()["predictor"] == predictor  # coding with the calibration, not block statistics
    assert predictor in cache.calibration.predictors  # its heads fitted on first use too
    with torch.no_grad():
        model(random_ids(1, 40), cache=cache)
    cache.save(tmp_path / "x.kvc")
    assert cache.resolve_calibration() is cache.calibration and len(lookups) == 1


def test_a_save_with_below_fits_its_heads_on_first_use(user_cache, model, lookups, tmp_path):
    cache = filled(LOSSLESS, model, tokens=70)  # generic in generation: nothing looked up yet
    path = cache.save(tmp_path / "below.kvc", predictor="below")
    assert lookups == [model] and "below" in cache.calibration.predictors
    loaded = CompressedCache.load(path, model=model)
    for a, b in zip(cache.kv_layers(), loaded.kv_layers()):
        assert torch.equal(a.keys.view(torch.int16), b.keys.view(torch.int16))
        assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))


def test_the_first_save_looks_up_once(user_cache, model, lookups, tmp_path, capsys):
    cache = filled(CONTEXT_SAVE, model)
    assert cache.stats()["calibration"] == PENDING_NOTE and lookups == []
    capsys.readouterr()
    first = cache.save(tmp_path / "first.kvc")  # save_predictor "context": reads a calibration
    folder = calibration_dir(model)
    assert lookups == [model] and not cache.calibration_pending
    assert f"saved to {folder}" in capsys.readouterr().err  # the first-use line, at the save
    assert cache.stats()["calibration"] == f"fitted on first use, saved to {folder}"
    assert cache.calibration.predictors == ["below", "context"]  # the first-use heads and the named ones
    header = read_header(first)
    assert header["predictor"]["name"] == "context" and header["calibration_sha256"] == cache.calibration.digest
    stats = cache.stats()  # the heads read for the save are dropped again: generation does not hold them
    assert stats["calibration_bytes"] == 0 and stats["held_bytes"] == held_bytes_walked(cache)

    second = cache.save(tmp_path / "second.kvc")
    assert len(lookups) == 1 and cache.resolve_calibration() is cache.calibration and len(lookups) == 1
    assert read_header(second)["calibration_sha256"] == cache.calibration.digest

    loaded = CompressedCache.load(first, model=model)  # finds the calibration by its checksum, never looks up
    assert len(lookups) == 1 and not loaded.calibration_pending
    assert loaded.calibration.digest == cache.calibration.digest
    for a, b in zip(cache.kv_layers(), loaded.kv_layers()):
        assert torch.equal(a.keys.view(torch.int16), b.keys.view(torch.int16))
        assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))


def test_a_generic_save_never_looks_up(user_cache, model, lookups, tmp_path):
    cache = filled(LOSSLESS, model)
    path = cache.save(tmp_path / "generic.kvc", predictor="generic")
    assert lookups == [] and cache.calibration_pending and cache.stats()["calibration"] == PENDING_NOTE
    assert read_header(path)["calibration_sha256"] is None
    loaded = CompressedCache.load(path, model=model)  # a file without a calibration: loaded without one
    assert lookups == [] and loaded.calibration is None and not loaded.calibration_pending

    generic = filled(lossless(save_predictor="generic"), model)
    assert generic.stats()["calibration"] == PENDING_ON_REQUEST_NOTE
    generic.save(tmp_path / "default.kvc")
    assert lookups == [] and not (user_cache / "calibrations").exists()
    filled(LOSSLESS, model).save(tmp_path / "auto.kvc")  # calibrated storage looks one up, never fits one
    assert len(lookups) == 1 and not (user_cache / "calibrations").exists()
    assert read_header(tmp_path / "auto.kvc")["predictor"]["name"] == "generic"
    lookups.clear()
    path = generic.save(tmp_path / "asked.kvc", predictor="context")  # a save that asks for one resolves it
    assert lookups == [model] and read_header(path)["calibration_sha256"] == generic.calibration.digest


def test_resolve_calibration_is_idempotent(user_cache, model, lookups):
    cache = CompressedCache(LOSSLESS, model=model)
    found = cache.resolve_calibration()
    assert found is not None and cache.resolve_calibration() is found and lookups == [model]
    stats = cache.stats()
    assert stats["calibration"].startswith("fitted on first use") and not cache.calibration_pending
    assert stats["calibration_bytes"] == found.loaded_bytes() and stats["held_bytes"] == held_bytes_walked(cache)
    assert stats["predictor"] == "generic"  # generation keeps coding as it was built

    again = CompressedCache(LOSSLESS, model=model)
    assert again.resolve_calibration().digest == found.digest and again.stats()["calibration"] == str(
        calibration_dir(model))


def test_nothing_is_pending_where_auto_finds_nothing_to_use(user_cache, model, lookups):
    cases = {
        "none: no model attached (pass model= to use its calibration)": CompressedCache(LOSSLESS),
        "none: not used in this mode": CompressedCache(CompressionConfig(mode="none"), model=model),
        "none": CompressedCache(LOSSLESS, model=model, calibration=None),
    }
    for note, cache in cases.items():
        assert not cache.calibration_pending and cache.stats()["calibration"] == note
        assert cache.resolve_calibration() is None and cache.stats()["calibration"] == note
    assert lookups == []


def test_an_interrupted_lookup_stays_pending(user_cache, model, monkeypatch):
    calls = []
    real = cache_module.calibration_for

    def interrupted_once(model, **kwargs):
        calls.append(model)
        if len(calls) == 1:
            raise KeyboardInterrupt  # e.g. Ctrl-C during the first-use fit
        return real(model, **kwargs)

    monkeypatch.setattr(cache_module, "calibration_for", interrupted_once)
    cache = CompressedCache(LOSSLESS, model=model)
    with pytest.raises(KeyboardInterrupt):
        cache.resolve_calibration()
    assert cache.calibration_pending and cache.calibration is None and cache.stats()["calibration"] == PENDING_NOTE
    assert cache.resolve_calibration() is not None and len(calls) == 2 and not cache.calibration_pending
