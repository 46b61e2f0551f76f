"""The embedded default model and text: loaders, caching, disjoint splits, clear errors."""

from __future__ import annotations

import pytest

from hf_kvcompress import data, models


def test_shakespeare_splits_are_disjoint_plays():
    calibration = {p.name for p in data.shakespeare_files("calibration")}
    evaluation = {p.name for p in data.shakespeare_files("evaluation")}
    assert len(evaluation) == len(data.EVALUATION_WORKS)
    assert len(calibration) > 20
    assert not calibration & evaluation
    # no folio edition of a held-out play sneaks into calibration
    assert all(not name.endswith("_gut_f.txt") for name in calibration)


def test_local_text_files_are_dealt_into_splits(tmp_path):
    for i in range(8):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i}\n" * 5)
    evaluation = data.load_text_dataset(tmp_path, split="evaluation")
    calibration = data.load_text_dataset(tmp_path, split="calibration")
    assert len(evaluation) == 2 and len(calibration) == 6
    assert not set(evaluation["text"]) & set(calibration["text"])


def test_bad_sources_and_splits_are_named(tmp_path):
    with pytest.raises(ValueError, match="split must be one of"):
        data.load_text_dataset(None, split="train")
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"no \.txt"):
        data.load_text_dataset(tmp_path)


@pytest.mark.real_model
def test_default_model_is_converted_once(smollm2, monkeypatch):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3

    def no_conversion():
        raise AssertionError("the GGUF file was looked up again: the converted copy was not reused")

    monkeypatch.setattr(models, "default_gguf_path", no_conversion)  # counts work, not seconds
    models.load_model()
    ids = data.token_ids(tokenizer, 50, split="evaluation")
    assert ids.shape == (1, 50)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not load model"):
        models.load_model(str(tmp_path / "no-such-model"))
