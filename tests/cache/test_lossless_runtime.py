"""Lossless mode inside generate(): work per step, the decoded pool's budget, and bytes the cache really holds.

Six-layer models throughout: a memo of the last two layers, or a per-step cost, would hide behind two.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_continues_identically, fresh_tiny_model, random_ids, same_bits, tiny_calibration
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.persist import read_header
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.predictors.registry import CALIBRATED_STORAGE
from hf_kvcompress_eval.env import walk_held_bytes

LAYERS = 6
BLOCK, RESIDUAL = 16, 8


@functools.cache
def model6(kind: str = "llama-gqa"):
    return fresh_tiny_model(kind, torch.bfloat16, layers=LAYERS)


@functools.cache
def calibration6() -> Calibration:
    return tiny_calibration(model6(), 256, probe_layers=(1,))


def lossless(budget: float = 0.0, predictor: str = "context") -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                             lossless={"predictor": predictor, "decoded_budget": budget})


def make_cache(budget: float = 0.0, calibrated: bool = False) -> CompressedCache:
    return CompressedCache(lossless(budget), model=model6(), calibration=calibration6() if calibrated else None)



def generate(cache, ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 10)
    with torch.no_grad():
        return model6().generate(ids, cache=cache, do_sample=False, pad_token_id=0, **kwargs)


def step(cache, token: torch.Tensor) -> None:
    """One decode step of ``model6`` on ``cache``."""
    with torch.no_grad():
        model6()(token, cache=cache, use_cache=True)


def prefill(cache, length: int, batch: int = 1) -> torch.Tensor:
    ids = random_ids(batch, length, seed=3)
    with torch.no_grad():
        model6()(ids, cache=cache, use_cache=True)
    return ids


def sealed_blocks(cache) -> int:
    return sum(len(layer.blocks) for layer in cache.kv_layers())


@pytest.mark.parametrize("calibrated", [False, True], ids=["block-stats", "context-calibrated"])
def test_each_step_decodes_every_sealed_block_once(calibrated):
    cache = make_cache(budget=0.0, calibrated=calibrated)
    prefill(cache, 64)
    blocks = sealed_blocks(cache)
    assert blocks == LAYERS * 3  # (64 - 8) // 16 blocks per layer
    assert cache.lossless.decodes == 0  # prefill coded them; nothing was decoded
    for i in range(4):
        before = cache.lossless.decodes
        step(cache, torch.tensor([[5 + i]]))
        # every block read once, nothing re-decoded for the layers above (the chain memo serves them)
        assert cache.lossless.decodes - before == sealed_blocks(cache)


@pytest.mark.parametrize("budget", [0.0, 0.34, 1.0])
def test_pool_stays_within_budget_and_saves_decodes(budget):
    cache = make_cache(budget=budget)
    prefill(cache, 64)
    for i in range(6):
        before = cache.lossless.decodes
        step(cache, torch.tensor([[7 + i]]))
        pool = cache.lossless.pool
        raw = cache.lossless.sealed_raw_bytes
        assert pool.nbytes <= pool.budget(raw)
        decoded_now = cache.lossless.decodes - before
        if budget == 1.0:
            assert decoded_now == 0
        elif budget == 0.0:
            assert decoded_now == sealed_blocks(cache) and pool.nbytes == 0
        else:
            assert 0 < decoded_now < sealed_blocks(cache)
            assert pool.nbytes > 0


@pytest.mark.parametrize("calibrated", [False, True], ids=["block-stats", "context-calibrated"])
def test_held_bytes_match_an_independent_walk_after_a_long_prefill(calibrated):
    cache = make_cache(budget=0.05, calibrated=calibrated)
    prefill(cache, 400)
    stats = cache.stats(per_layer=True)
    walked = walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])  # calibration walked
    assert stats["held_bytes"] == walked, (stats["held_bytes"], walked)
    assert (stats["calibration_bytes"] > 0) == calibrated  # the calibrated predictor holds its heads
    # nothing pins the prefill's residual: what is held is streams + side data + residual + pool (+ ids)
    per_layer_residual = sum(s["residual_bytes"] for s in stats["per_layer"])
    dynamic = 2 * LAYERS * 400 * 2 * 16 * 2  # bytes DynamicCache holds: K and V, 2 heads x 16 dims, bf16
    assert per_layer_residual <= 2 * LAYERS * (RESIDUAL + BLOCK) * 2 * 16 * 2
    assert stats["held_bytes"] - stats["calibration_bytes"] < dynamic  # (a tiny model's heads outweigh its K/V)
    assert stats["decoded_bytes"] <= 0.05 * stats["raw_bytes"] + 2 * LAYERS * BLOCK * 2 * 16 * 2


def test_held_bytes_track_generation_step_by_step():
    cache = make_cache(budget=0.2)
    prefill(cache, 100)
    for i in range(5):
        step(cache, torch.tensor([[9 + i]]))
        walked = walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])
        held = cache.stats()["held_bytes"]
        assert held == walked, (held, walked)


@pytest.mark.parametrize("budget", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("calibrated", [False, True], ids=["block-stats", "context-calibrated"])
def test_greedy_generation_is_identical_to_dynamic_cache(budget, calibrated):
    ids = random_ids(1, 50, seed=5)
    kwargs = {"output_logits": True, "return_dict_in_generate": True, "max_new_tokens": 20}
    expected = generate(DynamicCache(), ids, **kwargs)
    cache = make_cache(budget=budget, calibrated=calibrated)
    got = generate(cache, ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(expected.logits, got.logits):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_beam_search_and_padded_batch_are_identical(budget):
    ids = random_ids(2, 45, seed=4)
    mask = torch.ones_like(ids)
    ids[0, :9] = 0
    mask[0, :9] = 0
    expected = generate(DynamicCache(), ids, attention_mask=mask, num_beams=3)
    got = generate(make_cache(budget=budget, calibrated=True), ids, attention_mask=mask, num_beams=3)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_crop_then_continue_is_identical(budget):
    ids = random_ids(1, 70, seed=6)
    reference = DynamicCache()
    cache = make_cache(budget=budget, calibrated=True)
    with torch.no_grad():
        model6()(ids, cache=reference, use_cache=True)
        model6()(ids, cache=cache, use_cache=True)
    reference.crop(-25)  # 70 -> 45 tokens: reaches into sealed blocks (the residual holds < 24)
    cache.crop(-25)
    assert cache.get_seq_length() == 45
    assert_continues_identically(model6(), reference, cache, random_ids(1, 6, seed=8))
    held = cache.stats()["held_bytes"]
    walked = walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])  # calibration walked
    assert held == walked


def test_defaults_generate_with_block_statistics_and_save_calibrated(tmp_path):
    """Generation codes with block statistics; the default file is calibrated storage where the cache has a
    calibration with its heads (docs/lossless.md "Save / load"), generation's blocks as they are with
    ``predictor="generic"`` (loads adopt them, docs/prefix_store.md)."""
    config = CompressionConfig(mode="lossless")
    assert (config.block_tokens, config.residual_tokens) == (128, 0)
    assert (config.lossless.predictor, config.lossless.save_predictor, config.lossless.coder) == ("generic", "auto", "huff")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=BLOCK), model=model6(),
                            calibration=calibration6())
    assert cache.lossless.predictor.name == "generic" and cache.lossless.depth == 0
    ids = prefill(cache, 40)
    path = cache.save(tmp_path / "g.kvc", predictor="generic")
    header = read_header(path)
    assert header["predictor"]["name"] == "generic" and header["calibration_sha256"] is None
    calibrated = cache.save(tmp_path / "c.kvc")
    header = read_header(calibrated)
    assert header["predictor"]["name"] == CALIBRATED_STORAGE
    assert header["calibration_sha256"] == calibration6().digest
    uncalibrated = CompressedCache(CompressionConfig(mode="lossless", block_tokens=BLOCK), model=model6(),
                                   calibration=None)
    prefill(uncalibrated, 40)
    assert read_header(uncalibrated.save(tmp_path / "u.kvc"))["predictor"]["name"] == "generic"  # nothing changes
    for saved in (path, calibrated):
        loaded = CompressedCache.load(saved, model=model6(), calibration=calibration6())
        for a, b in zip(cache.kv_layers(), loaded.kv_layers()):
            assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
    assert ids.shape == (1, 40)


def test_decoded_budget_is_validated():
    with pytest.raises(ValueError, match="decoded_budget"):
        CompressionConfig(mode="lossless", lossless={"decoded_budget": 1.5})
    with pytest.raises(ValueError, match="decoded_budget"):
        CompressionConfig(mode="lossless", lossless={"decoded_budget": -0.1})


@pytest.mark.parametrize("predictor", ["generic", "context"])
def test_stream_hashes_are_checked_at_a_blocks_first_decode_only(predictor, monkeypatch):
    """Every step decodes every sealed block, but a block's stream hashes are checked only the first time
    (its bytes are immutable since): counted per stream from the kernel's ``verify`` mask."""
    from hf_kvcompress.codec import jit

    calls: list[tuple[int, int]] = []  # per kernel call: (streams checked, streams decoded)
    kernel = jit.decode_streams

    def counted(*args):
        verify, lo, hi = args[-9], args[-2], args[-1]  # ..., checks, verify, out, obase, orun, ohi, olo, err, s_lo, s_hi
        calls.append((int(verify[lo:hi].sum()), hi - lo))
        return kernel(*args)

    monkeypatch.setattr(jit, "decode_streams", counted)
    config = CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                               lossless={"predictor": predictor, "decoded_budget": 0.0, "workers": 1,
                                         "coder": "lanes"})  # counts the lanes kernel's hash checks
    cache = CompressedCache(config, model=model6(), calibration=calibration6())
    prefill(cache, 64)
    per_block = 2 * model6().config.num_key_value_heads  # K and V streams per head, batch 1
    checked = []
    for i in range(3):
        calls.clear()
        before = sealed_blocks(cache)
        step(cache, torch.tensor([[5 + i]]))
        assert sum(n for _, n in calls) == sealed_blocks(cache) * per_block  # every block decoded
        checked.append(sum(c for c, _ in calls))
    assert checked[0] == LAYERS * 3 * per_block  # the first decode of each block checks all its streams
    assert checked[1] == checked[2] == 0 and before == sealed_blocks(cache)  # later steps check none


