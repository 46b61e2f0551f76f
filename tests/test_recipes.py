"""The "Adding a ..." recipes of docs/architecture.md and docs/lossy.md, applied as written (issue 51): each recipe's
code blocks are applied to a copy of the package (a ``python`` block is a new module, named by the last ``.py`` path
the prose names before it; a ``diff`` block a new module or an edit, its files named by its ``---`` / ``+++``
lines or else by the prose), the recipe may touch at most `MAX_FILES` library files, and a subprocess that imports
the copy checks the addition end to end. A recipe that stops applying (a line it edits changed) fails here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
#: the most library files a recipe may touch (issue 51's acceptance)
MAX_FILES = 2
FENCE = re.compile(r"^```(python|diff)\n(.*?)^```$", re.S | re.M)
PATH = re.compile(r"`((?:[\w.]+/)*\w+\.py)`")


def recipe(doc: str, title: str) -> str:
    """The text of the section of ``doc`` (under docs/) headed ``title``, up to the next heading as high or higher."""
    text = (ROOT / "docs" / doc).read_text()
    match = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert match, f"docs/{doc} has no section {title!r}"
    level = len(match.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[match.end():], re.M)
    return text[match.end(): match.end() + end.start() if end else len(text)]


def _find(package: Path, path: str, new: bool) -> Path:
    """The file of the copied package that ``path`` names (the package's own path or a suffix of one); a new
    module's folder must exist, once."""
    path = path.removeprefix("hf_kvcompress/")
    if new:
        folder, _, name = path.rpartition("/")
        folders = [p for p in [package, *package.rglob("*")] if p.is_dir()
                   and (p == package if not folder else p.as_posix().endswith("/" + folder))]
        assert len(folders) == 1, f"the recipe's new module {path} has {len(folders)} possible folders"
        return folders[0] / name
    found = [p for p in package.rglob("*.py") if p.as_posix().endswith("/" + path)]
    assert len(found) == 1, f"the recipe names {path}, which is {len(found)} files of the package"
    return found[0]


def apply_recipe(section: str, package: Path) -> set[Path]:
    """Apply every code block of ``section`` to the copied ``package``; the files it touched."""
    touched: set[Path] = set()
    position = 0
    for match in FENCE.finditer(section):
        named = PATH.findall(section[position:match.start()])
        position = match.end()
        kind, body = match.groups()
        if kind == "python":
            assert named, "a python block with no module named before it"
            target = _find(package, named[-1], new=True)
            assert not target.exists(), f"the recipe's new module {target} exists already"
            target.write_text(body)
            touched.add(target)
            continue
        parts = re.split(r"^--- ", body, flags=re.M)
        if parts[0].strip():  # no file headers: the module the prose names
            assert named, "a diff block with no file named"
            parts = [f"a/{named[-1]}\n+++ b/{named[-1]}\n{parts[0]}"]
        for part in filter(str.strip, parts):
            source, rest = part.split("\n", 1)
            header, lines = rest.split("\n", 1)
            name = header.removeprefix("+++ ").removeprefix("b/")
            lines = [line for line in lines.splitlines() if not line.startswith("@@")]
            if source.strip() == "/dev/null":
                target = _find(package, name, new=True)
                target.write_text("".join(line[1:] + "\n" for line in lines))
            else:
                target = _find(package, name, new=False)
                old = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "-"))
                new = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "+"))
                text = target.read_text()
                assert text.count(old) == 1, f"the recipe no longer applies to {target.name}: {old!r}"
                target.write_text(text.replace(old, new))
            touched.add(target)
    return touched


