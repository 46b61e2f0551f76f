"""`PrefixStore` and saved files against what is not an accident (docs/prefix_store.md "Trust"): K/V of other
tokens or another model put or planted, chunks and files edited with their checksum recomputed, FIFOs, sparse
files and links planted in the folder, foreign files beside the store's, bad arguments. Nothing may hang, raise out
of `cache_for` / `put` (but a clear refusal) / `generate`, touch a file that is not the store's, or hit silently
with K/V that are not the prompt's. Tiny 6-layer Llamas, as in test_prefix_store.py."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from cache_file_testutil import reseal, split
from helpers import fresh_tiny_model, random_ids, same_bits
from test_prefix_store import (
    CHUNK,
    CONFIG,
    F32,
    LAYERS,
    LOGGER,
    assert_same_generation,
    chunk_files,
    chunk_path,
    generate,
    holds_prefix,
    llama,
    open_store,
    prefill,
    temp_files,
)

from hf_kvcompress import CompressedCache, PrefixStore
from hf_kvcompress.cache import container, store_folder
from hf_kvcompress.cache import store as store_module
from hf_kvcompress.cache.binding import first_disagreement, tolerance
from hf_kvcompress.cache.store import MARKER, clear, folder_usage
from hf_kvcompress.cli import main
from hf_kvcompress.errors import CacheFileError

IDS = random_ids(1, 100, seed=50)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A store folder holding the first three chunks of ``IDS`` (copied by each test that edits it) and the
    DynamicCache prefill they were stored from."""
    root = tmp_path_factory.mktemp("trust")
    reference = prefill(llama(F32), IDS[:, : 3 * CHUNK])
    assert open_store(root).put(IDS, reference) == 3 * CHUNK
    return root, reference


def copy_of(stored, tmp_path: Path) -> tuple[PrefixStore, object]:
    root, reference = stored
    target = tmp_path / "store"
    target.mkdir()
    for path in root.rglob("*"):
        dest = target / path.relative_to(root)
        if path.is_dir():
            dest.mkdir(exist_ok=True)
        else:
            dest.write_bytes(path.read_bytes())
    return open_store(target), reference


def one_warning(caplog, name: str) -> str:
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and name in records[0].getMessage(), [r.getMessage() for r in records]
    return records[0].getMessage()


def continues_from(store: PrefixStore, reference, tokens: int) -> None:
    """A lookup of ``IDS`` holds exactly ``tokens`` of ``reference``'s tokens and generates as the DynamicCache
    that prefilled them does (never from K/V that are not the prompt's)."""
    cache = store.cache_for(IDS)
    assert holds_prefix(cache, reference, tokens)
    want = prefill(llama(F32), IDS[:, :tokens]) if tokens else None
    assert_same_generation(generate(llama(F32), IDS, cache), generate(llama(F32), IDS, copy.deepcopy(want)))


# ---------------------------------------------------------------------- binding K/V to tokens and model


def test_tolerance_separates_rounding_from_other_tokens():
    """The comparison: keys rounded once more agree, keys of another token do not; NaN agrees with NaN only."""
    keys = prefill(llama(F32), IDS[:, :40]).layers[0].keys
    assert first_disagreement(keys, keys.to(torch.bfloat16).to(F32)) is None  # one bf16 rounding: 2^-9
    assert tolerance(torch.bfloat16) == 2.0**-5 and tolerance(F32) == 2.0**-8
    nudged = keys * (1 + tolerance(F32) / 2)
    assert first_disagreement(keys, nudged) is None
    swapped = keys.clone()
    swapped[:, :, 7] = keys[:, :, 8]
    assert first_disagreement(keys, swapped) == 7
    nan = keys.clone()
    nan[0, 1, 5, 3] = float("nan")
    assert first_disagreement(keys, nan) == 5 and first_disagreement(nan, nan.clone()) is None


def with_values_of(cache, other):
    """``cache`` with layer 0's values replaced by ``other``'s (its layer-0 keys still the true ones)."""
    cache.layers[0].values = other.layers[0].values.clone()
    return cache


