"""`PrefixStore` on sliding-window and alternating full / sliding models (issue 49): a chunk holds each window
layer's tokens its window needs at the chunk's end, and `cache_for` restores what transformers' window layer holds
after a prefill of the stored prefix, so generation continues bit for bit as a `DynamicCache` reused from that
prefix, in this process and in another one. Damage of a window entry (bit flips, truncation, a forged entry with
its checksum recomputed) is a clean miss; layer kinds the store cannot hold are refused at construction, saying
why."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from architectures import tiny_model
from helpers import hybrid_model, random_ids, same_bits, sliding_model
from test_architectures import full_matrix_requested
from test_prefix_store import DAMAGE, LOGGER, _resealed, chunk_path
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, PrefixStore
from hf_kvcompress.cache.store import folder_model

BLOCK = 16
CHUNK = 32
PREFIX = 2 * CHUNK
PROMPT = PREFIX + 6
NEW = 10
CONFIG = CompressionConfig(mode="lossless", block_tokens=BLOCK)
F32, BF16 = torch.float32, torch.bfloat16
DTYPES = {"float32": F32, "bfloat16": BF16}
TESTS = Path(__file__).resolve().parents[1]
#: one architecture per window structure of tests/architectures.py (16-token windows): all-sliding, sliding 5:1
#: with full layers, chunked attention beside full layers; the whole list with ``-m architectures``
FAST = ("mistral", "gemma3_text", "llama4_text")


def open_store(path: Path, model, **kwargs) -> PrefixStore:
    return PrefixStore(model, path=path, max_bytes=1 << 30, chunk_tokens=CHUNK, config=CONFIG, **kwargs)


def prefill(model, ids: torch.Tensor) -> DynamicCache:
    """transformers' own cache of the model's layer kinds holding ``ids`` (one forward)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


def generate(model, ids: torch.Tensor, cache):
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def same_generation(got, want) -> bool:
    return torch.equal(got.sequences, want.sequences) and len(got.logits) == len(want.logits) == NEW and all(
        same_bits(a, b) for a, b in zip(got.logits, want.logits))


def holds_window(cache: CompressedCache, reference: DynamicCache) -> bool:
    """Every layer holds the tokens, keys and values (bits) transformers' layer of that kind holds (none where it
    shares another's K/V)."""
    return all((layer.keys is None and layer.values is None) if ref.keys is None else
               layer.get_seq_length() == ref.get_seq_length() and same_bits(layer.keys, ref.keys)
               and same_bits(layer.values, ref.values) for layer, ref in zip(cache.layers, reference.layers))


# ---------------------------------------------------------------------- exactness, this process


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("window", [48, 12, 100], ids=["window-spans-chunks", "window-in-a-chunk", "window-unfilled"])
def test_alternating_model_continues_as_a_reused_dynamic_cache(tmp_path, window, dtype):
    """Sliding and full layers alternating; windows wider than a chunk (its window reads the chunk before), within
    one, and wider than the prefix (every token held, as transformers holds them)."""
    model = sliding_model(window, dtype)
    store = open_store(tmp_path, model)
    ids = random_ids(1, PROMPT, seed=1)
    reference = prefill(model, ids[:, :PREFIX])
    assert store.put(ids[:, :PREFIX], reference) == PREFIX
    cache = store.cache_for(ids)
    assert cache.get_seq_length() == PREFIX and holds_window(cache, reference)
    assert same_generation(generate(model, ids, cache), generate(model, ids, copy.deepcopy(reference)))
    stats = store.stats()
    assert stats["hits"] == 2 and stats["hit_tokens"] == PREFIX
    # a chunk holds a window layer's tokens its window needs, no more: raw bytes count what they hold
    assert 0 < stats["bytes_saved"] <= stats["raw_bytes"]


def test_a_window_that_moved_on_stores_what_it_still_holds(tmp_path):
    """A put after generation: the window layers hold only their last tokens, so the chunks whose window moved on
    hold none of them, and `cache_for` restores only where the windows are whole (the put of a prefill at a
    chunk's end restores there)."""
    model = sliding_model(12)
    store = open_store(tmp_path, model)
    ids = random_ids(1, PROMPT + 40, seed=2)
    moved = prefill(model, ids[:, : PREFIX + 20])  # its window layers hold tokens 72.. only
    assert store.put(ids[:, : PREFIX + 20], moved) == PREFIX
    assert store.cache_for(ids).get_seq_length() == 0  # held full layers, windows missing: a miss, no error
    reference = prefill(model, ids[:, : 3 * CHUNK])
    assert store.put(ids[:, : 3 * CHUNK], reference) == CHUNK  # chunk 2, with its window
    cache = store.cache_for(ids)
    assert cache.get_seq_length() == 3 * CHUNK and holds_window(cache, reference)
    assert same_generation(generate(model, ids, cache), generate(model, ids, copy.deepcopy(reference)))