def generic_after_prefill(budget: float, workers: int) -> tuple[CompressedCache, DynamicCache]:
    """A `generic` lossless cache and a DynamicCache after the same 70-token prefill of ``model6``."""
    config = CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                               lossless={"predictor": "generic", "decoded_budget": budget, "workers": workers})
    cache, reference = CompressedCache(config, model=model6()), DynamicCache()
    ids = random_ids(1, 70, seed=3)
    with torch.no_grad():
        model6()(ids, cache=cache, use_cache=True)
        model6()(ids, cache=reference, use_cache=True)
    return cache, reference


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_generic_blocks_decode_straight_into_the_attention_tensors(budget, monkeypatch):
    """With `generic` (predicted in one batch per layer) every block a step decodes is written by the codec
    straight into the keys / values the layer returns (`LosslessCoding._decode_in_place`), one codec call per
    layer, and the step's output equals DynamicCache's. Blocks held in the pool are copied there, and what the
    pool keeps of an in-place decode is its own copy, never a view that pins the layer's buffer."""
    from hf_kvcompress.cache import coded

    in_place: list[int] = []
    original = coded.LosslessCoding._decode_in_place

    def counted(self, blocks, *args):
        in_place.append(len(blocks))
        return original(self, blocks, *args)

    monkeypatch.setattr(coded.LosslessCoding, "_decode_in_place", counted)
    cache, reference = generic_after_prefill(budget, workers=1)
    for i in range(3):
        if i == 1:  # new blocks (as after a beam step): all of them decode, in place, and the pool takes them
            cache.reorder_cache(torch.tensor([0]))
            reference.reorder_cache(torch.tensor([0]))
        in_place.clear()
        decodes = cache.lossless.decodes
        token = torch.tensor([[7 + i]])
        with torch.no_grad():
            ours = model6()(token, cache=cache, use_cache=True).logits
            theirs = model6()(token, cache=reference, use_cache=True).logits
        assert same_bits(ours, theirs)
        assert sum(in_place) == cache.lossless.decodes - decodes  # every decode of the step, in place
        assert len(in_place) <= LAYERS and ((budget == 1.0 and i != 1) or sum(in_place) > 0)
        if budget == 1.0 and i == 1:
            assert len(cache.lossless.pool.entries) >= sum(in_place)  # (and the blocks sealed this step)
        for t in cache.lossless.decoded_tensors():  # each its own storage: no view of a layer's buffer
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        walked = walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])
        assert cache.stats()["held_bytes"] == walked
    for layer, ref in zip(cache.kv_layers(), reference.layers):
        assert same_bits(layer.keys, ref.keys) and same_bits(layer.values, ref.values)


