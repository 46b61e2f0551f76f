"""CompressedCache inside generate(): exact modes must give DynamicCache's tokens, whatever the decoding."""

from __future__ import annotations

import pytest
import torch
from cache_file_testutil import reseal, split
from helpers import fresh_tiny_model, hybrid_model, random_ids, same_bits, tiny_model
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig

EXACT_MODES = ["none", "lossless"]


def small_blocks(mode: str) -> CompressionConfig:
    # tiny blocks so prompts and generations seal many blocks
    return CompressionConfig(mode=mode, block_tokens=8, residual_tokens=4)


def generate(model, ids, cache, **kwargs):
    kwargs.setdefault("max_new_tokens", 12)
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, cache=cache, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_greedy_matches_dynamic_cache(tiny, mode):
    ids = random_ids(1, 37)
    expected = generate(tiny, ids, DynamicCache())
    cache = CompressedCache(small_blocks(mode))
    got = generate(tiny, ids, cache)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == got.shape[1] - 1
    assert len(cache.layers[0].blocks) >= 4


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_greedy_logits_match_bit_for_bit(tiny, mode):
    ids = random_ids(1, 29)
    kwargs = {"output_logits": True, "return_dict_in_generate": True, "max_new_tokens": 8}
    expected = generate(tiny, ids, DynamicCache(), **kwargs)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), **kwargs)
    for a, b in zip(expected.logits, got.logits):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_past_key_values_keyword_still_works(mode):
    model = tiny_model("llama-gqa")
    ids = random_ids(1, 20)
    expected = generate(model, ids, DynamicCache())
    with torch.no_grad(), pytest.warns(FutureWarning):
        got = model.generate(
            ids, past_key_values=CompressedCache(small_blocks(mode)), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_sampling_matches_dynamic_cache(tiny, mode):
    ids = random_ids(1, 25)
    torch.manual_seed(123)
    expected = generate(tiny, ids, DynamicCache(), do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(123)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), do_sample=True, top_k=20, temperature=0.9)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_beam_search_matches_dynamic_cache(tiny, mode):
    ids = random_ids(1, 30, seed=3)
    kwargs = {"num_beams": 3, "max_new_tokens": 10}
    expected = generate(tiny, ids, DynamicCache(), **kwargs)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_left_padded_batch_matches_dynamic_cache(tiny, mode):
    ids = random_ids(2, 26, seed=5)
    mask = torch.ones_like(ids)
    ids[1, :9] = 0
    mask[1, :9] = 0
    expected = generate(tiny, ids, DynamicCache(), attention_mask=mask)
    got = generate(tiny, ids, CompressedCache(small_blocks(mode)), attention_mask=mask)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_crop_then_continue(tiny, mode):
    ids = random_ids(1, 33, seed=7)
    runs = []
    for cache in (DynamicCache(), CompressedCache(small_blocks(mode))):
        first = generate(tiny, ids, cache, max_new_tokens=10)
        # drop the last 9 cached tokens (reaching into sealed blocks), then continue from the shorter text
        cache.crop(-9)
        kept = first[:, : cache.get_seq_length() + 1]
        runs.append(generate(tiny, kept, cache, max_new_tokens=10))
    assert cache.get_seq_length() == runs[1].shape[1] - 1
    assert torch.equal(runs[0], runs[1])


def test_batch_repeat_and_select_match_dynamic_layer():
    ids = random_ids(2, 21)
    model = tiny_model("llama-gqa")
    caches = [DynamicCache(), CompressedCache(small_blocks("none"))]
    with torch.no_grad():
        for cache in caches:
            model(ids, cache=cache)
    for cache in caches:
        cache.batch_repeat_interleave(3)
    for cache in caches:
        cache.batch_select_indices(torch.tensor([5, 0, 2]))
    for layer in range(2):
        assert torch.equal(caches[0].layers[layer].keys, caches[1].layers[layer].keys)
        assert torch.equal(caches[0].layers[layer].values, caches[1].layers[layer].values)


def test_mask_sizes_seq_length_and_reset():
    model = tiny_model("llama-gqa")
    cache = CompressedCache(small_blocks("none"))
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        model(random_ids(1, 30), cache=cache)
    assert cache.get_seq_length() == 30
    assert cache.get_mask_sizes(1, 0) == (31, 0)
    assert cache.layers[0].entries == 30
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.layers[0].keys is None


def test_keys_and_values_are_writable_like_dynamic_layer():
    model = tiny_model("llama-gqa")
    cache = CompressedCache(small_blocks("none"))
    with torch.no_grad():
        model(random_ids(1, 30), cache=cache)
    layer = cache.layers[0]
    keys, values = layer.keys, layer.values
    assert keys.shape == (1, 2, 30, 16)
    # a press-style tool keeps every other token
    layer.keys = keys[:, :, ::2]
    layer.values = values[:, :, ::2]
    assert torch.equal(layer.keys, keys[:, :, ::2])
    assert torch.equal(layer.values, values[:, :, ::2])
    assert layer.get_seq_length() == 15