@pytest.mark.parametrize("source", ["other ids", "one token changed", "another model", "layer-0 values of other ids"])
def test_put_of_kv_that_are_not_the_ids_is_refused(tmp_path, source):
    store = open_store(tmp_path)
    what = "keys"
    if source == "layer-0 values of other ids":  # true keys: only the values tell
        cache = with_values_of(prefill(llama(F32), IDS[:, : 2 * CHUNK]),
                               prefill(llama(F32), random_ids(1, 2 * CHUNK, seed=51)))
        what = "values"
    elif source == "other ids":
        cache = prefill(llama(F32), random_ids(1, 2 * CHUNK, seed=51))
    elif source == "one token changed":
        other = IDS[:, : 2 * CHUNK].clone()
        other[0, CHUNK + 5] = (other[0, CHUNK + 5] + 1) % 128
        cache = prefill(llama(F32), other)
    else:
        cache = prefill(llama(F32, seed=1), IDS[:, : 2 * CHUNK])  # same config and shapes, other weights
    token = CHUNK + 5 if source == "one token changed" else 0
    with pytest.raises(ValueError, match=f"layer 0's {what} of token {token} are not what the model computes"):
        store.put(IDS[:, : 2 * CHUNK], cache)
    assert chunk_files(tmp_path) == []
    assert store.put(IDS[:, :CHUNK], prefill(llama(F32), IDS[:, :CHUNK])) == CHUNK  # the right KV still goes in


def test_put_of_a_prefix_of_a_longer_cache_stores_what_it_can(tmp_path):
    store = open_store(tmp_path)
    cache = CompressedCache(CONFIG, model=llama(F32))
    with torch.no_grad():
        llama(F32)(IDS, cache=cache)  # records all 100 ids
    assert store.put(IDS[:, :70], cache) == 2 * CHUNK
    assert holds_prefix(store.cache_for(IDS), prefill(llama(F32), IDS[:, : 2 * CHUNK]), 2 * CHUNK)


@pytest.mark.parametrize("source", ["other ids", "another model", "layer-0 values of other ids"])
def test_planted_chunk_of_other_kv_is_a_miss_removed(tmp_path, caplog, monkeypatch, source):
    """A chunk holding another prompt's or another model's K/V under this prompt's key and ids (what a writer
    that skips the binding would leave): the lookup binds layer 0, misses, removes it, and generation goes on
    from the chunks before it."""
    store = open_store(tmp_path)
    reference = prefill(llama(F32), IDS[:, : 2 * CHUNK])
    assert store.put(IDS[:, :CHUNK], reference) == CHUNK
    what = "keys"
    if source == "other ids":
        poison = prefill(llama(F32), random_ids(1, 2 * CHUNK, seed=52))
    elif source == "another model":
        poison = prefill(llama(F32, seed=1), IDS[:, : 2 * CHUNK])
    else:  # the true keys of every layer-0 token, another prompt's values: sealed as any chunk (its writer's)
        poison = with_values_of(prefill(llama(F32), IDS[:, : 2 * CHUNK]),
                                prefill(llama(F32), random_ids(1, 2 * CHUNK, seed=52)))
        what = "values"
    monkeypatch.setattr(store_module, "binding_problem", lambda *args, **kwargs: None)
    assert store.put(IDS[:, : 2 * CHUNK], poison) == CHUNK  # chunk 1 of the poison
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        continues_from(store, reference, CHUNK)
    assert f"layer 0's {what} of token {CHUNK}" in one_warning(caplog, chunk_path(store, IDS, 1).name)
    assert not chunk_path(store, IDS, 1).exists() and chunk_path(store, IDS, 0).exists()


# ---------------------------------------------------------------------- chunks edited behind their checksum


def _edit_stream(data: bytes, layer: int) -> bytes:
    header, payload = split(data)
    offset, length = header["layers"][layer]["blocks"][1]["rows"][0]["streams"][2]
    base = len(data) - 32 - len(payload)
    edited = bytearray(data)
    edited[base + offset + length - 3] ^= 0x40  # inside the coded body
    return reseal(bytes(edited))


def _with_header(data: bytes, blob: bytes) -> bytes:
    """``data`` with the header ``blob`` (its length in the prefix too) and its checksum recomputed."""
    size = int.from_bytes(data[12:16], "little")
    return reseal(data[:12] + len(blob).to_bytes(4, "little") + blob + data[16 + size :])


