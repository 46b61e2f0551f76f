"""The model's default calibration: found in the user cache folder, fitted on first use, used by `save`, found
again by `CompressedCache.load`; every way it can be missing or wrong (tiny models, a temporary cache folder,
no network)."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_tiny_model, random_ids
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress.cache.persist import CacheFileError, read_header
from hf_kvcompress.calibration import (
    META_FILE,
    TENSORS_FILE,
    Calibration,
    calibration_dir,
    calibration_for,
)
from hf_kvcompress.generation import greedy_generate
from hf_kvcompress_eval.env import walk_held_bytes

#: saves with the calibrated `context` predictor (the default save codes generation's blocks and reads none)
LOSSLESS = CompressionConfig(mode="lossless", block_tokens=16, lossless=LosslessConfig(save_predictor="context"))


def test_first_use_fits_saves_and_later_caches_find_it(user_cache, model, fits, tmp_path, capsys):
    cache = CompressedCache(LOSSLESS, model=model)
    folder = calibration_dir(model)
    assert fits == [] and cache.calibration is None  # generation does not use one: looked up at the first save
    with torch.no_grad():
        model(random_ids(1, 40), cache=cache)
    cache.save(tmp_path / "first.kvc")
    assert fits == [["below", "context"]]
    assert folder.is_relative_to(user_cache) and (folder / META_FILE).is_file() and (folder / TENSORS_FILE).is_file()
    assert cache.stats()["calibration"] == f"fitted on first use, saved to {folder}"
    assert f"saved to {folder}" in capsys.readouterr().err  # the one-line note
    assert cache.calibration.predictors == ["below", "context"]  # the first-use heads and the named ones

    again = CompressedCache(LOSSLESS, model=model)
    assert again.resolve_calibration() is again.calibration
    assert fits == [["below", "context"]]  # found, not fitted again
    assert again.stats()["calibration"] == str(folder)
    assert again.calibration.digest == cache.calibration.digest

    # generation is DynamicCache's, bit for bit; the in-generation predictor holds none of the calibration
    prompt = random_ids(1, 40)
    want = greedy_generate(model, prompt, DynamicCache(), 8, output_logits=True, return_dict_in_generate=True)
    got = greedy_generate(model, prompt, again, 8, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want.logits, got.logits))
    stats = again.stats()
    assert stats["predictor"] == "generic" and stats["calibration_bytes"] == 0
    walked = walk_held_bytes(again, skip=[again.model_config, again.lossless.predictor])  # calibration walked
    assert stats["held_bytes"] == walked, (stats["held_bytes"], walked)

    # save codes with the calibrated context heads, releases them after; load finds the calibration itself
    path = again.save(tmp_path / "prompt.kvc")
    assert read_header(path)["calibration_sha256"] == again.calibration.digest
    assert read_header(path)["predictor"]["name"] == "context"
    assert again.stats()["calibration_bytes"] == 0
    loaded = CompressedCache.load(path, model=model)
    assert fits == [["below", "context"]]
    for a, b in zip(again.kv_layers(), loaded.kv_layers()):
        assert torch.equal(a.keys.view(torch.int16), b.keys.view(torch.int16))
        assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))


def test_the_calibrated_save_beats_the_uncalibrated_one(user_cache, model, tmp_path):
    prompt = random_ids(1, 96)
    sizes = {}
    for name, calibration in (("auto", "auto"), ("off", None)):
        cache = CompressedCache(LOSSLESS, model=model, calibration=calibration)
        with torch.no_grad():
            model(prompt, cache=cache)
        sizes[name] = cache.save(tmp_path / f"{name}.kvc").stat().st_size
    assert sizes["auto"] < sizes["off"]


def test_calibration_none_turns_the_lookup_off(user_cache, model, fits):
    cache = CompressedCache(LOSSLESS, model=model, calibration=None)
    assert fits == [] and cache.calibration is None and cache.stats()["calibration"] == "none"
    assert not (user_cache / "calibrations").exists()


def test_no_fit_where_nothing_needs_one(user_cache, model, fits):
    generic_only = CompressionConfig(mode="lossless", lossless=LosslessConfig(save_predictor="generic"))
    for config in (CompressionConfig(mode="none"), generic_only):
        assert CompressedCache(config, model=model).calibration is None
    assert CompressedCache(LOSSLESS).stats()["calibration"].startswith("none: no model attached")
    assert fits == []


def test_a_model_without_a_tokenizer_codes_without_calibration(user_cache, fits, recwarn):
    model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6)  # names no folder: no tokenizer to find
    cache = CompressedCache(LOSSLESS, model=model)
    assert cache.resolve_calibration() is None and fits == [] and not recwarn.list
    assert "tokenizer" in cache.stats()["calibration"]
    assert cache.stats()["predictor"] == "generic"


def test_fit_false_only_looks(user_cache, model, fits):
    found, note = calibration_for(model, fit=False)
    assert found is None and "no calibration" in note and fits == []


def test_an_unreadable_default_calibration_is_replaced(user_cache, model, fits, capsys):
    first = CompressedCache(LOSSLESS, model=model).resolve_calibration()
    folder = calibration_dir(model)
    raw = (folder / TENSORS_FILE).read_bytes()
    (folder / TENSORS_FILE).write_bytes(raw[:-8] + bytes(b ^ 0xFF for b in raw[-8:]))
    second = CompressedCache(LOSSLESS, model=model)
    second.resolve_calibration()
    assert len(fits) == 2 and "unusable" in capsys.readouterr().err
    assert second.calibration.digest == Calibration.load(folder, model).digest
    assert first.predictors == second.calibration.predictors


def test_load_needs_the_calibration_the_file_names(user_cache, model, tmp_path):
    cache = CompressedCache(LOSSLESS, model=model)
    with torch.no_grad():
        model(random_ids(1, 40), cache=cache)
    path = cache.save(tmp_path / "x.kvc")
    with pytest.raises(CacheFileError, match="pass model="):
        CompressedCache.load(path)  # no model: no default calibration to look up
    folder = calibration_dir(model)
    (folder / META_FILE).rename(folder / "moved.json")
    with pytest.raises(CacheFileError, match="missing"):
        CompressedCache.load(path, model=model)
    (folder / "moved.json").rename(folder / META_FILE)
    assert CompressedCache.load(path, model=model).calibration.digest == cache.calibration.digest
    # a default calibration refitted since: the file names the old one
    other = Calibration.fit(model, None, ids=random_ids(1, 512), tokens=512, chunk=256, predictors=("context",),
                            progress=False)
    other.save(folder)
    with pytest.raises(CacheFileError, match="pass the calibration it was saved with"):
        CompressedCache.load(path, model=model)


def test_groups_are_read_when_used_and_checked(tmp_path, model):
    fitted = Calibration.fit(model, None, ids=random_ids(1, 512), tokens=512, chunk=256,
                             predictors=("none", "context"), progress=False)
    fitted.save(tmp_path / "cal")
    loaded = Calibration.load(tmp_path / "cal", model)
    assert loaded.loaded_bytes() == 0 and loaded.digest == fitted.digest
    heads = loaded.stream_heads("context", 2)
    context_bytes = sum(t.numel() * t.element_size() for n, t in fitted.tensors.items() if n.startswith("context/"))
    assert loaded.loaded_bytes() == context_bytes
    assert all(head.weight.dtype == torch.float32 for head in heads.values())
    assert fitted.tensors["context/L2/k0/weight"].dtype == torch.float16  # stored compactly
    loaded.release()
    assert loaded.loaded_bytes() == 0
    assert torch.equal(loaded.stream_heads("context", 2)[("v", 1)].weight, heads[("v", 1)].weight)