def test_stats_report_sizes():
    model = tiny_model("llama-gqa")
    cache = CompressedCache(small_blocks("none"))
    with torch.no_grad():
        model(random_ids(1, 30), cache=cache)
    stats = cache.stats()
    for key in ("mode", "tokens", "raw_bytes", "stored_bytes", "bits_per_scalar", "compression_ratio"):
        assert key in stats
    expected_raw = 2 * 2 * (1 * 2 * 30 * 16) * 4  # layers * (k, v) * scalars * float32 bytes
    assert stats["raw_bytes"] == expected_raw
    assert stats["stored_bytes"] == expected_raw
    assert stats["bits_per_scalar"] == 32.0
    assert stats["compression_ratio"] == 1.0
    assert stats["tokens"] == 30


@pytest.mark.parametrize("mode", EXACT_MODES)
def test_row_selection_is_consistent_across_kv_blocks_and_token_ids(mode):
    """Indices and bool masks select the same rows of K/V (sealed blocks and residual) and token ids, as
    DynamicCache does; a bool mask to reorder_cache (which DynamicCache refuses) or of the wrong length
    is refused and leaves the cache as it was."""
    model = tiny_model("llama-gqa")
    ids = random_ids(3, 21, seed=3)
    cache, reference = CompressedCache(small_blocks(mode), model=model), DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids, cache=reference)
    assert cache.layers[0].blocks

    def same(rows):
        for layer, ref in zip(cache.kv_layers(), reference.layers):
            assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
        assert torch.equal(cache.token_ids, ids[rows])

    for bad, error in [(torch.tensor([True, False, True]), TypeError), (torch.tensor([0, 3]), IndexError)]:
        with pytest.raises(error):
            cache.reorder_cache(bad)
    with pytest.raises(IndexError, match="bool mask of 2 entries"):
        cache.batch_select_indices(torch.tensor([True, False]))
    same([0, 1, 2])
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    reference.reorder_cache(torch.tensor([2, 0, 0]))
    same([2, 0, 0])
    mask = torch.tensor([False, True, True])
    cache.batch_select_indices(mask)
    reference.batch_select_indices(mask)
    same([0, 0])


# ------------------------------------------------------------------ a failed step leaves the cache as it was

STEP_LAYERS = 6  # the damaged layer in the middle: the layers below it have appended the step's token
STEP_CONFIG = CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=4)
DAMAGED = 3


@pytest.fixture(scope="module")
def step_model():
    return fresh_tiny_model("llama-gqa", torch.bfloat16, layers=STEP_LAYERS)


def _saved(model, tmp_path, *, damage: bool):
    """A 45-token lossless cache saved with generation's blocks (two a layer); ``damage``: layer `DAMAGED`'s second
    block has a stream edited behind a recomputed checksum (what ``verify=False`` does not look at)."""
    ids = random_ids(1, 45, seed=3)
    cache = CompressedCache(STEP_CONFIG, model=model, calibration=None)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    data = cache.save(tmp_path / "g.kvc", predictor="generic").read_bytes()
    if damage:
        header, payload = split(data)
        offset, length = header["layers"][DAMAGED]["blocks"][1]["rows"][0]["streams"][2]
        edited = bytearray(data)
        edited[len(data) - 32 - len(payload) + offset + length - 3] ^= 0x40  # inside the coded body
        data = reseal(bytes(edited))
    path = tmp_path / ("damaged.kvc" if damage else "intact.kvc")
    path.write_bytes(data)
    return ids, path


def _state(cache) -> list:
    """Everything a step changes, per layer: blocks (by identity), residual K/V (bits), lengths; and the cache's
    token ids, decoded pool and stats."""
    layers = [(list(layer.blocks), list(layer.block_starts), layer.residual_keys.clone(),
               layer.residual_values.clone(), layer.seen_tokens) for layer in cache.kv_layers()]
    coding = cache.lossless
    return [layers, cache.token_ids.clone(), dict(coding.pool.entries), coding.pool.nbytes,
            coding.pool.sealed_raw_bytes, cache.stats()]


def _assert_same_state(cache, before: list) -> None:
    now = _state(cache)
    for (blocks, starts, keys, values, seen), (blocks2, starts2, keys2, values2, seen2) in zip(before[0], now[0]):
        assert all(a is b for a, b in zip(blocks, blocks2)) and len(blocks) == len(blocks2)
        assert starts == starts2 and seen == seen2
        assert same_bits(keys, keys2) and same_bits(values, values2)
    assert torch.equal(before[1], now[1])
    assert before[2].keys() == now[2].keys() and all(before[2][k][0] is now[2][k][0] for k in before[2])
    assert before[3:] == now[3:]