def test_put_after_generating_from_a_hit_stores_the_chunks_whose_windows_it_holds(tmp_path):
    """`cache_for`, `generate`, `put(out, cache)`: the `CompressedCache`'s window still holds the new chunk's
    window (48 tokens reach back from token 109 past the chunk's end at 96), so the next lookup restores 96 tokens,
    holding the KV that cache held (bits)."""
    model = sliding_model(48)
    store = open_store(tmp_path, model)
    ids = random_ids(1, 100, seed=9)
    store.put(ids[:, :PREFIX], prefill(model, ids[:, :PREFIX]))
    cache = store.cache_for(ids)
    out = generate(model, ids, cache).sequences
    assert store.put(out, cache) == CHUNK
    again = store.cache_for(out)
    assert again.get_seq_length() == 3 * CHUNK
    for layer, held in zip(again.layers, cache.layers):
        keys, values, first = held.keys, held.values, held.get_seq_length() - held.keys.shape[2]
        start = 3 * CHUNK - layer.keys.shape[2]  # the restored layer's first token
        shared = slice(max(first, start), 3 * CHUNK)
        assert shared.start < shared.stop
        assert same_bits(layer.keys[:, :, shared.start - start :],
                         keys[:, :, shared.start - first : shared.stop - first])
        assert same_bits(layer.values[:, :, shared.start - start :],
                         values[:, :, shared.start - first : shared.stop - first])


def test_sliding_only_model_reads_only_the_chunks_its_window_needs(tmp_path):
    """Every layer a 16-token window: the prefix's last chunk restores it on its own (the chain's key names the
    whole prefix), so a lookup neither needs nor reads the chunks before."""
    from architectures import tiny_model

    model = tiny_model("mistral")
    store = open_store(tmp_path, model)
    ids = random_ids(1, PROMPT, seed=3)
    reference = prefill(model, ids[:, :PREFIX])
    assert store.put(ids[:, :PREFIX], reference) == PREFIX
    chunk_path(store, ids, 0).unlink()
    cache = store.cache_for(ids)
    assert cache.get_seq_length() == PREFIX and holds_window(cache, reference)
    assert store.stats()["hits"] == 1
    assert same_generation(generate(model, ids, cache), generate(model, ids, copy.deepcopy(reference)))


# ---------------------------------------------------------------------- exactness, another process

CHILD = "import sys, test_prefix_store_windows as t; t.child_main(sys.argv[1:])"


def child_main(argv: list[str]) -> None:
    """In a new interpreter: for each architecture and dtype, `cache_for` the prompt from the folder, 10 tokens,
    against a DynamicCache prefilled with the prefix there; prints one JSON line."""
    from architectures import tiny_model

    root, names, threads = Path(argv[0]), argv[1].split(","), int(argv[2])
    # the reference prefill runs the kernels the stored one ran: another thread count splits float32 reductions
    # otherwise on some models (ERGO, Kolibri1, PhiMoE: other bits in the last place)
    torch.set_num_threads(threads)
    results = {}
    for name in names:
        for label, dtype in DTYPES.items():
            model = tiny_model(name, dtype)
            store = open_store(root / f"{name}-{label}", model)
            ids = random_ids(1, PROMPT, seed=4)
            cache = store.cache_for(ids)
            reference = prefill(model, ids[:, :PREFIX])
            results[f"{name}-{label}"] = {
                "tokens": cache.get_seq_length(), "window": holds_window(cache, reference),
                "exact": same_generation(generate(model, ids, cache), generate(model, ids, reference))}
    print(json.dumps(results), flush=True)


