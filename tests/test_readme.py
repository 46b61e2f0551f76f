"""The README's Python snippets, run as written: the ``<!-- readme-test -->`` blocks in order in one namespace
(quick start, lossy, save/load) on the embedded model, and the ``<!-- readme-test: hub -->`` block with a local
model folder in place of the hub id (no network here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_kvcompress.cache.persist import read_header

pytestmark = pytest.mark.real_model

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"<!-- readme-test(?:: (?P<kind>[\w-]+))? -->\n```python\n(?P<code>.*?)```", re.S)


def snippets(kind: str | None = None) -> list[str]:
    """The fenced python blocks after a ``<!-- readme-test -->`` marker (``kind``: the marker's ``: kind``)."""
    return [m["code"] for m in _BLOCK.finditer(README.read_text()) if m["kind"] == kind]


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory) -> Path:
    """A fresh ``HF_KVCOMPRESS_CACHE`` (calibrations and anything else a snippet writes land there, not in the
    user's folder) that shares the already converted default model and texts; the snippets run in a temporary
    folder. Module-wide: the snippets share it."""
    from hf_kvcompress.data import shakespeare_files
    from hf_kvcompress.downloads import cache_dir
    from hf_kvcompress.models import default_model_dir

    default_model_dir(), shakespeare_files()  # fetched / converted once into the real folder
    real = cache_dir()
    work = tmp_path_factory.mktemp("readme")
    folder = work / "hf_kvcompress_cache"
    folder.mkdir()
    for name in ("models", "downloads", "datasets"):
        (folder / name).symlink_to(real / name, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_KVCOMPRESS_CACHE", str(folder))
        patch.chdir(work)
        yield folder


def test_the_markers_find_every_snippet():
    assert len(snippets()) == 4 and len(snippets("hub")) == 1
    assert all("load_model(" in code for code in (snippets()[0], snippets("hub")[0]))


def test_quick_start_lossy_and_save_load_run_as_written(user_cache, capsys):
    ns: dict = {}
    quick, lossy, save_load, store = snippets()
    exec(compile(quick, "README quick start", "exec"), ns)
    stats = ns["cache"].stats()
    assert "per_layer" not in stats and "per_layer" in ns["cache"].stats(per_layer=True)
    assert stats["tokens"] == 331 and stats["compression_ratio"] > 1.2, stats  # the prompt sealed at prefill
    # generation uses no calibration: none is looked up or fitted before the first save
    assert stats["calibration"].startswith("auto: looked up at the first save"), stats
    assert stats["calibration_bytes"] == 0 and ns["cache"].calibration is None, stats
    printed = capsys.readouterr().out
    assert "compression_ratio" in printed and "per_layer" not in printed
    model, ids = ns["model"], ns["ids"]
    with torch.no_grad():
        expected = model.generate(ids, cache=DynamicCache(), max_new_tokens=32, do_sample=False)
    assert torch.equal(ns["out"], expected)  # lossless: the same tokens

    exec(compile(lossy, "README lossy", "exec"), ns)
    assert ns["lossy"].stats()["compression_ratio"] > 2.5
    assert ns["out_lossy"].shape == ns["out"].shape

    exec(compile(save_load, "README save/load", "exec"), ns)
    assert (Path.cwd() / "prompt.kvc").is_file()
    # the default save in a fresh cache folder: no saved calibration to find (none is fitted), so generation's
    # blocks with per-block statistics
    assert read_header(Path.cwd() / "prompt.kvc")["predictor"]["name"] == "generic"
    assert ns["cache"].calibration is None
    assert ns["cache"].stats()["calibration"].startswith("auto: looked up at the first save")
    bits = 8 * (Path.cwd() / "prompt.kvc").stat().st_size / (stats["raw_bytes"] / 2)
    assert bits <= 11.0, bits
    assert ns["restored"].lossless.decodes > 0  # adopted at load, decoded by the continuation's first step
    for saved, restored in zip(ns["cache"].layers, ns["restored"].layers):  # the prefix, bit for bit
        held = saved.keys.shape[2]
        assert torch.equal(saved.keys.view(torch.int16), restored.keys[..., :held, :].view(torch.int16))
        assert torch.equal(saved.values.view(torch.int16), restored.values[..., :held, :].view(torch.int16))
    with torch.no_grad():  # the uninterrupted cache (a prefill of all 332 tokens would round differently)
        continued = model.generate(ns["out"], cache=ns["cache"], max_new_tokens=16, do_sample=False)
    assert torch.equal(ns["more"], continued)  # generation continues as without the round trip

    exec(compile(store, "README prefix store", "exec"), ns)
    found = ns["store"].stats()
    assert (found["chunks"], found["hits"], found["hit_tokens"]) == (4, 4, 1024), found
    assert found["bytes"] <= 0.68 * found["raw_bytes"], found  # huff blocks: 0.675x (README; lanes 0.66x)
    # the second answer is DynamicCache reusing the document's KV as the first prompt's prefill computed it
    first = torch.cat([ns["document"], ns["tokenizer"](" Who is the king?", return_tensors="pt").input_ids], dim=1)
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(first, cache=reference, use_cache=True)
        reference.crop(1024 - first.shape[1])  # keep the document's 1,024 tokens
        expected = model.generate(ns["ids"], cache=reference, max_new_tokens=16, do_sample=False)
    assert torch.equal(ns["answer"], expected)


def test_another_model_snippet_with_a_local_folder(user_cache):
    from hf_kvcompress.models import default_model_dir

    (code,) = snippets("hub")
    local = re.sub(r'load_model\("[^"]+"\)', f"load_model({str(default_model_dir())!r})", code)
    assert local != code
    ns: dict = {}
    exec("from hf_kvcompress import CompressedCache, CompressionConfig\n"
         "from hf_kvcompress.data import token_ids\nfrom hf_kvcompress.models import load_model\n", ns)
    exec(compile(local, "README another model", "exec"), ns)
    assert ns["out"].shape == (1, 332)
    assert ns["cache"].stats()["compression_ratio"] > 1.2
