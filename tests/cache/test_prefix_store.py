"""`PrefixStore`: prompt prefixes' KV on disk, reused exactly as transformers reuses a prefilled `DynamicCache`.

Tiny random 6-layer Llamas (float32 by default: bf16 matmuls are several times slower on a CPU; bf16 where a test
names it), blocks of 16 tokens and chunks of 32. A stored chunk's KV must be the bits a `DynamicCache` prefill of
the same prefix holds, so every store here is filled from a cache that prefilled exactly the prefix it stores (KV
computed with other matrix shapes may differ in its last bits). The two tests marked slow run child processes
(this module, imported by ``python -c``): concurrent writers and readers, and a writer killed with SIGKILL halfway
through a chunk.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import fresh_tiny_model, hybrid_model, random_ids, same_bits
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, PrefixStore
from hf_kvcompress.blockcodec import BlockCodec
from hf_kvcompress.cache import store as store_module
from hf_kvcompress.cache import store_folder
from hf_kvcompress.cache.container import DIGEST_BYTES, PREFIX
from hf_kvcompress.cache.store import SUFFIX, clear, folder_usage
from hf_kvcompress.calibration import Calibration

LAYERS = 6
BLOCK = 16
CHUNK = 32
CONFIG = CompressionConfig(mode="lossless", block_tokens=BLOCK)
LOGGER = "hf_kvcompress.cache.store"
BF16, F32 = torch.bfloat16, torch.float32
TESTS = Path(__file__).resolve().parents[1]


@functools.cache
def llama(dtype: torch.dtype = F32, seed: int = 0):
    """The 6-layer tiny Llama in ``dtype``; ``seed`` != 0: the same config with other random weights."""
    model = fresh_tiny_model("llama-gqa", dtype, layers=LAYERS)
    if seed:
        torch.manual_seed(seed)
        model = type(model)(model.config).to(dtype).eval()
        model.generation_config.pad_token_id = 0
    return model


@functools.cache
def calibration(seed: int) -> Calibration:
    """A `context` calibration of ``llama(F32)`` fitted on 256 random tokens (``seed``: which)."""
    return Calibration.fit(llama(F32), None, ids=random_ids(1, 256, seed=seed), tokens=256, chunk=128,
                           predictors=("context",), probe_layers=(1,), progress=False)


def open_store(path: Path, model=None, **kwargs) -> PrefixStore:
    kwargs.setdefault("max_bytes", 1 << 30)
    kwargs.setdefault("chunk_tokens", CHUNK)
    kwargs.setdefault("config", CONFIG)
    return PrefixStore(model if model is not None else llama(F32), path=path, **kwargs)


def prefill(model, ids: torch.Tensor) -> DynamicCache:
    """A DynamicCache holding exactly ``ids`` (one forward pass over them)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


def generate(model, ids: torch.Tensor, cache):
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)


def assert_same_generation(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    for a, b in zip(got.logits, want.logits):
        assert same_bits(a, b)


def holds_prefix(cache, reference, tokens: int) -> bool:
    """Whether ``cache`` holds exactly ``tokens`` tokens whose keys and values are ``reference``'s first ones."""
    if cache.get_seq_length() != tokens:
        return False
    if tokens == 0:
        return True
    return len(cache.layers) == len(reference.layers) and all(
        same_bits(layer.keys, ref.keys[:, :, :tokens]) and same_bits(layer.values, ref.values[:, :, :tokens])
        for layer, ref in zip(cache.layers, reference.layers)
    )


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{SUFFIX}"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


def chunk_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in chunk_files(root))


def chunk_path(store: PrefixStore, ids: torch.Tensor, index: int) -> Path:
    return store.folder / f"{store.keys(ids)[index].hex()}{SUFFIX}"


# ---------------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "float32"])
def test_hit_generates_exactly_as_a_reused_dynamic_cache(tmp_path, dtype):
    """transformers' prompt reuse: a DynamicCache prefilled with a prefix, deep-copied per prompt. A prompt whose
    first chunks are stored generates the same tokens and logits (bits) from `cache_for`."""
    model = llama(dtype)
    store = open_store(tmp_path, model)
    ids = random_ids(1, 100, seed=1)
    prefix = prefill(model, ids[:, : 2 * CHUNK])
    assert store.put(ids[:, : 2 * CHUNK], prefix) == 2 * CHUNK
    cache = store.cache_for(ids)
    assert isinstance(cache, CompressedCache)
    assert holds_prefix(cache, prefix, 2 * CHUNK)
    assert cache.token_ids.tolist() == ids[:, : 2 * CHUNK].tolist()
    assert_same_generation(generate(model, ids, cache), generate(model, ids, copy.deepcopy(prefix)))
    assert store.stats()["hits"] == 2 and store.stats()["hit_tokens"] == 2 * CHUNK


