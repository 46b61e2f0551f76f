"""Save / load of every layer structure (cache format version 4): sliding windows, recurrent states, KV-sharing
gaps; the loaded cache continues exactly as DynamicCache continues; damage is refused with `CacheFileError`."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import RAW, SEALING, hybrid_model, random_ids, same_bits, sliding_model
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.persist import LAYERED, VERSION, CacheFileError, read_header


def models():
    return {"sliding-sealed": sliding_model(SEALING), "sliding-raw": sliding_model(RAW),
            "lfm2": hybrid_model("lfm2"), "falcon_h1": hybrid_model("falcon_h1")}


def continue_both(model, reference, cache, more):
    with torch.no_grad():
        want = model(more, cache=reference).logits
        got = model(more, cache=cache).logits
    assert same_bits(want, got)


@pytest.mark.parametrize("with_model", [True, False])
@pytest.mark.parametrize("kind", ["sliding-sealed", "sliding-raw", "lfm2", "falcon_h1"])
def test_save_load_continue_matches_dynamic_cache(kind, with_model, tmp_path):
    model = models()[kind]
    ids = random_ids(2, 75, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    reference = DynamicCache(config=model.config)
    # without a model the file is all there is: the loader builds each layer from it
    attach = {"model": model} if with_model else {"model_config": model.config}
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=4), calibration=None,
                            **attach)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=reference)
        model(ids, attention_mask=mask, cache=cache)
    path = cache.save(tmp_path / "c.kvc", predictor="generic")
    assert read_header(path)["version"] == LAYERED
    loaded = CompressedCache.load(path, model=model if with_model else None)
    assert loaded.get_seq_length() == reference.get_seq_length()
    for ours, theirs in zip(loaded.layers, reference.layers):
        if getattr(theirs, "keys", None) is not None:
            assert same_bits(ours.keys, theirs.keys) and same_bits(ours.values, theirs.values)
    more = random_ids(2, 3, seed=5)
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
    with torch.no_grad():
        want = model(more, attention_mask=full_mask, cache=reference).logits
        got = model(more, attention_mask=full_mask, cache=loaded).logits
    assert same_bits(want, got)


def test_a_full_attention_cache_is_still_written_as_version_3(tmp_path):
    from helpers import tiny_model

    model = tiny_model("llama-gqa")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache)
    assert read_header(cache.save(tmp_path / "c.kvc", predictor="generic"))["version"] == VERSION


def test_a_predictor_reading_the_layers_below_is_refused_for_windows(tmp_path):
    model = sliding_model(SEALING)
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 60), cache=cache)
    with pytest.raises(ValueError, match=r"reads the layers below.*predictor='generic'"):
        cache.save(tmp_path / "c.kvc", predictor="self")


def _resealed(path, edit):
    """The file with its JSON header edited by ``edit`` and its checksum recomputed (a buggy writer)."""
    import hashlib

    data = path.read_bytes()
    magic, version, size = struct.unpack_from("<8sII", data, 0)
    header = json.loads(data[16:16 + size])
    edit(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    body = struct.pack("<8sII", magic, version, len(blob)) + blob + data[16 + size:-32]
    path.write_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.parametrize("edit", [
    lambda h: h["layers"][0]["kv"].update(start=-1),
    lambda h: h["layers"][0]["kv"].update(sliding_window=7),
    lambda h: h["layers"][1]["kv"].update(start=3),
    lambda h: h["layers"][0]["kv"].update(value_dim=8),
    lambda h: h["layers"][0].update(kv=None, state=None),
    lambda h: h["layers"].reverse(),
    lambda h: h.update(kv_layers=2),
    lambda h: h.update(kv_heads=2),
    lambda h: h["layers"][0]["kv"]["blocks"].pop(),
])
def test_resealed_structural_edits_are_refused(edit, tmp_path):
    model = sliding_model(SEALING)
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 70), cache=cache)
    path = cache.save(tmp_path / "c.kvc", predictor="generic")
    _resealed(path, edit)
    with pytest.raises(CacheFileError):
        CompressedCache.load(path, model=model)


def test_resealed_state_edits_are_refused(tmp_path):
    model = hybrid_model("lfm2")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 30), cache=cache)
    path = cache.save(tmp_path / "c.kvc", predictor="generic")
    for edit in (lambda h: h["layers"][0]["state"].update(previous=[1]),
                 lambda h: h["layers"][0]["state"]["conv"][0].update(shape=[2, 64, 3]),
                 lambda h: h["layers"][0]["state"].update(conv_kernel=[None])):
        copy = tmp_path / "edited.kvc"
        copy.write_bytes(path.read_bytes())
        _resealed(copy, edit)
        with pytest.raises(CacheFileError):
            CompressedCache.load(copy, model=model)


def test_a_cache_of_recurrent_states_only_saves_and_continues(tmp_path):
    from architectures import tiny_model

    model = tiny_model("mamba2")
    ids = random_ids(1, 30, seed=6)
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(CompressionConfig(mode="lossless"), model=model, calibration=None)
    with torch.no_grad():
        model(ids, cache=reference)
        model(ids, cache=cache)
    path = cache.save(tmp_path / "c.kvc", predictor="generic")
    assert read_header(path)["tokens"] == 30  # from the recorded ids: states have no length of their own
    continue_both(model, reference, CompressedCache.load(path, model=model), random_ids(1, 1, seed=7))
    without_ids = CompressedCache(CompressionConfig(mode="lossless"), model_config=model.config, calibration=None)
    with torch.no_grad():
        model(ids, cache=without_ids)
    with pytest.raises(ValueError, match="recurrent states only needs the model attached"):
        without_ids.save(tmp_path / "d.kvc")


def test_files_of_a_model_whose_cache_has_other_heads_than_its_config_load(tmp_path):
    # falcon's multi-query attention caches one head whatever num_key_value_heads says; the identity check covers it
    from architectures import tiny_model

    model = tiny_model("falcon")
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8), model=model, calibration=None)
    ids = random_ids(1, 20, seed=8)
    with torch.no_grad():
        model(ids, cache=reference)
        model(ids, cache=cache)
    path = cache.save(tmp_path / "c.kvc", predictor="generic")
    continue_both(model, reference, CompressedCache.load(path, model=model), random_ids(1, 2, seed=9))
