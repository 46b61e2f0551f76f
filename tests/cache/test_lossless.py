"""Lossless mode: generation identical to DynamicCache, save / load / continue, and every refusal."""

from __future__ import annotations

import functools

import pytest
import torch
from cache_file_testutil import seal, split
from helpers import random_ids, same_bits, tiny_model
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.persist import CacheFileError, read_header
from hf_kvcompress.calibration import Calibration, CalibrationError

MODEL = "llama-gqa"


@functools.cache
def calibration(kind: str = MODEL) -> Calibration:
    model = tiny_model(kind, torch.bfloat16)
    return Calibration.fit(model, None, ids=random_ids(1, 512, seed=9), tokens=512, chunk=128, probe_layers=(1,),
                           progress=False)


def lossless(predictor: str = "context", **kwargs) -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=4, lossless={"predictor": predictor, **kwargs})



def generate(model, ids, cache, **kwargs):
    kwargs.setdefault("max_new_tokens", 12)
    with torch.no_grad():
        return model.generate(ids, cache=cache, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa", "qwen3-gqa"])
@pytest.mark.parametrize("calibrated", [False, True])
def test_generation_identical_to_dynamic_cache(kind, calibrated):
    model = tiny_model(kind, torch.bfloat16)
    ids = random_ids(1, 41)
    kwargs = {"output_logits": True, "return_dict_in_generate": True}
    expected = generate(model, ids, DynamicCache(), **kwargs)
    cache = CompressedCache(lossless(), model=model, calibration=calibration(kind) if calibrated else None)
    got = generate(model, ids, cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(expected.logits, got.logits):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert len(cache.layers[0].blocks) >= 2
    assert cache.stats()["mode"] == "lossless"


def test_beam_search_and_padded_batch_are_identical():
    model = tiny_model(MODEL, torch.bfloat16)
    ids = random_ids(2, 30, seed=4)
    mask = torch.ones_like(ids)
    ids[0, :7] = 0
    mask[0, :7] = 0
    expected = generate(model, ids, DynamicCache(), attention_mask=mask, num_beams=3)
    got = generate(model, ids, CompressedCache(lossless(), model=model, calibration=calibration()), attention_mask=mask,
                   num_beams=3)
    assert torch.equal(got, expected)


def test_sealed_blocks_hold_bytes_not_tensors():
    model = tiny_model(MODEL, torch.bfloat16)
    cache = CompressedCache(lossless(), model=model, calibration=calibration())
    with torch.no_grad():
        model(random_ids(1, 100), cache=cache)
    layer = cache.layers[1]
    assert all(not hasattr(block, "keys") for block in layer.blocks)
    stats = cache.stats(per_layer=True)
    assert stats["stored_bytes"] == sum(s["stored_bytes"] for s in stats["per_layer"])
    assert stats["raw_bytes"] == 2 * 2 * 2 * 100 * 16 * 2  # layers * kv * heads * tokens * dim * bf16


@pytest.mark.parametrize(("predictor", "saved_with"), [("context", None), ("context", "probe"), ("context", "twin"),
                                                        ("none", None)])
def test_save_load_continue_equals_uninterrupted(tmp_path, predictor, saved_with):
    model = tiny_model(MODEL, torch.bfloat16)
    ids = random_ids(1, 50, seed=2)
    expected = generate(model, ids, DynamicCache(), max_new_tokens=15)
    cache = CompressedCache(lossless(predictor), model=model, calibration=calibration())
    # half the prompt as a prefill, the rest token by token: the file must not care how it was produced
    with torch.no_grad():
        model(ids[:, :30], cache=cache)
        for t in range(30, 49):
            model(ids[:, t : t + 1], cache=cache)
    path = cache.save(tmp_path / "prefix.kvc", predictor=saved_with, probe_layer=1)
    loaded = CompressedCache.load(path, model=model, calibration=calibration())
    for a, b in zip(cache.kv_layers(), loaded.kv_layers()):
        assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
    assert torch.equal(loaded.token_ids, ids[:, :49])
    assert torch.equal(generate(model, ids, loaded, max_new_tokens=15), expected)


def test_uncalibrated_cache_saves_without_a_model(tmp_path):
    cache = CompressedCache(lossless())
    k, v = torch.randn(1, 2, 40, 8).bfloat16(), torch.randn(1, 2, 40, 8).bfloat16()
    cache.update(k, v, 0)
    loaded = CompressedCache.load(cache.save(tmp_path / "x.kvc"))
    assert same_bits(loaded.layers[0].keys, k) and same_bits(loaded.layers[0].values, v)


@pytest.fixture
def saved(tmp_path):
    model = tiny_model(MODEL, torch.bfloat16)
    cache = CompressedCache(lossless(), model=model, calibration=calibration())
    with torch.no_grad():
        model(random_ids(1, 40), cache=cache)
    return cache.save(tmp_path / "saved.kvc", predictor="probe", probe_layer=1), model


def test_a_file_of_a_predictor_that_reruns_the_model_records_the_machine(saved):
    """Its bits depend on the machine's kernels: the header says which ones (`persist.reproducibility`), for the
    refusal's message where it does not reproduce; other files name no machine (tests/cache/test_cache_file.py)."""
    from hf_kvcompress.cache.persist import read_header, reproducibility

    assert read_header(saved[0])["reproducibility"] == reproducibility()


def test_refuses_another_model(saved):
    path, _ = saved
    other = tiny_model("llama-mqa", torch.bfloat16)
    with pytest.raises(CacheFileError, match="saved from model"):
        CompressedCache.load(path, model=other)


def test_refuses_another_or_missing_calibration(saved, tmp_path):
    path, model = saved
    with pytest.raises(CacheFileError, match="calibration"):
        CompressedCache.load(path, model=model)
    other = Calibration.fit(model, None, ids=random_ids(1, 256, seed=1), tokens=256, chunk=128, probe_layers=(1,),
                            progress=False)
    with pytest.raises(CacheFileError, match="calibration"):
        CompressedCache.load(path, model=model, calibration=other)


def test_refuses_another_library_version(saved, tmp_path):
    path, model = saved
    header, payload = split(path.read_bytes())
    header["library_version"] = "0.0.1"
    bad = tmp_path / "old.kvc"
    bad.write_bytes(seal(header, payload))
    with pytest.raises(CacheFileError, match=r"saved by hf_kvcompress 0\.0\.1"):
        CompressedCache.load(bad, model=model, calibration=calibration())


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "empty"])
def test_refuses_corrupt_files(saved, tmp_path, damage):
    path, model = saved
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[-50] ^= 0x10
    elif damage == "magic":
        data[:8] = b"NOTACACH"
    else:
        data = bytearray()
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(bytes(data))
    with pytest.raises(CacheFileError):
        CompressedCache.load(bad, model=model, calibration=calibration())