def test_put_after_generate_stores_the_kv_the_cache_held(tmp_path):
    """``put(generate's output, the cache)`` adds the chunks generation computed; a later lookup holds exactly the
    KV that cache held (its blocks, not recomputed), and generates as the cache would have continued."""
    model = llama(BF16)
    store = open_store(tmp_path, model)
    ids = random_ids(1, 100, seed=2)
    store.put(ids[:, :CHUNK], prefill(model, ids[:, :CHUNK]))
    cache = store.cache_for(ids)
    assert cache.get_seq_length() == CHUNK
    out = generate(model, ids, cache).sequences  # 108 tokens, the cache holds 107
    assert store.put(out, cache) == 2 * CHUNK  # chunks 1 and 2; chunk 0 was there
    again = store.cache_for(out)
    assert again.get_seq_length() == 3 * CHUNK
    assert holds_prefix(again, cache, 3 * CHUNK)
    more = out[:, 3 * CHUNK :]
    cache.crop(3 * CHUNK - cache.get_seq_length())  # negative: tokens to remove
    with torch.no_grad():
        want = model(more, cache=cache).logits  # the generating cache continues on its own tokens
        got = model(more, cache=again).logits
    assert same_bits(got, want)


# ---------------------------------------------------------------------- lookups


def test_longest_stored_prefix_and_stats(tmp_path):
    model = llama(F32)
    # coded for size (lanes): the generation coder keeps float32's 23 mantissa bits raw, and on these tiny blocks of
    # a random model its streams with their side data come out ~0.5 % over raw float32 (docs/codec.md "The huff coder")
    store = open_store(tmp_path, model, config=CompressionConfig(mode="lossless", block_tokens=BLOCK,
                                                                 lossless={"coder": "lanes"}))
    base = random_ids(1, 4 * CHUNK, seed=3)
    reference = prefill(model, base)
    assert store.put(base, reference) == 4 * CHUNK
    assert store.put(base, reference) == 0  # all there

    def other(length: int, seed: int) -> torch.Tensor:
        return random_ids(1, length, seed=seed) + 128  # ids no random prompt of vocabulary 128 shares (keys only)

    def lookup(ids: torch.Tensor) -> int:
        cache = store.cache_for(ids)
        tokens = cache.get_seq_length()
        assert holds_prefix(cache, reference, tokens)
        return tokens

    assert lookup(torch.cat([base, other(22, 4)], dim=1)) == 4 * CHUNK  # 4 chunks hit
    assert lookup(torch.cat([base[:, : 2 * CHUNK], other(40, 5)], dim=1)) == 2 * CHUNK  # shares 2, 1 missed
    diverging = base[:, :100].clone()
    diverging[0, 2 * CHUNK + 5] = 127 if diverging[0, 2 * CHUNK + 5] != 127 else 126  # inside chunk 2
    assert lookup(diverging) == 2 * CHUNK  # 2 hit, 1 missed
    assert lookup(base) == 3 * CHUNK  # whole chunks only: the last is left for the model to compute; 3 hit
    assert lookup(base[:, : 3 * CHUNK + 1]) == 3 * CHUNK  # 3 hit
    assert lookup(other(100, 6)) == 0  # 3 missed
    assert lookup(base[:, :CHUNK]) == 0  # a prompt of one chunk: nothing usable, nothing counted
    assert lookup(base[0, : 2 * CHUNK + 1].tolist()) == 2 * CHUNK  # a list of ints; 2 hit
    assert lookup(base[:, : 2 * CHUNK + 1].to(torch.int32)) == 2 * CHUNK  # int32 ids: the same keys; 2 hit
    stats = store.stats()
    hits = 4 + 2 + 2 + 3 + 3 + 2 + 2
    raw_chunk = 2 * LAYERS * 2 * 16 * CHUNK * 4  # keys and values, layers, kv heads, head dim, tokens, float32
    assert stats == {"chunks": 4, "bytes": chunk_bytes(tmp_path), "raw_bytes": 4 * raw_chunk, "hits": hits,
                     "misses": 1 + 1 + 3, "hit_tokens": hits * CHUNK, "bytes_saved": hits * raw_chunk}
    assert stats["bytes"] < stats["raw_bytes"]


