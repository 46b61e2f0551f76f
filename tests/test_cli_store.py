"""``hf-kvcompress store ls|du|clear``: the prefix store's folder on disk, without loading any model."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import random_ids, tiny_model
from transformers import DynamicCache

from hf_kvcompress import CompressionConfig, PrefixStore
from hf_kvcompress.cache.store import MARKER
from hf_kvcompress.cli import main

CONFIG = CompressionConfig(mode="lossless", block_tokens=16)


@pytest.fixture
def no_model_loads(monkeypatch):
    from hf_kvcompress import models

    def load(*args, **kwargs):
        raise AssertionError("the store subcommand loaded a model")

    monkeypatch.setattr(models, "load_model", load)


def fill(root, dtype: torch.dtype, tokens: int) -> PrefixStore:
    """A store of the 2-layer tiny Llama in ``dtype`` under ``root`` holding ``tokens // 32`` chunks."""
    model = tiny_model("llama-gqa", dtype)
    store = PrefixStore(model, path=root, max_bytes=1 << 30, chunk_tokens=32, config=CONFIG)
    ids = random_ids(1, tokens, seed=1)
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache)
    assert store.put(ids, cache) == tokens
    return store


@pytest.fixture
def filled(tmp_path):
    """Two model folders (2 chunks of float32, 1 of bf16) and one killed writer's temporary file."""
    root = tmp_path / "prefixes"
    f32, bf16 = fill(root, torch.float32, 64), fill(root, torch.bfloat16, 32)
    (f32.folder / ".0123456789abcdef.x1y2z3.tmp").write_bytes(b"\0" * 1000)
    return root, f32, bf16


def run(capsys, *argv: str) -> str:
    assert main(["store", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_ls_has_one_line_per_model_folder(filled, capsys, no_model_loads):
    root, f32, bf16 = filled
    header, *lines = run(capsys, "ls", "--path", str(root)).splitlines()
    assert header.split() == ["folder", "chunks", "MiB", "last", "used", "temporary", "model", "(from", "its",
                              "chunks)"]
    assert len(lines) == 2
    rows = {line.split()[0]: line.split(maxsplit=6) for line in lines}
    assert set(rows) == {f32.folder.name, bf16.folder.name}
    config = tiny_model("llama-gqa").config
    shape = f"{config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads x {config.head_dim}"
    for store, chunks, temporary, dtype in ((f32, "2", "1", "float32"), (bf16, "1", "0", "bfloat16")):
        _, count, mib, day, clock, temps, model = rows[store.folder.name]
        name = config.name_or_path or "LlamaForCausalLM"  # chunks record the model's name for listings
        assert (count, temps, model) == (chunks, temporary, f"{name} ({dtype}, {shape})")
        assert float(mib) == pytest.approx(store.stats()["bytes"] / 2**20, abs=0.01)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", day) and re.fullmatch(r"\d\d:\d\d:\d\d", clock)


def test_ls_describes_a_folder_only_from_a_readable_chunk_header(filled, capsys, no_model_loads):
    """A damaged newest chunk, or a folder of non-chunks, is listed with '-': never an error, never a read of an
    unbounded header."""
    import os

    root, f32, _ = filled
    newest = max(f32.folder.glob("*.kvp"), key=lambda p: p.stat().st_mtime)
    newest.write_bytes(newest.read_bytes()[:8] + (2**31).to_bytes(4, "little") * 2)  # header length 2 GiB
    os.utime(newest, (2e9, 2e9))
    rows = {line.split()[0]: line for line in run(capsys, "ls", "--path", str(root)).splitlines()[1:]}
    assert rows[f32.folder.name].endswith("  -")


def test_du_gives_exact_and_human_readable_totals(filled, capsys, no_model_loads):
    root, f32, bf16 = filled
    total = f32.stats()["bytes"] + bf16.stats()["bytes"]
    out = run(capsys, "du", "--path", str(root))
    assert out == (f"{root}: {total / 1024:.1f} KiB ({total} bytes) in 3 chunks, 2 model folders, "
                   "1 temporary files\n")


def test_clear_removes_chunks_and_temporary_files(filled, capsys, no_model_loads):
    root, f32, bf16 = filled
    total = f32.stats()["bytes"] + bf16.stats()["bytes"] + 1000
    out = run(capsys, "clear", "--path", str(root))
    assert out == f"removed {total / 1024:.1f} KiB ({total} bytes) of stored prefixes from {root}\n"
    assert list(root.rglob("*")) == [root / MARKER]  # still a store's folder
    assert run(capsys, "du", "--path", str(root)) == (f"{root}: 0 B (0 bytes) in 0 chunks, 0 model folders, "
                                                       "0 temporary files\n")
    assert run(capsys, "ls", "--path", str(root)) == f"{root}: no stored prefixes\n"


def test_default_path_is_the_stores_default_root(tmp_path, monkeypatch, capsys, no_model_loads):
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama-gqa", torch.float32)
    store = PrefixStore(model, max_bytes=1 << 30, chunk_tokens=32, config=CONFIG)
    assert store.root == tmp_path / "cache" / "prefixes"
    fill(store.root, torch.float32, 32)
    out = run(capsys, "ls")
    assert len(out.splitlines()) == 2 and out.splitlines()[1].split()[:2] == [store.folder.name, "1"]
    assert "in 1 chunks" in run(capsys, "du")
    assert run(capsys, "clear").startswith("removed ")
    assert list(store.root.rglob("*.kvp")) == []


def test_missing_folder_is_empty_and_a_file_is_refused(tmp_path, capsys, no_model_loads):
    missing = tmp_path / "nothing"
    assert run(capsys, "ls", "--path", str(missing)) == f"{missing}: no stored prefixes\n"
    assert run(capsys, "clear", "--path", str(missing)).startswith("removed 0 B (0 bytes)")
    assert not missing.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert main(["store", "du", "--path", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err and err.startswith("hf-kvcompress store: error:")
    with pytest.raises(SystemExit):
        main(["store", "rm"])


@pytest.mark.parametrize(("size", "shown"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 << 20, "5.0 MiB"),
                                             (3 << 30, "3.0 GiB"), (2048 << 40, "2048.0 TiB")])
def test_sizes_are_shown_in_binary_units(size, shown, tmp_path, monkeypatch, capsys, no_model_loads):
    """What ``store du`` prints for a folder of ``size`` bytes (the folder's usage stands in: no file of 2 PiB)."""
    from hf_kvcompress.cache import store

    usage = [{"folder": "m", "chunks": 1, "bytes": size, "temporary_files": 0, "last_used": None}]
    monkeypatch.setattr(store, "folder_usage", lambda root: usage)  # the CLI imports it when the command runs
    assert run(capsys, "du", "--path", str(tmp_path)) == (f"{tmp_path}: {shown} ({size} bytes) in 1 chunks, "
                                                          "1 model folders, 0 temporary files\n")