@pytest.fixture
def torch_one_thread():
    """torch on one thread (as beside a codec that decodes ahead on the other core), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_next_layer_decodes_ahead_on_the_second_codec_thread(monkeypatch, torch_one_thread):
    """With two codec threads, reading layer l starts layer l + 1's decode on the other thread
    (`LosslessCoding._start_ahead`), and layer l + 1's read finishes it: every layer but the first of a step
    comes through it, the step equals DynamicCache's bit for bit, nothing is left running or held between steps,
    and a decode started for blocks that change before their read (rows reordered) is dropped."""
    from hf_kvcompress.cache import coded

    taken: list[int] = []
    original = coded.LosslessCoding._take_ahead

    def counted(self, ahead, *args):
        taken.append(ahead.layer)
        return original(self, ahead, *args)

    monkeypatch.setattr(coded.LosslessCoding, "_take_ahead", counted)
    cache, reference = generic_after_prefill(0.0, workers=2)
    for i in range(3):
        taken.clear()
        decodes, before = cache.lossless.decodes, sealed_blocks(cache)
        token = torch.tensor([[7 + i]])
        with torch.no_grad():
            ours = model6()(token, cache=cache, use_cache=True).logits
            theirs = model6()(token, cache=reference, use_cache=True).logits
        assert same_bits(ours, theirs)
        assert taken == list(range(1, LAYERS))
        assert cache.lossless.decodes - decodes == before  # each block once, ahead or not
        assert cache.lossless._ahead is None and cache.lossless.ahead_bytes() == 0
    # a decode started ahead for blocks that are then replaced: cancelled, and the read decodes the new ones
    cache.lossless._start_ahead(2)
    job = cache.lossless._ahead.job
    cache.reorder_cache(torch.tensor([0]))
    reference.reorder_cache(torch.tensor([0]))
    assert cache.lossless._ahead is None and job._next == len(job._cuts)  # nothing more handed out
    with torch.no_grad():
        ours = model6()(torch.tensor([[11]]), cache=cache, use_cache=True).logits
        theirs = model6()(torch.tensor([[11]]), cache=reference, use_cache=True).logits
    assert same_bits(ours, theirs)
    taken.clear()
    torch.set_num_threads(2)  # torch on both cores of a two-core machine: nothing is decoded ahead
    monkeypatch.setattr(coded, "available_cores", lambda: 2)
    with torch.no_grad():
        model6()(torch.tensor([[12]]), cache=cache, use_cache=True)
    assert taken == []


@pytest.mark.parametrize("coder", ["lanes", "huff"])
@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_corrupt_block_decoded_ahead_fails_at_its_own_layer(where, coder, monkeypatch, torch_one_thread):
    """A damaged stream in a block of layer 3 raises the codec's `CorruptStreamError` when layer 3 reads it:
    a damaged payload from the decode the second codec thread ran ahead, a damaged header (found while layer 2
    starts that decode, which is then not started) from layer 3's own decode. Never swallowed, never another
    layer's values. ``huff`` checks a stream's crc32 before its decode starts: a damaged payload is found as a
    damaged header is."""
    from hf_kvcompress.codec import CorruptStreamError

    config = CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                               lossless={"predictor": "generic", "decoded_budget": 0.0, "workers": 2, "coder": coder})
    cache = CompressedCache(config, model=model6())
    with torch.no_grad():
        model6()(random_ids(1, 70, seed=3), cache=cache, use_cache=True)
    block = cache.kv_layers()[3].blocks[1]
    row = block.rows[0]
    bad = bytearray(row.blobs[2])
    bad[len(bad) // 2 if where == "payload" else 12] ^= 0x10
    row.blobs[2] = bytes(bad)
    block.verified = False  # a block whose bytes were not checked yet (as after a load)
    reached: list[int] = []
    ahead: list[int] = []
    from hf_kvcompress.cache import coded

    read, take = coded.LosslessCoding.read_into, coded.LosslessCoding._take_ahead

    def traced(self, blocks, keys, values):
        reached.append(blocks[0].layer)
        return read(self, blocks, keys, values)

    def taken(self, job, *args):
        ahead.append(job.layer)
        return take(self, job, *args)

    monkeypatch.setattr(coded.LosslessCoding, "read_into", traced)
    monkeypatch.setattr(coded.LosslessCoding, "_take_ahead", taken)
    with pytest.raises(CorruptStreamError), torch.no_grad():
        model6()(torch.tensor([[7]]), cache=cache, use_cache=True)
    assert reached == [0, 1, 2, 3] and ahead == ([1, 2, 3] if where == "payload" and coder == "lanes" else [1, 2])


def test_workers_default_is_every_available_core(monkeypatch):
    """``LosslessConfig.workers=None`` (the default) codes on every core the process may run on; an int
    fixes the count."""
    import os

    from hf_kvcompress.cache import coded

    assert make_cache().lossless.workers == coded.available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert make_cache().lossless.workers == 3
    fixed = CompressionConfig(mode="lossless", lossless={"workers": 1})
    assert CompressedCache(fixed, model=model6()).lossless.workers == 1


@pytest.mark.parametrize("predictor", ["generic", "context"])
def test_codec_threads_change_no_byte(predictor, monkeypatch):
    """``LosslessConfig.workers`` splits a block's streams over codec threads: the same blobs, byte for byte,
    whatever the count, and the same decoded bits. The kernel calls are counted, so the second thread really
    took a share of the streams (a stream range per call)."""
    from hf_kvcompress.codec import jit

    calls: list[tuple[str, int, int]] = []
    for name in ("encode_streams", "decode_streams"):
        kernel = getattr(jit, name)

        def counted(*args, kernel=kernel, name=name):
            calls.append((name, args[-2], args[-1]))
            return kernel(*args)

        monkeypatch.setattr(jit, name, counted)
    caches, blobs = [], []
    for workers in (1, 2):
        config = CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                                   lossless={"predictor": predictor, "decoded_budget": 0.0, "workers": workers,
                                             "coder": "lanes"})  # counts the lanes kernels' calls
        cache = CompressedCache(config, model=model6(), calibration=calibration6())
        prefill(cache, 60, batch=2)
        caches.append(cache)
        blobs.append([row.blobs for layer in cache.kv_layers() for block in layer.blocks for row in block.rows])
    assert blobs[0] == blobs[1] and len(blobs[0]) > 0
    for a, b in zip(caches[0].kv_layers(), caches[1].kv_layers()):
        assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
    # one thread: every call covers its whole batch from stream 0; two: some calls start inside the batch
    for kernel in ("encode_streams", "decode_streams"):
        assert any(name == kernel and lo > 0 for name, lo, _hi in calls), kernel