def test_a_failed_step_leaves_the_cache_as_it_was_and_a_retry_fails_the_same_way(step_model, tmp_path):
    """A damaged stream in a middle layer fails the first decode step after the layers below it appended its
    token: every layer, the token ids and the decoded pool are as before the step, and a retry raises the same
    error (not one about positions)."""
    from hf_kvcompress.codec import CorruptStreamError

    ids, path = _saved(step_model, tmp_path, damage=True)
    cache = CompressedCache.load(path, model=step_model, verify=False)
    for index, layer in enumerate(cache.kv_layers()):  # the intact layers read as prefilled
        if index != DAMAGED:
            assert layer.keys.shape[-2] == 45
    before = _state(cache)
    more = torch.cat([ids, random_ids(1, 1, seed=5)], dim=1)
    for _ in range(2):
        with pytest.raises(CorruptStreamError):
            generate(step_model, more, cache, max_new_tokens=3)
        _assert_same_state(cache, before)
        assert [layer.seen_tokens for layer in cache.kv_layers()] == [45] * STEP_LAYERS


def test_a_retry_after_a_transient_read_failure_generates_dynamic_caches_tokens(step_model, tmp_path, monkeypatch):
    """The middle layer's block read fails once (injected): the retry of the same generate() gives exactly
    DynamicCache's tokens."""
    from hf_kvcompress.cache.coded import LosslessCoding
    from hf_kvcompress.codec import CorruptStreamError

    ids, path = _saved(step_model, tmp_path, damage=False)
    cache = CompressedCache.load(path, model=step_model, verify=False)
    more = torch.cat([ids, random_ids(1, 1, seed=5)], dim=1)
    reference = DynamicCache(config=step_model.config)
    with torch.no_grad():
        step_model(ids, cache=reference, use_cache=True)
    expected = generate(step_model, more, reference, max_new_tokens=6)
    original, failures = LosslessCoding.read_into, []

    def fails_once(self, blocks, keys, values):
        if blocks and blocks[0].layer == DAMAGED and not failures:
            failures.append(blocks[0].layer)
            raise CorruptStreamError("injected: a transient read failure")
        return original(self, blocks, keys, values)

    monkeypatch.setattr(LosslessCoding, "read_into", fails_once)
    before = _state(cache)
    with pytest.raises(CorruptStreamError, match="injected"):
        generate(step_model, more, cache, max_new_tokens=6)
    assert failures == [DAMAGED]
    _assert_same_state(cache, before)
    got = generate(step_model, more, cache, max_new_tokens=6)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == got.shape[1] - 1


def test_without_a_model_no_checkpoint_outlives_its_step():
    """A cache without a model (no forward hook says when a step ends) ends each step at its top layer's update:
    the K/V tensors a step replaced are freed then, not pinned until the next step (where `stats` would not
    count them)."""
    import gc
    import weakref

    cache = CompressedCache(STEP_CONFIG, calibration=None)
    kv = [(torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)) for _ in range(STEP_LAYERS)]
    for step in range(3):  # the first step learns the top layer; later ones end at it
        replaced = [weakref.ref(layer.residual_keys) for layer in cache.kv_layers()]
        for index, (k, v) in enumerate(kv):
            cache.update(k[:, :, : 7 if step == 0 else 1], v[:, :, : 7 if step == 0 else 1], index)
        gc.collect()
        if step >= 2:
            assert cache._step is None
            assert [ref() is None for ref in replaced] == [True] * STEP_LAYERS


def test_a_failed_step_of_a_hybrid_model_refuses_to_continue_until_reset(monkeypatch):
    """Recurrent / convolution states advance in place (transformers' layers) and cannot be put back: after a
    failed step the cache refuses its next update, naming reset(); after reset() it generates DynamicCache's
    tokens again."""
    from hf_kvcompress.cache.coded import LosslessCoding

    model = hybrid_model("lfm2")
    config = CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=4)
    ids = random_ids(1, 30, seed=4)
    cache = CompressedCache(config, model=model, calibration=None)
    original, failures = LosslessCoding.read_into, []

    def fails_once(self, blocks, keys, values):
        if blocks and not failures:
            failures.append(blocks[0].layer)
            raise MemoryError("injected")
        return original(self, blocks, keys, values)

    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        monkeypatch.setattr(LosslessCoding, "read_into", fails_once)
        with pytest.raises(MemoryError):
            model(random_ids(1, 1, seed=6), cache=cache, use_cache=True)
        assert failures
        with pytest.raises(RuntimeError, match="reset"):
            model(random_ids(1, 1, seed=6), cache=cache, use_cache=True)
    cache.reset()
    expected = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=4)
    assert torch.equal(generate(model, ids, cache, max_new_tokens=4), expected)