def run_with(package: Path, script: str) -> None:
    """Run ``script`` in a fresh interpreter that imports the copied package (and the tests' helpers)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package.parent), str(TESTS), str(TESTS / "fixtures")]),
           "HF_KVCOMPRESS_CACHE": str(package.parent / "cache")}
    prologue = f"import hf_kvcompress\nassert hf_kvcompress.__file__.startswith({str(package)!r})\n"
    done = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(script)], env=env, cwd=package.parent,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def package(tmp_path) -> Path:
    """A copy of the library to apply a recipe to."""
    copy = tmp_path / "hf_kvcompress"
    shutil.copytree(ROOT / "hf_kvcompress", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_recipe_parser_refuses_a_recipe_that_no_longer_applies(package):
    stale = "```diff\n--- a/hf_kvcompress/codec/coders.py\n+++ b/hf_kvcompress/codec/coders.py\n-from . import gone\n" \
            "+from . import gone, raw\n```\n"
    with pytest.raises(AssertionError, match=r"no longer applies to coders\.py"):
        apply_recipe(stale, package)


@pytest.mark.slow  # ~45 s on 2 cores: a calibration fit, generation, a save and a load in a fresh interpreter
def test_adding_a_predictor(package):
    touched = apply_recipe(recipe("architecture.md", "Adding a predictor"), package)
    assert len(touched) <= MAX_FILES, sorted(map(str, touched))
    run_with(package, """
        import torch
        from helpers import assert_continues_identically, fresh_tiny_model, random_ids, tiny_calibration
        from transformers import DynamicCache
        from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
        from hf_kvcompress.predictors import registry

        assert "below1" in registry.FITTED and "below1" in LosslessConfig.PREDICTORS
        model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6)
        calibration = tiny_calibration(model, 256, predictors=("below1",))
        config = CompressionConfig(mode="lossless", block_tokens=16, lossless=LosslessConfig(predictor="below1"))
        cache = CompressedCache(config, model=model, calibration=calibration)
        assert type(cache.lossless.predictor).__name__ == "OneBelowPredictor"
        ids = random_ids(1, 70)
        reference = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, cache=reference)
            model(ids, cache=cache)
        assert cache.kv_layers()[0].blocks, "nothing was sealed"
        assert_continues_identically(model, reference, cache, random_ids(1, 3, seed=1))
        path = cache.save("below1.kvc", predictor="below1")
        loaded = CompressedCache.load(path, model=model, calibration=calibration)
        assert_continues_identically(model, reference, loaded, random_ids(1, 2, seed=2))
    """)


def test_adding_a_coder(package):
    touched = apply_recipe(recipe("architecture.md", "Adding a coder"), package)
    assert len(touched) <= MAX_FILES, sorted(map(str, touched))
    run_with(package, """
        import torch
        from helpers import fresh_tiny_model, random_ids, same_bits
        from make_fixtures import special_values
        from transformers import DynamicCache
        from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig, codec
        from hf_kvcompress.codec import CodecConfig

        assert "raw" in codec.CODERS
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.cat([special_values(dtype), torch.randn(52).to(dtype)]).reshape(2, 32)
            blobs = codec.encode_batch(x, 0.0, 1.0, CodecConfig(coder="raw"))
            assert same_bits(codec.decode_batch(blobs, 0.0, 1.0, CodecConfig(coder="raw")), x)
            assert same_bits(codec.decode(blobs[1]), x[1])  # found by its magic bytes
        # in a cache: blocks coded with it, generation continues bit for bit
        model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=2)
        config = CompressionConfig(mode="lossless", block_tokens=16, lossless=LosslessConfig(coder="raw"))
        cache, reference = CompressedCache(config, model=model), DynamicCache(config=model.config)
        ids = random_ids(1, 40)
        with torch.no_grad():
            want = model(ids, cache=reference).logits
            got = model(ids, cache=cache).logits
            assert torch.equal(want.view(torch.int16), got.view(torch.int16))
            ids = random_ids(1, 2, seed=1)
            assert torch.equal(model(ids, cache=reference).logits.view(torch.int16),
                               model(ids, cache=cache).logits.view(torch.int16))
        assert cache.kv_layers()[0].blocks, "nothing was sealed"
    """)


def test_adding_a_lossy_method(package):
    touched = apply_recipe(recipe("lossy.md", "Adding a method"), package)
    assert len(touched) <= MAX_FILES, sorted(map(str, touched))
    run_with(package, """
        import torch
        from helpers import fresh_tiny_model, random_ids
        from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig

        assert "knorm" in LossyConfig.METHODS and not LossyConfig.METHODS["knorm"].needs_queries
        model = fresh_tiny_model("llama-gqa")
        lossy = LossyConfig(method="knorm", interval=8, sinks=2, budget=0.5)
        cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=lossy))  # no model needed
        full = CompressedCache(CompressionConfig(mode="none"), model=model)
        ids = random_ids(1, 48)
        with torch.no_grad():
            model(ids, cache=cache)
            model(ids, cache=full)
        layer, reference = cache.layers[0], full.layers[0].keys
        assert layer.summary_seconds and layer.held_bytes() <= layer.budget_bytes()
        held = layer.keys
        assert held.shape[-2] < reference.shape[-2]
        # every entry kept is one of the reference's, unchanged (a selection, not a summary)
        for head in range(held.shape[1]):
            rows = {tuple(r.tolist()) for r in reference[0, head].view(torch.int32)}
            assert all(tuple(r.tolist()) in rows for r in held[0, head].view(torch.int32))
    """)