def test_keys_chain_each_chunk_on_its_prefix(tmp_path):
    store = open_store(tmp_path)
    ids = random_ids(1, 3 * CHUNK + 5, seed=7)
    keys = store.keys(ids)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert store.keys(ids[:, : 2 * CHUNK]) == keys[:2]
    changed = ids.clone()
    changed[0, 0] = 3 if changed[0, 0] != 3 else 4
    assert set(store.keys(changed)).isdisjoint(keys)  # a change in chunk 0 changes every later key
    assert store.keys(ids[:, : CHUNK - 1]) == []


# ---------------------------------------------------------------------- damage


def _flip(offset):
    def damage(data: bytes) -> bytes:
        at = offset(data)
        return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
    return damage


def _payload_middle(data: bytes) -> int:
    header_end = PREFIX.size + PREFIX.unpack_from(data)[2]
    return (header_end + len(data) - DIGEST_BYTES) // 2


DAMAGE = {
    "magic": _flip(lambda data: 1),
    "version": _flip(lambda data: 8),
    "header length": _flip(lambda data: 12),
    "header": _flip(lambda data: PREFIX.size + 40),
    "payload": _flip(_payload_middle),
    "digest": _flip(lambda data: len(data) - 1),
    "empty": lambda data: b"",
    "truncated to the prefix": lambda data: data[:20],
    "truncated to half": lambda data: data[: len(data) // 2],
    "last byte lost": lambda data: data[:-1],
    "a byte appended": lambda data: data + b"\0",
}


@pytest.fixture(scope="module")
def three_chunks(tmp_path_factory):
    """A store folder holding the first three chunks of a 100-token prompt (copied by each test that damages it),
    the prompt, and the DynamicCache prefill they were stored from."""
    model = llama(F32)
    root = tmp_path_factory.mktemp("three-chunks")
    ids = random_ids(1, 100, seed=8)
    reference = prefill(model, ids[:, : 3 * CHUNK])
    assert open_store(root, model).put(ids[:, : 3 * CHUNK], reference) == 3 * CHUNK
    return root, ids, reference


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_chunk_is_a_miss_removed_with_one_warning(tmp_path, caplog, three_chunks, damage):
    original, ids, reference = three_chunks
    shutil.copytree(original, tmp_path, dirs_exist_ok=True)
    store = open_store(tmp_path)
    path = chunk_path(store, ids, 1)
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cache = store.cache_for(ids)
    assert holds_prefix(cache, reference, CHUNK)  # chunk 0 only: never the damaged chunk's KV
    assert not path.exists()
    warnings = [r for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert path.name in warnings[0].getMessage() and "damaged" in warnings[0].getMessage()
    assert store.stats()["misses"] == 2 and store.stats()["chunks"] == 2
    if damage == "payload":
        assert store.put(ids[:, : 3 * CHUNK], reference) == CHUNK  # written again
        assert holds_prefix(store.cache_for(ids), reference, 3 * CHUNK)


def _resealed(data: bytes, edit) -> bytes:
    """``data`` with its header edited by ``edit`` (a dict -> None) and a valid digest again."""
    prefix = PREFIX
    _, version, size = prefix.unpack_from(data)
    header = json.loads(data[prefix.size : prefix.size + size])
    edit(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    body = prefix.pack(store_module.MAGIC, version, len(blob)) + blob + data[prefix.size + size : -DIGEST_BYTES]
    return body + hashlib.sha256(body).digest()


def test_chunk_edited_behind_its_checksum_or_under_another_name_is_a_miss(tmp_path, caplog, three_chunks):
    original, ids, reference = three_chunks
    shutil.copytree(original, tmp_path, dirs_exist_ok=True)
    store = open_store(tmp_path)
    first, second, third = (chunk_path(store, ids, i) for i in range(3))

    def other_ids(header):
        header["token_ids"][3] = (header["token_ids"][3] + 1) % 128

    second.write_bytes(_resealed(second.read_bytes(), other_ids))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert holds_prefix(store.cache_for(ids), reference, CHUNK)
    assert not second.exists() and "other tokens" in caplog.text
    caplog.clear()
    first.write_bytes(third.read_bytes())  # a whole, valid chunk, of another key
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.cache_for(ids).get_seq_length() == 0
    assert not first.exists() and "another format, key or namespace" in caplog.text


# ---------------------------------------------------------------------- eviction


def test_eviction_bounds_the_bytes_and_keeps_the_most_recently_used(tmp_path):
    model = llama(F32)
    store = open_store(tmp_path, model)
    prompts = [random_ids(1, CHUNK + 1, seed=20 + i) for i in range(8)]  # one usable chunk each

    def put(i: int) -> None:
        assert store.put(prompts[i], prefill(model, prompts[i][:, :CHUNK])) == CHUNK
        assert chunk_bytes(tmp_path) <= store.max_bytes
        time.sleep(0.02)  # file times advance by the kernel's clock tick

    def kept() -> set[int]:
        return {i for i, p in enumerate(prompts) if chunk_path(store, p, 0).exists()}

    put(0)
    store.max_bytes = int(3.5 * chunk_bytes(tmp_path))  # three chunks (sizes vary by a few percent)
    put(1)
    put(2)
    assert kept() == {0, 1, 2}
    assert store.cache_for(prompts[0]).get_seq_length() == CHUNK  # a hit refreshes chunk 0's time
    time.sleep(0.02)
    put(3)
    assert kept() == {0, 2, 3}  # 1 was the least recently used
    assert store.put(prompts[2], prefill(model, prompts[2][:, :CHUNK])) == 0  # held: refreshed, not written
    time.sleep(0.02)
    put(4)
    assert kept() == {2, 3, 4}
    for i in range(5, 8):
        put(i)
    assert kept() == {5, 6, 7}
    assert store.stats()["chunks"] == 3
    store.max_bytes = 0
    assert store.evict() > 0 and chunk_files(tmp_path) == []


def test_eviction_takes_a_chains_tail_before_its_head(tmp_path):
    """A chunk is of no use without the chunks before it: a put or a hit marks a prompt's chunks used with the
    first the newest, so eviction shortens a stored prefix from its end instead of cutting its head off."""
    model = llama(F32)
    long, short = random_ids(1, 4 * CHUNK + 1, seed=40), random_ids(1, CHUNK + 1, seed=41)
    reference = prefill(model, long[:, : 4 * CHUNK])
    short_kv = prefill(model, short[:, :CHUNK])
    open_store(tmp_path / "sized", model).put(short, short_kv)
    short_bytes = chunk_bytes(tmp_path / "sized")
    store = open_store(tmp_path / "store", model)
    assert store.put(long, reference) == 4 * CHUNK
    paths = [chunk_path(store, long, i) for i in range(4)]
    times = [p.stat().st_mtime_ns for p in paths]
    assert times == sorted(times, reverse=True) and len(set(times)) == 4
    time.sleep(0.02)
    sizes = [p.stat().st_size for p in paths]
    store.max_bytes = sum(sizes) - sizes[3] + short_bytes  # one chunk too few for both prompts
    assert store.put(short, short_kv) == CHUNK
    assert [p.exists() for p in paths] == [True, True, True, False]
    assert holds_prefix(store.cache_for(long), reference, 3 * CHUNK)
    times = [p.stat().st_mtime_ns for p in paths[:3]]
    assert times == sorted(times, reverse=True) and len(set(times)) == 3  # the hit marked them in chain order
    assert store.cache_for(short).get_seq_length() == CHUNK


def test_eviction_counts_every_model_in_the_folder(tmp_path):
    """One bound for the folder: a put for one model evicts another model's older chunks."""
    ids = random_ids(1, CHUNK + 1, seed=30)
    f32_kv = prefill(llama(F32), ids[:, :CHUNK])
    open_store(tmp_path / "sized", llama(F32)).put(ids, f32_kv)
    f32_bytes = chunk_bytes(tmp_path / "sized")
    bf16 = open_store(tmp_path / "shared", llama(BF16))
    f32 = open_store(tmp_path / "shared", llama(F32), max_bytes=f32_bytes + 100)  # no room for both chunks
    bf16.put(ids, prefill(llama(BF16), ids[:, :CHUNK]))
    time.sleep(0.02)
    f32.put(ids, f32_kv)
    assert chunk_files(tmp_path / "shared") == [chunk_path(f32, ids, 0)]


# ---------------------------------------------------------------------- what never matches


@pytest.mark.parametrize("other", ["weights", "dtype", "chunk_tokens", "predictor", "calibration"])
def test_another_model_dtype_or_calibration_never_hits(tmp_path, other):
    model = llama(F32)
    predictor = "context" if other == "calibration" else "generic"
    cal = calibration(1) if predictor == "context" else None
    store = open_store(tmp_path, model, predictor=predictor, calibration=cal)
    ids = random_ids(1, 100, seed=10)
    store.put(ids[:, : 3 * CHUNK], prefill(model, ids[:, : 3 * CHUNK]))
    assert store.cache_for(ids).get_seq_length() == 3 * CHUNK
    other_store = {
        "weights": lambda: open_store(tmp_path, llama(F32, seed=1)),
        "dtype": lambda: open_store(tmp_path, llama(BF16)),
        "chunk_tokens": lambda: open_store(tmp_path, model, chunk_tokens=2 * CHUNK),
        "predictor": lambda: open_store(tmp_path, model, predictor="context", calibration=calibration(1)),
        "calibration": lambda: open_store(tmp_path, model, predictor="context", calibration=calibration(2)),
    }[other]()
    assert other_store.namespace != store.namespace and other_store.folder != store.folder
    assert other_store.cache_for(ids).get_seq_length() == 0
    assert other_store.stats()["chunks"] == 0 and other_store.stats()["hits"] == 0


def lossless(residual_tokens: int = 0, **settings) -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=residual_tokens, lossless=settings)


def test_settings_that_do_not_change_the_bytes_share_the_chunks(tmp_path):
    """Threads, the decoded-blocks budget, the save predictor and the residual change how a cache runs, not what a
    chunk holds: stores that differ only in them share their chunks; a codec setting does not."""
    model = llama(F32)
    ids = random_ids(1, 100, seed=17)
    prefix = prefill(model, ids[:, : 2 * CHUNK])
    writer = open_store(tmp_path / "shared", model, config=lossless(workers=1))
    assert writer.put(ids[:, : 2 * CHUNK], prefix) == 2 * CHUNK
    other_threads = open_store(tmp_path / "threads", model, config=lossless(workers=2))
    other_threads.put(ids[:, : 2 * CHUNK], prefix)
    assert [p.read_bytes() for p in chunk_files(tmp_path / "threads")] == \
        [p.read_bytes() for p in chunk_files(tmp_path / "shared")]
    reader = open_store(tmp_path / "shared", model,
                        config=lossless(residual_tokens=8, workers=2, decoded_budget=0.5, save_predictor="none"))
    assert reader.namespace == writer.namespace
    assert holds_prefix(reader.cache_for(ids), prefix, 2 * CHUNK)
    codec = open_store(tmp_path / "shared", model, config=lossless(mean_steps=8))
    assert codec.namespace != writer.namespace and codec.cache_for(ids).get_seq_length() == 0


# ---------------------------------------------------------------------- refusals


def test_refusals_name_the_problem(tmp_path):
    model = llama(F32)
    store = open_store(tmp_path, model)
    with pytest.raises(ValueError, match="one row at a time, got a batch of 2"):
        store.cache_for(random_ids(2, 40))
    with pytest.raises(ValueError, match="one row at a time, got a batch of 2"):
        store.put(random_ids(2, 40), prefill(model, random_ids(2, 40)))
    with pytest.raises(ValueError, match="integer token ids"):
        store.cache_for(torch.rand(1, 40))
    with pytest.raises(ValueError, match="a tensor or a list of ints"):
        store.cache_for([1.0, 2.0])
    with pytest.raises(ValueError, match="chunk_tokens must be a positive multiple of block_tokens=16, got 24"):
        open_store(tmp_path, model, chunk_tokens=24)
    with pytest.raises(ValueError, match="predictor must be one of"):
        open_store(tmp_path, model, predictor="probe")
    with pytest.raises(ValueError, match="lossless CompressionConfig"):
        open_store(tmp_path, model, config=CompressionConfig(mode="lossy"))
    with pytest.raises(ValueError, match="predictor 'generic' in generation"):
        open_store(tmp_path, model, config=CompressionConfig(mode="lossless", lossless={"predictor": "context"}))
    with pytest.raises(ValueError, match="max_bytes"):
        open_store(tmp_path, model, max_bytes=-1)
    with pytest.raises(ValueError, match=r"lfm2 has layers the store cannot hold: conv \(layer 0\): a recurrent"):
        open_store(tmp_path, hybrid_model("lfm2"))  # windows are held: test_prefix_store_windows.py
    assert chunk_files(tmp_path) == []


def test_put_refuses_a_cache_that_recorded_other_tokens(tmp_path):
    model = llama(F32)
    store = open_store(tmp_path, model)
    ids = random_ids(1, 3 * CHUNK, seed=11)
    cache = CompressedCache(CONFIG, model=model)
    with torch.no_grad():
        model(ids, cache=cache)
    other = ids.clone()
    other[0, 40] = 127 if other[0, 40] != 127 else 126
    with pytest.raises(ValueError, match="the cache holds the KV of other tokens than ids"):
        store.put(other, cache)
    assert chunk_files(tmp_path) == []
    assert store.put(ids, cache) == 3 * CHUNK


def test_put_refuses_a_lossy_cache(tmp_path):
    """A lossy cache's keys are fewer entries (summaries, a window) than its tokens: never stored as a prefix."""
    model = fresh_tiny_model("llama-gqa", F32, layers=LAYERS)  # lossy mode changes the model's attention
    store = open_store(tmp_path, model)
    ids = random_ids(1, 200, seed=12)
    cache = CompressedCache(CompressionConfig(mode="lossy", block_tokens=BLOCK, lossy={"method": "streaming"}),
                            model=model)
    with torch.no_grad():
        model(ids, cache=cache)
    with pytest.raises(ValueError, match="entries for 200 tokens"):
        store.put(ids, cache)
    assert chunk_files(tmp_path) == []  # not even the first chunk


# ---------------------------------------------------------------------- coding


@pytest.fixture
def encodes(monkeypatch) -> list[int]:
    """The layer of each block coded from now on (`BlockCodec.encode_blocks`, which `encode_block` and a layer's
    seal go through)."""
    calls = []
    original = BlockCodec.encode_blocks

    def counting(self, *args, **kwargs):
        blocks = original(self, *args, **kwargs)
        calls.extend(args[0] for _ in blocks)
        return blocks

    monkeypatch.setattr(BlockCodec, "encode_blocks", counting)
    return calls


@pytest.mark.parametrize(("dtype", "residual"), [(BF16, 0), (F32, 40)], ids=["bf16-all-sealed", "float32-residual"])
def test_put_codes_a_dynamic_cache_and_takes_a_compressed_caches_blocks(tmp_path, encodes, dtype, residual):
    """A DynamicCache's KV is coded by the store; a lossless CompressedCache's sealed blocks are taken as they are
    (the same bytes: generation codes them as the store does), and a chunk not wholly sealed yet (a residual of
    40 tokens leaves tokens 48.. unsealed) is coded from the cache's keys and values. A lookup adopts the stored
    blocks without decoding them."""
    model = llama(dtype)
    ids = random_ids(1, 100, seed=13)
    reference = prefill(model, ids)
    compressed = CompressedCache(CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=residual),
                                 model=model)
    with torch.no_grad():
        model(ids, cache=compressed)
    from_dynamic, from_compressed = open_store(tmp_path / "a", model), open_store(tmp_path / "b", model)
    encodes.clear()
    assert from_dynamic.put(ids, reference) == 3 * CHUNK
    assert len(encodes) == 3 * LAYERS * CHUNK // BLOCK
    encodes.clear()
    assert from_compressed.put(ids, compressed) == 3 * CHUNK
    sealed_chunks = 3 if residual == 0 else 1  # (100 - 40) // 16 = 3 blocks sealed: chunk 0 only
    assert len(encodes) == (3 - sealed_chunks) * LAYERS * CHUNK // BLOCK
    a, b = chunk_files(tmp_path / "a"), chunk_files(tmp_path / "b")
    assert [p.name for p in a] == [p.name for p in b] and len(a) == 3
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))
    encodes.clear()
    cache = from_compressed.cache_for(ids)
    # adopted as coded; each block decoded once by the lookup (its streams checked, layer 0 bound to the ids)
    assert encodes == [] and cache.lossless.decodes == 3 * LAYERS * CHUNK // BLOCK
    assert all(block.verified for layer in cache.kv_layers() for block in layer.blocks)
    assert holds_prefix(cache, reference, 3 * CHUNK)