def test_refuses_a_predictor_that_does_not_reproduce(saved, monkeypatch):
    path, model = saved
    from hf_kvcompress.predictors import probe

    original = probe.run_decoder

    def drifting(*args, **kwargs):  # stands in for another thread count / CPU: last-bit differences
        cache, hidden = original(*args, **kwargs)
        return cache, {k: h * (1 + 2**-20) for k, h in hidden.items()}

    monkeypatch.setattr(probe, "run_decoder", drifting)
    with pytest.raises(CacheFileError, match="does not reproduce here"):
        CompressedCache.load(path, model=model, calibration=calibration())


def test_calibration_round_trip_and_refusals(tmp_path):
    model = tiny_model(MODEL, torch.bfloat16)
    cal = calibration()
    cal.save(tmp_path / "cal")
    again = Calibration.load(tmp_path / "cal", model)
    assert again.predictors == cal.predictors
    assert set(again.meta["versions"]) >= {"torch", "transformers"}
    with pytest.raises(CalibrationError, match="fingerprint"):
        Calibration.load(tmp_path / "cal", tiny_model("llama-mqa", torch.bfloat16))
    with pytest.raises(CalibrationError, match="no calibration"):
        Calibration.load(tmp_path / "missing")
    raw = (tmp_path / "cal" / "calibration.safetensors").read_bytes()
    (tmp_path / "cal" / "calibration.safetensors").write_bytes(raw[:-8] + bytes(b ^ 0xFF for b in raw[-8:]))
    with pytest.raises(CalibrationError, match=r"corrupt|cannot read"):
        Calibration.load(tmp_path / "cal")
    del model


@pytest.mark.parametrize("predictor", ["probe", "twin"])
def test_model_running_predictors_are_refused_inside_generation(predictor):
    """Refused by the config (storage only), before a cache, a model or a calibration is looked at."""
    with pytest.raises(ValueError, match=f"LosslessConfig.predictor cannot be '{predictor}'.*storage only"):
        lossless(predictor)


def test_save_predictor_probe_is_the_default_of_save(tmp_path):
    """Where the refused in-generation setting points: LosslessConfig(save_predictor='probe') codes save() files."""
    model = tiny_model(MODEL, torch.bfloat16)
    cache = CompressedCache(lossless(save_predictor="probe", probe_layer=1), model=model, calibration=calibration())
    with torch.no_grad():
        model(random_ids(1, 40), cache=cache)
    path = cache.save(tmp_path / "probe.kvc")
    assert read_header(path)["predictor"] == {"name": "probe", "probe_layer": 1}
    loaded = CompressedCache.load(path, model=model, calibration=calibration())
    assert same_bits(loaded.layers[0].keys, cache.layers[0].keys)


def test_a_file_saved_with_probe_loads_with_the_default_config(saved):
    """The saved config is the one generate() ran with; the probe is the file's own predictor."""
    path, model = saved
    assert read_header(path)["predictor"]["name"] == "probe"
    loaded = CompressedCache.load(path, model=model, calibration=calibration())
    assert loaded.config.lossless.predictor == "context"
    assert loaded.get_seq_length() > 0


def test_stale_calibration_heads_are_a_clear_error():
    model = tiny_model(MODEL, torch.bfloat16)
    stale = Calibration(dict(calibration().meta), dict(calibration().tensors))
    key = "context/L1/k0/weight"
    stale.tensors[key] = stale.tensors[key][:-16]  # as if fitted with one feature block fewer
    cache = CompressedCache(lossless(), model=model, calibration=stale)
    with pytest.raises(ValueError, match="recalibrate"), torch.no_grad():
        model(random_ids(1, 40), cache=cache)


def test_twin_leaves_the_caches_token_hooks_on_the_original():
    """build_twin copies the model without the caches' recorder hooks (a cache collected mid-copy used to
    remove its hook from the dict being copied)."""
    from hf_kvcompress.predictors.twin import build_twin

    model = tiny_model("llama-gqa")
    caches = [CompressedCache(CompressionConfig(mode="lossless"), model=model) for _ in range(3)]
    hooks, ended = dict(model._forward_pre_hooks), dict(model._forward_hooks)
    twin = build_twin(model)
    assert len(twin._forward_pre_hooks) == 0 and len(twin._forward_pre_hooks_with_kwargs) == 0
    assert len(twin._forward_hooks) == 0 and len(twin._forward_hooks_always_called) == 0
    assert dict(model._forward_pre_hooks) == hooks and len(hooks) >= len(caches)
    assert dict(model._forward_hooks) == ended and len(ended) >= len(caches)  # a step's end (a failed one undone)
    del caches