def _edit_header(path: list, value):
    def apply(data: bytes) -> bytes:
        header, _ = split(data)
        node = header
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value
        return _with_header(data, json.dumps(header, separators=(",", ":")).encode())
    return apply


def _raw_header(old: bytes, new: bytes):
    def apply(data: bytes) -> bytes:
        blob = data[16 : 16 + int.from_bytes(data[12:16], "little")]
        assert old in blob
        return _with_header(data, blob.replace(old, new, 1))
    return apply


FORGED = {
    "stream of layer 3": lambda data: _edit_stream(data, 3),
    "stream of layer 0": lambda data: _edit_stream(data, 0),
    "key_dim": _edit_header(["layers", 2, "key_dim"], 8),
    "dtype": _edit_header(["dtype"], "bfloat16"),  # of a chunk but the first: each chunk's is checked
    "a 4,300-digit integer": _raw_header(f'"first":{CHUNK}'.encode(), b'"first":' + b"9" * 4300),
    "deep nesting": _raw_header(f'"first":{CHUNK}'.encode(), b'"first":' + b"[" * 100_000),
}


@pytest.mark.parametrize("forgery", list(FORGED), ids=list(FORGED))
def test_forged_chunk_is_a_miss_removed_and_generation_goes_on(tmp_path, caplog, stored, forgery):
    """Chunk 1 edited with its SHA-256 recomputed: its stream decodes wrongly or not at all, or its header lies
    (a shape, a dtype, an unparsable value): a miss at the lookup (not inside generate), the file removed."""
    store, reference = copy_of(stored, tmp_path)
    path = chunk_path(store, IDS, 1)
    path.write_bytes(FORGED[forgery](path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        continues_from(store, reference, CHUNK)
    one_warning(caplog, path.name)
    assert not path.exists() and chunk_path(store, IDS, 2).exists()  # chunk 2 stays: a hit once 1 is put again
    assert store.put(IDS[:, : 3 * CHUNK], reference) == CHUNK
    assert holds_prefix(store.cache_for(IDS), reference, 3 * CHUNK)


# ---------------------------------------------------------------------- planted files


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """Bytes asked of every file read from now on (the store's bounded reads)."""
    asked = []
    original = container.read_exactly

    def counting(fd, count):
        asked.append(count)
        return original(fd, count)

    monkeypatch.setattr(container, "read_exactly", counting)  # every bounded read (`container.read_regular`)
    return asked


def lookup_within(store: PrefixStore, seconds: float = 60.0) -> CompressedCache:
    """``cache_for(IDS)`` on a thread that must finish within ``seconds`` (a planted FIFO must not block it)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("cache", store.cache_for(IDS)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "cache_for blocked"
    return out["cache"]


@pytest.mark.parametrize("plant", ["fifo", "sparse 16 GiB", "link to /dev/zero", "link to a chunk", "folder"])
def test_planted_file_at_a_chunks_name_is_a_miss_read_never(tmp_path, caplog, stored, reads, plant):
    store, reference = copy_of(stored, tmp_path)
    path = chunk_path(store, IDS, 1)
    outside = tmp_path / "outside.kvp"
    outside.write_bytes(path.read_bytes())  # a whole, valid chunk, outside the folder
    before = outside.stat()
    path.unlink()
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "sparse 16 GiB":
        with path.open("wb") as out:
            out.truncate(16 << 30)
    elif plant == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif plant == "link to a chunk":
        path.symlink_to(outside)
    else:
        path.mkdir()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cache = lookup_within(store)
    assert holds_prefix(cache, reference, CHUNK)
    one_warning(caplog, path.name)
    assert sum(reads) <= 2 * chunk_path(store, IDS, 0).stat().st_size  # chunk 0 only: the plant never read
    assert os.path.lexists(path) == (plant == "folder")  # removed (a link itself, never its target)
    assert (outside.stat().st_mtime_ns, outside.stat().st_size) == (before.st_mtime_ns, before.st_size)


def test_put_replaces_a_link_at_a_chunks_name_and_never_touches_its_target(tmp_path):
    store = open_store(tmp_path / "store")
    foreign = tmp_path / "mine.txt"
    foreign.write_text("the user's own file")
    old = time.time() - 1000
    os.utime(foreign, (old, old))
    store.folder.mkdir()
    for index in (0, 1):
        chunk_path(store, IDS, index).symlink_to(foreign)
    reference = prefill(llama(F32), IDS[:, : 2 * CHUNK])
    assert store.put(IDS[:, : 2 * CHUNK], reference) == 2 * CHUNK
    assert foreign.read_text() == "the user's own file" and foreign.stat().st_mtime == pytest.approx(old)
    assert not chunk_path(store, IDS, 0).is_symlink()
    assert holds_prefix(store.cache_for(IDS), reference, 2 * CHUNK)
    assert foreign.stat().st_mtime == pytest.approx(old)


def test_a_linked_namespace_folder_is_neither_read_nor_written_through(tmp_path, caplog):
    store = open_store(tmp_path / "store")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.kvp").write_bytes(b"x")
    store.folder.symlink_to(elsewhere, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.put(IDS, prefill(llama(F32), IDS)) == 0
        assert store.cache_for(IDS).get_seq_length() == 0
    assert "is a link or not a folder" in caplog.text
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.kvp"]
    store.max_bytes = 1
    store.evict()
    assert clear(store.root) == 0 and (elsewhere / "keep.kvp").exists() and store.folder.is_symlink()


# ---------------------------------------------------------------------- what the store owns


def test_a_folder_of_other_files_is_refused_and_foreign_files_are_never_touched(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.kvp").write_text("not a chunk")
    with pytest.raises(ValueError, match=f"holds files that are not a prefix store's \\(no {MARKER} file\\)"):
        open_store(theirs)
    with pytest.raises(ValueError, match="not a prefix store's folder"):
        clear(theirs)
    assert main(["store", "clear", "--path", str(theirs)]) == 2
    assert "not a prefix store's folder" in capsys.readouterr().err
    store = open_store(tmp_path / "store")
    store.put(IDS, prefill(llama(F32), IDS))
    foreign = [store.root / "a.kvp", store.root / "b.tmp", store.folder / "mine.kvp", store.folder / "x.tmp",
               store.folder / f"{'0' * 64}.kvp.bak", store.root / ("f" * 32) / f"{'0' * 64}.txt"]
    for path in foreign:
        path.parent.mkdir(exist_ok=True)
        path.write_text("the user's")
        os.utime(path, (1, 1))  # older than anything: eviction would take these first if it took them
    store.max_bytes = 1
    assert store.evict() > 0 and store.stats()["chunks"] == 0
    store.max_bytes = 1 << 30
    store.put(IDS, prefill(llama(F32), IDS))
    assert store.clear() > 0
    assert all(path.read_text() == "the user's" for path in foreign)
    assert (store.root / MARKER).is_file()
    with pytest.raises(ValueError, match="path is empty"):
        PrefixStore(llama(F32), path="")
    assert not (Path.cwd() / MARKER).exists()


def test_a_store_folder_from_before_the_marker_is_adopted(tmp_path):
    """A folder of namespace folders only (as stores wrote before the marker) is a store's."""
    old = tmp_path / "old"
    (old / ("a" * 32)).mkdir(parents=True)
    assert open_store(old).root == old and (old / MARKER).is_file()


def test_temporary_files_count_toward_max_bytes_until_their_writer_is_gone(tmp_path):
    store = open_store(tmp_path)
    assert store.put(IDS, prefill(llama(F32), IDS)) == 3 * CHUNK
    sizes = sorted(p.stat().st_size for p in chunk_files(tmp_path))
    live = store.folder / f".{'ab' * 8}.k2j4_x9q.tmp"
    live.write_bytes(b"\0" * sizes[0])
    old = time.time() - store_folder.TEMP_GRACE_SECONDS - 1
    os.utime(live, (old, old))
    with live.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer at work
        store.max_bytes = sum(sizes)
        assert store.evict() > 0 and len(chunk_files(tmp_path)) == 2 and live.exists()  # counted, kept
    assert store.evict() == sizes[0] and not live.exists()  # the lock is gone: reclaimed


# ---------------------------------------------------------------------- arguments


def test_argument_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        open_store(tmp_path, max_bytes=0)
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike folder, got int"):
        PrefixStore(llama(F32), path=123)
    with pytest.raises(TypeError, match="model must be a transformers model, got NoneType"):
        PrefixStore(None, path=tmp_path)
    a_file = tmp_path / "afile"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"path .*afile' is not a folder"):
        PrefixStore(llama(F32), path=a_file)
    store = open_store(tmp_path / "store")
    with pytest.raises(ValueError, match=r"ids must be token ids in \[0, 2\*\*63\), got 9223372036854775808"):
        store.cache_for([2**63] * 40)
    with pytest.raises(ValueError, match="ids must be token ids"):
        store.cache_for([-1] * 40)
    with pytest.raises(TypeError, match="secret must be non-empty bytes"):
        open_store(tmp_path / "store", secret="text")
    with pytest.raises(ValueError, match="outside the model's vocabulary of 128"):
        store.put(IDS + 128, prefill(llama(F32), IDS))
    assert chunk_files(tmp_path) == []


def test_put_of_something_that_is_not_a_cache_names_cache(tmp_path):
    store = open_store(tmp_path)
    for wrong in (None, 123, {"keys": IDS}, IDS):
        with pytest.raises(TypeError, match=f"cache must be a transformers Cache .*got {type(wrong).__name__}"):
            store.put(IDS, wrong)
    assert chunk_files(tmp_path) == []


@pytest.fixture
def shared_tmp():
    """A folder every user may enter (pytest's own are root's alone: another uid could not reach a store there)."""
    folder = Path(tempfile.mkdtemp(prefix="hf_kvcompress-store-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@contextlib.contextmanager
def cannot_write(folder: Path):
    """This process cannot write in ``folder`` (which it owns, mode 0o755) inside the block: as root, whom modes do
    not deny, its effective uid is nobody's (65534) meanwhile; as another user, the folder's mode is 0o555."""
    if os.geteuid() == 0:
        os.seteuid(65534)
        try:
            yield
        finally:
            os.seteuid(0)
    else:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)


def test_a_folder_that_cannot_be_written_is_named_at_construction_and_a_warning_at_put(shared_tmp, caplog):
    """Construction that must create or mark the folder raises a ``PermissionError`` naming it; a store's folder
    that this process can read but not write serves lookups and stores nothing (a warning, as on a full disk)."""
    empty = shared_tmp / "empty"
    empty.mkdir(mode=0o755)
    with cannot_write(shared_tmp), pytest.raises(PermissionError, match=f"store's folder '{shared_tmp / 'new'}' "
                                                 "cannot be created or opened: Permission denied"):
        open_store(shared_tmp / "new")
    with cannot_write(empty), pytest.raises(PermissionError, match=f"store's folder '{empty}' cannot be written "
                                            r"\(its marker file could not be created\): Permission denied"):
        open_store(empty)
    assert list(empty.iterdir()) == []
    root = shared_tmp / "store"
    reference = prefill(llama(F32), IDS[:, : 2 * CHUNK])
    writable = open_store(root)
    root.chmod(0o755)
    assert writable.put(IDS[:, :CHUNK], reference) == CHUNK
    for folder in (root, writable.folder):  # no namespace folder can be made; then none of its files
        with cannot_write(folder), caplog.at_level(logging.WARNING, logger=LOGGER):
            caplog.clear()
            store = open_store(root, secret=b"other" if folder == root else None)
            assert store.put(IDS[:, : 2 * CHUNK], reference) == 0
            assert "Permission denied" in caplog.text and str(store.folder) in caplog.text
            assert holds_prefix(store.cache_for(IDS), reference, 0 if folder == root else CHUNK)
    assert chunk_files(root) == [chunk_path(writable, IDS, 0)] and temp_files(root) == []


# ---------------------------------------------------------------------- a keyed MAC


def test_a_secret_keys_the_chunks(tmp_path, caplog):
    reference = prefill(llama(F32), IDS[:, : 2 * CHUNK])
    keyed = open_store(tmp_path, secret=b"k1")
    assert keyed.put(IDS[:, : 2 * CHUNK], reference) == 2 * CHUNK
    assert holds_prefix(keyed.cache_for(IDS), reference, 2 * CHUNK)
    plain, other = open_store(tmp_path), open_store(tmp_path, secret=b"k2")
    assert len({plain.folder, keyed.folder, other.folder}) == 3
    assert plain.cache_for(IDS).get_seq_length() == 0 and other.cache_for(IDS).get_seq_length() == 0
    path = chunk_path(keyed, IDS, 1)
    path.write_bytes(reseal(path.read_bytes()))  # a plain SHA-256 where the HMAC was: whoever lacks the secret
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert holds_prefix(keyed.cache_for(IDS), reference, CHUNK)
    assert "without this store's secret" in one_warning(caplog, path.name)


# ---------------------------------------------------------------------- saved files


@pytest.fixture
def saved(tmp_path):
    model = llama(F32)
    cache = CompressedCache(CONFIG, model=model)
    with torch.no_grad():
        model(IDS[:, :70], cache=cache)
    return cache.save(tmp_path / "saved.kvc")


def test_saved_file_with_edited_ids_or_another_models_kv_is_refused(saved, tmp_path):
    data = saved.read_bytes()
    header, _ = split(data)
    header["token_ids"][0][40] = (header["token_ids"][0][40] + 1) % 128
    edited = tmp_path / "ids.kvc"
    edited.write_bytes(_with_header(data, json.dumps(header, separators=(",", ":")).encode()))
    with pytest.raises(CacheFileError, match="keys of token 40 are not what the model computes"):
        CompressedCache.load(edited, model=llama(F32))
    other = CompressedCache(CONFIG, model=llama(F32, seed=1))
    with torch.no_grad():
        llama(F32, seed=1)(IDS[:, :70], cache=other)
    data = other.save(tmp_path / "other.kvc").read_bytes()
    header, _ = split(data)
    header["model"] = split(saved.read_bytes())[0]["model"]  # claims to be llama(F32)'s
    forged = tmp_path / "forged.kvc"
    forged.write_bytes(_with_header(data, json.dumps(header, separators=(",", ":")).encode()))
    with pytest.raises(CacheFileError, match="keys of token 0 are not what the model computes"):
        CompressedCache.load(forged, model=llama(F32))
    loaded = CompressedCache.load(saved, model=llama(F32))  # the untouched file binds
    assert same_bits(loaded.layers[LAYERS - 1].keys, prefill(llama(F32), IDS[:, :70]).layers[LAYERS - 1].keys)


def test_saved_file_of_another_prompts_layer0_values_is_refused(tmp_path):
    """A file whose layer-0 keys are the true ones for its ids and whose layer-0 values are another prompt's (layer
    0's V projection fed another prompt's during the forward that filled the cache): refused at load."""
    model = llama(F32)
    v_proj = model.model.layers[0].self_attn.v_proj
    other = {}
    handle = v_proj.register_forward_hook(lambda module, args, out: other.setdefault("values", out))
    with torch.no_grad():
        model(random_ids(1, 70, seed=53))
    handle.remove()
    handle = v_proj.register_forward_hook(lambda module, args, out: other["values"])
    cache = CompressedCache(CONFIG, model=model)
    try:
        with torch.no_grad():
            model(IDS[:, :70], cache=cache)
    finally:
        handle.remove()
    assert first_disagreement(prefill(model, IDS[:, :70]).layers[0].keys, cache.layers[0].keys) is None
    path = cache.save(tmp_path / "values.kvc")
    with pytest.raises(CacheFileError, match="layer 0's values of token 0 are not what the model computes"):
        CompressedCache.load(path, model=model)


def test_saved_file_that_is_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.kvc"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(CacheFileError, match="not a regular file"):
            CompressedCache.load(path, model=llama(F32))
    zeros = tmp_path / "sparse.kvc"
    with zeros.open("wb") as out:
        out.truncate(16 << 30)
    with pytest.raises(CacheFileError, match="bad magic"):
        CompressedCache.load(zeros, model=llama(F32))


def test_a_model_whose_first_keys_ignore_the_tokens_cannot_be_bound(tmp_path):
    """Refused at construction, saying why (a zeroed K projection: every token's layer-0 keys are 0)."""
    model = fresh_tiny_model("llama-gqa", F32, layers=2)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.zero_()
    with pytest.raises(ValueError, match="computes the same keys for different tokens"):
        PrefixStore(model, path=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- a folder swapped for a link meanwhile

#: another process swapping ``argv[1]`` (the namespace folder) and ``argv[2]`` (a link to a folder outside the
#: store) back and forth with one atomic exchange each (renameat2 RENAME_EXCHANGE: the folder's name is never
#: missing, so nothing but the swap differs from a quiet store) until ``argv[3]`` exists; prints its swaps. While
#: the folder is missing (a clear() removed it, the next put makes it again) the exchange fails and is retried.
RACER = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
folder, link, stop = (os.fsencode(a) for a in sys.argv[1:4])
swaps = 0
while not os.path.exists(stop):
    for _ in range(64):
        if libc.renameat2(-100, folder, -100, link, 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
            swaps += 1
        elif ctypes.get_errno() != errno.ENOENT:
            raise OSError(ctypes.get_errno(), "renameat2")
while swaps % 2 and libc.renameat2(-100, folder, -100, link, 2) != 0:  # the link back where it was
    pass
print(swaps)
"""


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_a_namespace_folder_swapped_for_a_link_meanwhile_is_never_reached_through(tmp_path):
    """A real racing process keeps swapping the namespace folder for a link to an outside folder while this one
    puts, looks up, evicts (a small ``max_bytes``: the sweep of temporary files too), lists and clears: nothing in
    the outside folder is created, changed or removed, though it holds files of the store's names (chunks of the
    looked-up prompts, a killed writer's temporary file) that a path followed through the link would reach."""
    store = open_store(tmp_path / "store")
    looked = [random_ids(1, CHUNK + 1, seed=60 + i) for i in range(8)]
    for ids in looked:
        assert store.put(ids, prefill(llama(F32), ids[:, :CHUNK])) == CHUNK
    store.max_bytes = 6 * chunk_path(store, looked[0], 0).stat().st_size
    outside = tmp_path / "outside"
    outside.mkdir()
    for ids in looked:  # what a lookup through the link would read, find damaged and remove
        (outside / chunk_path(store, ids, 0).name).write_bytes(b"\x89HFKVP\r\n not a chunk")
    (outside / f".{'cd' * 8}.k2j4_x9q.tmp").write_bytes(b"\0" * 100)  # what an eviction would reclaim
    old = time.time() - 1000
    for path in outside.iterdir():
        os.utime(path, (old, old))
    before = _snapshot(outside)
    link, stop = tmp_path / "link", tmp_path / "stop"
    link.symlink_to(outside, target_is_directory=True)
    racer = subprocess.Popen([sys.executable, "-c", RACER, str(store.folder), str(link), str(stop)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # 16 prompts put in turn: each put writes (the 6 chunks max_bytes holds were evicted since its last turn)
    prompts = [random_ids(1, CHUNK, seed=100 + i) for i in range(16)]
    caches = [prefill(llama(F32), ids) for ids in prompts]
    deadline = time.monotonic() + 30  # bounded on a slow machine; ~5 s here
    try:
        for i in range(200):
            store.put(prompts[i % len(prompts)], caches[i % len(prompts)])
            store.cache_for(looked[i % len(looked)])
            folder_usage(store.root)
            store.stats()
            if i % 50 == 49:
                store.clear()
            if time.monotonic() > deadline:
                break
    finally:
        stop.touch()
        out, err = racer.communicate(timeout=30)
    assert racer.returncode == 0, err
    assert int(out) > 1000  # the racer kept swapping throughout
    assert link.is_symlink() and not store.folder.is_symlink()
    after = _snapshot(outside)
    assert after == before, f"{len(set(after) - set(before))} files created outside, " \
                            f"{len(set(before) - set(after))} removed, " \
                            f"{sum(after[n] != before[n] for n in set(after) & set(before))} changed"