def test_context_predictor_round_trip_is_exact(tmp_path, encodes):
    """``predictor="context"``: chunks coded with the calibration, transcoded on lookup; the hit is exact and
    generates as the reused DynamicCache does."""
    model = llama(F32)
    store = open_store(tmp_path, model, predictor="context", calibration=calibration(1))
    ids = random_ids(1, 100, seed=14)
    prefix = prefill(model, ids[:, : 2 * CHUNK])
    assert store.put(ids[:, : 2 * CHUNK], prefix) == 2 * CHUNK
    cache = store.cache_for(ids)
    assert holds_prefix(cache, prefix, 2 * CHUNK)
    assert_same_generation(generate(model, ids, cache), generate(model, ids, copy.deepcopy(prefix)))
    # a generic CompressedCache's blocks are not what this store holds: coded again, the same bytes as from KV
    compressed = CompressedCache(CONFIG, model=model)
    with torch.no_grad():
        model(ids[:, : 2 * CHUNK], cache=compressed)
    other = open_store(tmp_path / "other", model, predictor="context", calibration=calibration(1))
    encodes.clear()
    assert other.put(ids[:, : 2 * CHUNK], compressed) == 2 * CHUNK
    assert len(encodes) == 2 * LAYERS * CHUNK // BLOCK
    assert [p.read_bytes() for p in chunk_files(other.folder)] == [p.read_bytes() for p in chunk_files(store.folder)]