def run_in_another_process(tmp_path: Path, names: tuple[str, ...], timeout: int = 600) -> None:
    from architectures import tiny_model

    for name in names:
        for label, dtype in DTYPES.items():
            model = tiny_model(name, dtype)
            ids = random_ids(1, PROMPT, seed=4)
            assert open_store(tmp_path / f"{name}-{label}", model).put(ids[:, :PREFIX],
                                                                        prefill(model, ids[:, :PREFIX])) == PREFIX
    path = os.pathsep.join([str(TESTS), str(TESTS / "cache"), os.environ.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", CHILD, str(tmp_path), ",".join(names), str(torch.get_num_threads())]
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path), timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    want = {"tokens": PREFIX, "window": True, "exact": True}
    assert {case: got for case, got in results.items() if got != want} == {}
    assert len(results) == 2 * len(names)


def test_window_architectures_continue_exactly_in_another_process(tmp_path):
    """put in this process, `cache_for` in a new one, 10 more tokens: tokens and logits (bits) as a DynamicCache
    prefilled with the prefix there, float32 and bfloat16 (`FAST`: one architecture per window structure)."""
    run_in_another_process(tmp_path, FAST)


#: the architectures of tests/architectures.py whose last layers share earlier layers' K/V ("dummy" layers)
KV_SHARING = ("gemma3n_text", "gemma4_text")


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", KV_SHARING)
def test_kv_sharing_model_stores_nothing_for_its_sharing_layers_and_continues_exactly(tmp_path, name, dtype):
    """Layers 4 and 5 of the tiny Gemma 3n / 4 read the K/V their producing layer's update returns: a chunk holds
    the 4 other layers only, and `cache_for` continues as a reused DynamicCache (tokens, logits as bits)."""
    model = tiny_model(name, dtype)
    store = open_store(tmp_path, model)
    ids = random_ids(1, PROMPT, seed=2)
    reference = prefill(model, ids[:, :PREFIX])
    assert [type(layer).__name__ for layer in reference.layers[4:]] == ["DummyLayer"] * 2
    assert store.put(ids[:, :PREFIX], reference) == PREFIX
    (folder,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert "4 layers (3 sliding-window)" in folder_model(folder)
    cache = store.cache_for(ids)
    assert cache.get_seq_length() == PREFIX and holds_window(cache, reference)
    assert same_generation(generate(model, ids, cache), generate(model, ids, copy.deepcopy(reference)))


def test_kv_sharing_models_continue_exactly_in_another_process(tmp_path):
    """put in this process, `cache_for` in a new one (float32 and bfloat16): the sharing layers hold nothing."""
    run_in_another_process(tmp_path, KV_SHARING)


def window_architectures() -> tuple[str, ...]:
    """Every architecture of the matrix whose layers are full attention and windows, with a window."""
    from architectures import layer_types, matrix_architectures, tiny_config

    found = []
    for name in matrix_architectures():
        kinds = set(layer_types(tiny_config(name)))
        if kinds & {"sliding_attention", "chunked_attention"} and kinds <= {
                "full_attention", "sliding_attention", "chunked_attention", "dummy"}:  # dummy: KV sharing
            found.append(name)
    return tuple(found)


@pytest.mark.architectures
def test_every_window_architecture_continues_exactly_in_another_process(tmp_path, pytestconfig):
    """The store column of the architecture matrix for window models (docs/prefix_store.md): run, as the matrix
    is, only with ``-m architectures`` or ``HF_KVCOMPRESS_ARCHITECTURES=1``."""
    if not full_matrix_requested(pytestconfig):
        pytest.skip("the whole matrix: -m architectures or HF_KVCOMPRESS_ARCHITECTURES=1")
    names = tuple(name for name in window_architectures() if name not in REFUSED)
    # 29 architectures x 2 dtypes: 54 s on a quiet 2-core machine, 7.5 min on a busy one (2026-12-08); 31 since
    # KV-sharing models are held (gemma3n_text, gemma4_text: not timed in the whole run)
    run_in_another_process(tmp_path, names, timeout=3600)
    for name in REFUSED:
        from architectures import tiny_model

        with pytest.raises(ValueError, match=REFUSED[name]):
            open_store(tmp_path / name, tiny_model(name))


#: window architectures of the matrix the store refuses, with the reason it gives
REFUSED: dict[str, str] = {"dory": "a KV cache per loop"}


# ---------------------------------------------------------------------- damage and trust


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A folder with the two chunks of a 64-token prefix of the alternating model (window 48: chunk 1's window
    entry reaches into chunk 0's), the prompt and the prefill."""
    model = sliding_model(48)
    root = tmp_path_factory.mktemp("windows")
    ids = random_ids(1, PROMPT, seed=5)
    reference = prefill(model, ids[:, :PREFIX])
    assert open_store(root, model).put(ids[:, :PREFIX], reference) == PREFIX
    return root, ids, reference


@pytest.mark.parametrize("damage", ["payload", "header", "truncated to half", "last byte lost", "a byte appended"])
def test_damaged_window_chunk_is_a_clean_miss(tmp_path, caplog, stored, damage):
    root, ids, _ = stored
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    store = open_store(tmp_path, sliding_model(48))
    path = chunk_path(store, ids, 1)
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cache = store.cache_for(ids)
    # chunk 0 alone holds no window at its end (the prefill's windows had moved on): nothing, never wrong KV
    assert cache.get_seq_length() == 0 and not path.exists() and "damaged" in caplog.text


def _window_entry(header: dict, layer: int = 0) -> dict:
    return next(entry for entry in header["layers"] if entry["layer"] == layer)


@pytest.mark.parametrize("forgery", ["window starts later", "window starts earlier", "blocks moved", "no first"])
def test_forged_window_entry_with_its_checksum_recomputed_is_a_miss(tmp_path, caplog, stored, forgery):
    root, ids, _ = stored
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    store = open_store(tmp_path, sliding_model(48))
    path = chunk_path(store, ids, 1)

    def edit(header):
        entry = _window_entry(header)
        if forgery == "window starts later":
            entry["first"] += 1
        elif forgery == "window starts earlier":  # before what the window needs: a chunk never holds that
            entry["first"] = 0
        elif forgery == "blocks moved":
            entry["blocks"][0]["start"] += 1
        else:
            del entry["first"]

    path.write_bytes(_resealed(path.read_bytes(), edit))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.cache_for(ids).get_seq_length() == 0
    assert not path.exists() and "damaged" in caplog.text


def test_window_of_other_tokens_under_a_true_checksum_is_a_miss(tmp_path, caplog, stored):
    """Chunk 1's window entries swapped for another prompt's (the header's ids kept, the checksum recomputed):
    every check but the binding passes; layer 0's keys of the window are not the model's for these tokens."""
    root, ids, _ = stored
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    model = sliding_model(48)
    store = open_store(tmp_path, model)
    other = random_ids(1, PROMPT, seed=6)
    elsewhere = tmp_path / "other"
    open_store(elsewhere, model).put(other[:, :PREFIX], prefill(model, other[:, :PREFIX]))
    forged = chunk_path(open_store(elsewhere, model), other, 1).read_bytes()
    path = chunk_path(store, ids, 1)

    def same_ids(header):
        header["key"] = store.keys(ids)[1].hex()
        header["token_ids"] = ids[0, CHUNK:PREFIX].tolist()

    path.write_bytes(_resealed(forged, same_ids))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.cache_for(ids).get_seq_length() == 0
    assert not path.exists() and "not what the model computes" in caplog.text


def test_put_refuses_a_window_cache_of_other_tokens(tmp_path):
    model = sliding_model(12)
    store = open_store(tmp_path, model)
    ids = random_ids(1, PROMPT, seed=7)
    with pytest.raises(ValueError, match="not what the model computes"):
        store.put(ids[:, :PREFIX], prefill(model, random_ids(1, PREFIX, seed=8)))
    assert store.stats()["chunks"] == 0


def test_listing_names_the_window_layers(stored):
    """`hf-kvcompress store ls` describes a folder by its newest chunk: a window model's says how many of its
    layers are windows (a full-attention model's line is as before: tests/test_cli_store.py)."""
    root, _, _ = stored
    (folder,) = [path for path in root.iterdir() if path.is_dir()]
    assert folder_model(folder).endswith("(float32, 6 layers (3 sliding-window), 2 KV heads x 16)")


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kind", ["lfm2", "falcon_h1"])
def test_recurrent_and_conv_layers_are_refused_saying_why(tmp_path, kind):
    with pytest.raises(ValueError, match="recurrent / convolution state"):
        open_store(tmp_path, hybrid_model(kind))


def test_a_model_that_keeps_its_states_in_its_modules_is_refused_as_save_refuses_it(tmp_path):
    """RecurrentGemma keeps its recurrent states in its modules, never in the cache: the store gives the reason
    `CompressedCache.save` gives (not the general one of recurrent states), and a hybrid whose cache holds its states
    keeps the general one."""
    with pytest.raises(ValueError, match=r"PrefixStore: layer 0 is a linear-attention layer whose state the model "
                                         r"keeps in its own modules, not in the cache \(RecurrentGemmaForCausalLM\): "
                                         r"a chunk cannot hold it"):
        open_store(tmp_path, tiny_model("recurrent_gemma", F32))
    with pytest.raises(ValueError, match="recurrent / convolution state") as refused:
        open_store(tmp_path, hybrid_model("lfm2"))
    assert "own modules" not in str(refused.value)


def test_calibrated_chunks_are_refused_for_window_models(tmp_path):
    with pytest.raises(ValueError, match="calibrations cover full-attention models only"):
        open_store(tmp_path, sliding_model(12), predictor="context")
    assert open_store(tmp_path, sliding_model(12)).predictor == "generic"  # "auto" never looks one up
