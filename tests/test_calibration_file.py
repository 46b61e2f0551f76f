"""A calibration's JSON is checked before anything reads it: sealed by its own checksum from format version 5,
and checked field by field against itself and the tensors' names and shapes for every version, so that an edited
or corrupt field is refused by `Calibration.load` with `CalibrationError` instead of failing later inside a
predictor (a KeyError, TypeError or ChunkError there before this check)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import fresh_tiny_model, random_ids

from hf_kvcompress.calibration import META_FILE, VERSION, Calibration, CalibrationError


@functools.cache
def _saved(root: str) -> Path:
    model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=2)
    calibration = Calibration.fit(model, None, ids=random_ids(1, 256, seed=4), tokens=256, chunk=128,
                                  predictors=("none", "context"), progress=False)
    return calibration.save(Path(root) / "calibration")


@pytest.fixture
def folder(tmp_path_factory, tmp_path) -> Path:
    copy = tmp_path / "calibration"
    shutil.copytree(_saved(str(tmp_path_factory.getbasetemp() / "fitted")), copy)
    return copy


def _edit(folder: Path, change) -> None:
    meta = json.loads((folder / META_FILE).read_text())
    change(meta)
    (folder / META_FILE).write_text(json.dumps(meta))


def test_a_saved_calibration_seals_its_json(folder):
    meta = json.loads((folder / META_FILE).read_text())
    assert meta["version"] == VERSION == 5 and len(meta["meta_sha256"]) == 64
    Calibration.load(folder)  # intact
    _edit(folder, lambda m: m["text"].update(tokens=m["text"]["tokens"] + 1))  # a field nothing else checks
    with pytest.raises(CalibrationError, match="own checksum"):
        Calibration.load(folder)


def _legacy(meta: dict) -> None:
    """The same file as version 4 wrote it: no checksum of the JSON."""
    meta["version"] = 4
    del meta["meta_sha256"]


EDITS = {
    "model null": (lambda m: m.update(model=None), "model must be an object"),
    "model dropped": (lambda m: m.pop("model"), "model must be an object"),
    "head_dim a string": (lambda m: m["model"].update(head_dim="x"), "model.head_dim"),
    "head_dim huge": (lambda m: m["model"].update(head_dim=10**7), "model.head_dim"),
    "layers negative": (lambda m: m["model"].update(layers=-1), "model.layers"),
    "layers huge": (lambda m: m["model"].update(layers=10**12), "model.layers"),  # checked without range(n)
    "kv_heads huge": (lambda m: m["model"].update(kv_heads=10**12), "kv heads"),
    "kv_heads fewer": (lambda m: m["model"].update(kv_heads=1), "kv heads"),
    "fingerprint": (lambda m: m["model"].update(fingerprint="0" * 16), "model.fingerprint"),
    "identity dropped": (lambda m: m["model"].pop("identity"), "model identity"),
    "tensors digest": (lambda m: m.update(tensors_sha256="x"), "tensors_sha256"),
    "predictors a list": (lambda m: m.update(predictors=[]), "predictors"),
    "predictor not held": (lambda m: m["predictors"].update(probe8={}), "probe8"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_legacy_fields_are_checked_at_load(folder, name):
    change, named = EDITS[name]
    _edit(folder, _legacy)
    Calibration.load(folder)  # a version-4 file still loads
    _edit(folder, change)
    with pytest.raises(CalibrationError, match=named):
        Calibration.load(folder)