# ---------------------------------------------------------------------- folder tools


def test_folder_usage_and_clear(tmp_path):
    ids = random_ids(1, 100, seed=15)
    bf16, f32 = open_store(tmp_path, llama(BF16)), open_store(tmp_path, llama(F32))
    bf16.put(ids[:, : 2 * CHUNK], prefill(llama(BF16), ids[:, : 2 * CHUNK]))
    f32.put(ids[:, :CHUNK], prefill(llama(F32), ids[:, :CHUNK]))
    leftover = bf16.folder / ".0123456789abcdef.abc_12xy.tmp"  # a name mkstemp gives
    leftover.write_bytes(b"x" * 100)
    usage = {entry["folder"]: entry for entry in folder_usage(tmp_path)}
    assert set(usage) == {bf16.folder.name, f32.folder.name}
    assert usage[bf16.folder.name]["chunks"] == 2 and usage[bf16.folder.name]["temporary_files"] == 1
    assert usage[bf16.folder.name]["bytes"] == bf16.stats()["bytes"]
    assert usage[f32.folder.name]["chunks"] == 1 and usage[f32.folder.name]["temporary_files"] == 0
    assert usage[f32.folder.name]["last_used"] == max(f.stat().st_mtime for f in f32.folder.glob("*.kvp"))
    total = chunk_bytes(tmp_path)
    assert clear(tmp_path) == total + 100
    assert list(tmp_path.iterdir()) == [tmp_path / store_module.MARKER]  # still a store's folder
    assert folder_usage(tmp_path) == [] and folder_usage(tmp_path / "missing") == []
    assert clear(tmp_path / "missing") == 0


# ---------------------------------------------------------------------- other processes

CHILD = "import sys, test_prefix_store as t; t.child_main(sys.argv[1:])"
SHARED = 2 * CHUNK  # the stored prefix of every concurrent prompt


def spawn(*args, stderr: Path) -> subprocess.Popen:
    """This module's `child_main` in a new interpreter: stdout a pipe, stderr the file ``stderr`` (a full pipe
    would stall it)."""
    path = os.pathsep.join([str(TESTS), str(TESTS / "cache"), os.environ.get("PYTHONPATH", "")])
    with stderr.open("w") as err:
        return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], env=dict(os.environ, PYTHONPATH=path),
                                text=True, stdout=subprocess.PIPE, stderr=err)


def child_main(argv: list[str]) -> None:
    role, *args = argv
    {"concurrent": _concurrent_child, "killed": _killed_child}[role](*args)


def concurrent_prompts() -> list[torch.Tensor]:
    """Six 80-token prompts in pairs that share their first chunk."""
    heads = [random_ids(1, CHUNK, seed=100 + j) for j in range(3)]
    return [torch.cat([heads[i % 3], random_ids(1, 48, seed=200 + i)], dim=1) for i in range(6)]


def _concurrent_child(path: str, seed: str, barrier: str, max_bytes: str) -> None:
    model = llama(F32)
    store = open_store(Path(path), model, max_bytes=int(max_bytes))
    prompts = concurrent_prompts()
    references = [prefill(model, p[:, :SHARED]) for p in prompts]
    Path(barrier, f"ready-{seed}").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(barrier).glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    hits, errors, generated = [], [], False
    order = torch.Generator().manual_seed(int(seed))
    for _ in range(4):
        for i in torch.randperm(len(prompts), generator=order).tolist():
            cache = store.cache_for(prompts[i])
            tokens = cache.get_seq_length()
            hits.append(tokens)
            if not holds_prefix(cache, references[i], tokens):
                errors.append(f"prompt {i}: a hit of {tokens} tokens is not the prefilled KV")
            elif tokens == SHARED and not generated:
                want = generate(model, prompts[i], copy.deepcopy(references[i]))
                got = generate(model, prompts[i], cache)
                generated = True
                if not torch.equal(got.sequences, want.sequences) or not all(
                        same_bits(a, b) for a, b in zip(got.logits, want.logits)):
                    errors.append(f"prompt {i}: generation differs from the reused DynamicCache")
            store.put(prompts[i][:, :SHARED], references[i])
    print(json.dumps({"hits": hits, "errors": errors, "generated": generated}), flush=True)


class _HalfWritingOs:
    """The store module's ``os`` in the killed writer: its second temporary file gets half its bytes, then the
    writer says so and waits to be killed."""

    def __init__(self):
        self.opened = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, fd, *args, **kwargs):
        self.opened += 1
        out = os.fdopen(fd, *args, **kwargs)
        return out if self.opened < 2 else _HalfWriter(out)


class _HalfWriter:
    def __init__(self, out):
        self.out = out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.out.close()

    def write(self, data: bytes) -> None:
        self.out.write(data[: len(data) // 2])
        self.out.flush()
        os.fsync(self.out.fileno())
        print("HALF", flush=True)
        time.sleep(600)


def _killed_child(path: str) -> None:
    model = llama(F32)
    store = open_store(Path(path), model)
    ids = random_ids(1, 100, seed=16)
    store_folder.os = _HalfWritingOs()  # the module that writes chunks (`store_folder.write_atomic`)
    store.put(ids[:, : 3 * CHUNK], prefill(model, ids[:, : 3 * CHUNK]))
    print("DONE", flush=True)  # not reached


@pytest.mark.slow
def test_two_processes_put_and_read_the_same_prefixes_concurrently(tmp_path):
    """Two processes look up, check and put six prompts four times over, at once, under a bound that keeps
    evicting: no error, and every hit holds exactly the KV a DynamicCache prefill of its tokens holds."""
    root = tmp_path / "store"
    model = llama(F32)
    store = open_store(root, model)
    prompts = concurrent_prompts()
    references = [prefill(model, p[:, :SHARED]) for p in prompts]
    store.put(prompts[0][:, :SHARED], references[0])
    max_bytes = int(6.5 * chunk_bytes(root) / 2)  # 6 of the 9 chunks
    errs = [tmp_path / f"stderr-{seed}" for seed in (1, 2)]
    children = [spawn("concurrent", root, seed, tmp_path, max_bytes, stderr=err) for seed, err in zip((1, 2), errs)]
    results = []
    for child, err in zip(children, errs):
        out, _ = child.communicate(timeout=300)
        assert child.returncode == 0, err.read_text()[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["errors"] for r in results] == [[], []]
    assert all(r["generated"] for r in results)  # each process generated from a whole hit
    assert all(sum(tokens > 0 for tokens in r["hits"]) >= 6 for r in results)
    assert temp_files(root) == []
    assert chunk_bytes(root) <= max_bytes
    for prompt, reference in zip(prompts, references):  # whatever is left is whole and exact
        cache = store.cache_for(prompt)
        assert holds_prefix(cache, reference, cache.get_seq_length())
    assert store.stats()["hits"] > 0


@pytest.mark.slow
def test_writer_killed_mid_chunk_leaves_nothing_that_loads(tmp_path, caplog):
    """SIGKILL while a chunk's temporary file holds half its bytes: the chunk written before it is whole, the
    half-written one is a temporary file no lookup reads (no warning: it is not a chunk), which a later eviction
    removes as soon as nobody holds its lock (the kernel dropped the killed writer's); the chunks are written again
    by the next put."""
    root = tmp_path / "store"
    child = spawn("killed", root, stderr=tmp_path / "stderr")
    try:
        line = child.stdout.readline()
        assert line.strip() == "HALF", (line, (tmp_path / "stderr").read_text()[-4000:])
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    model = llama(F32)
    store = open_store(root, model)
    ids = random_ids(1, 100, seed=16)
    reference = prefill(model, ids[:, : 3 * CHUNK])
    assert chunk_files(root) == [chunk_path(store, ids, 0)]
    leftover, = temp_files(root)
    assert leftover.parent == store.folder and 0 < leftover.stat().st_size < chunk_path(store, ids, 0).stat().st_size
    assert folder_usage(root) == [{"folder": store.folder.name, "chunks": 1, "bytes": chunk_bytes(root),
                                   "temporary_files": 1, "last_used": pytest.approx(time.time(), abs=120)}]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert holds_prefix(store.cache_for(ids), reference, CHUNK)
    assert caplog.records == []
    assert store.evict() == 0 and leftover.exists()  # younger than the grace: its writer may not have locked it yet
    old = time.time() - store_folder.TEMP_GRACE_SECONDS - 1
    os.utime(leftover, (old, old))
    size = leftover.stat().st_size
    assert store.evict() == size and temp_files(root) == []  # unlocked: its writer is gone (not an hour later)
    assert store.put(ids[:, : 3 * CHUNK], reference) == 2 * CHUNK
    assert holds_prefix(store.cache_for(ids), reference, 3 * CHUNK)
