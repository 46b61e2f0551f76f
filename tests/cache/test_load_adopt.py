"""`CompressedCache.load` adopts blocks coded as generation codes them: checked, not decoded, decoded at first read."""

from __future__ import annotations

import pytest
import torch
from cache_file_testutil import reseal, split
from helpers import assert_continues_identically, fresh_tiny_model, random_ids, same_bits
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.blockcodec import BlockCodec, CodedBlock
from hf_kvcompress.codec import CorruptStreamError
from hf_kvcompress.errors import CacheFileError

LAYERS = 6  # a per-layer cost (a decode, an encode) must not hide behind two layers
CONFIG = CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=4)
TOKENS = 45  # (45 - 4) // 16 = 2 blocks sealed in generation, 13 residual tokens; the file holds 3 blocks


@pytest.fixture(scope="module")
def model():
    return fresh_tiny_model("llama-gqa", torch.bfloat16, layers=LAYERS)


def filled(model, config=CONFIG, tokens=TOKENS):
    ids = random_ids(1, tokens, seed=3)
    cache = CompressedCache(config, model=model, calibration=None)
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(ids, cache=reference, use_cache=True)
    return cache, reference


def count_encodes(monkeypatch) -> dict[str, int]:
    """Blocks coded from now on (`BlockCodec.encode_blocks`, which `encode_block` and a layer's seal go through)."""
    counts = {"encodes": 0}
    original = BlockCodec.encode_blocks

    def counting(self, *args, **kwargs):
        blocks = original(self, *args, **kwargs)
        counts["encodes"] += len(blocks)
        return blocks

    monkeypatch.setattr(BlockCodec, "encode_blocks", counting)
    return counts


def test_generic_file_blocks_are_adopted_without_decoding_or_encoding(model, tmp_path, monkeypatch):
    cache, reference = filled(model)
    path = cache.save(tmp_path / "g.kvc", predictor="generic")
    counts = count_encodes(monkeypatch)
    loaded = CompressedCache.load(path, model=model, verify=False)
    # taken as they are; layer 0's two blocks decoded once: its keys bind the file to its ids and the model
    assert loaded.lossless.decodes == 2 and counts["encodes"] == 0
    for index, (mine, theirs) in enumerate(zip(loaded.kv_layers(), cache.kv_layers())):
        assert len(mine.blocks) == 2 and mine.block_starts == [0, 16] and mine.residual_length == TOKENS - 32
        assert all(isinstance(b, CodedBlock) and b.device.type == "cpu" and b.verified == (index == 0)
                   for b in mine.blocks)
        # the same streams generation coded
        assert [r.blobs for b in mine.blocks for r in b.rows] == [r.blobs for b in theirs.blocks for r in b.rows]
    stats = loaded.stats()
    assert stats["stored_bytes"] == cache.stats()["stored_bytes"]
    # decoded at the first read, exactly; generation goes on as with DynamicCache
    for mine, ref in zip(loaded.kv_layers(), reference.layers):
        assert same_bits(mine.keys, ref.keys) and same_bits(mine.values, ref.values)
    assert loaded.lossless.decodes == 2 + 2 * 2 * LAYERS  # .keys and .values each decode both blocks (budget 0)
    assert_continues_identically(model, reference, loaded, random_ids(1, 20, seed=4))


def test_files_of_other_coding_are_decoded_and_coded_again(model, tmp_path, monkeypatch):
    cache, reference = filled(model)
    other = CompressionConfig(mode="lossless", block_tokens=32, residual_tokens=0)
    for path, config in ((cache.save(tmp_path / "c.kvc", predictor="context"), None),  # another predictor
                         (cache.save(tmp_path / "g.kvc", predictor="generic"), other)):  # other block sizes
        counts = count_encodes(monkeypatch)
        loaded = CompressedCache.load(path, model=model, config=config)
        assert counts["encodes"] == LAYERS * len(loaded.kv_layers()[0].blocks) > 0  # decoded (the file's own
        # coder counts those) and coded again by the cache
        for mine, ref in zip(loaded.kv_layers(), reference.layers):
            assert same_bits(mine.keys, ref.keys) and same_bits(mine.values, ref.values)
        monkeypatch.undo()


def test_a_stream_edited_behind_the_checksum_fails_at_first_read_or_in_load_with_verify(model, tmp_path):
    cache, _ = filled(model)
    data = cache.save(tmp_path / "g.kvc", predictor="generic").read_bytes()
    header, payload = split(data)
    offset, length = header["layers"][3]["blocks"][1]["rows"][0]["streams"][2]
    base = len(data) - 32 - len(payload)
    damaged = bytearray(data)
    damaged[base + offset + length - 3] ^= 0x40  # inside the coded body, not its header
    path = tmp_path / "edited.kvc"
    path.write_bytes(reseal(bytes(damaged)))
    with pytest.raises(CacheFileError, match="stream"):
        CompressedCache.load(path, model=model, verify=True)
    with pytest.raises(CacheFileError, match="stream"):  # the default with a model: generation follows
        CompressedCache.load(path, model=model)
    loaded = CompressedCache.load(path, model=model, verify=False)  # checked (structure, checksum), not decoded
    with pytest.raises(CorruptStreamError):
        for layer in loaded.kv_layers():
            layer.keys  # noqa: B018 - the read is the point


def test_load_of_a_generic_file_is_cheaper_than_the_prefill_in_decodes(model, tmp_path):
    """Work counted, not seconds: a 6-layer cache of 8 blocks a layer loads with layer 0's blocks decoded (the
    binding to its ids and the model), no other, with ``verify=False``; by default (a model given) every block
    once more, to check its streams."""
    cache, _ = filled(model, CompressionConfig(mode="lossless", block_tokens=16), tokens=8 * 16)
    path = cache.save(tmp_path / "g.kvc", predictor="generic")
    loaded = CompressedCache.load(path, model=model, verify=False)
    assert loaded.lossless.decodes == 8
    assert CompressedCache.load(path, model=model).lossless.decodes == 8 + 8 * LAYERS
    assert sum(len(layer.blocks) for layer in loaded.kv_layers()) == 8 * LAYERS


def test_a_generic_save_writes_the_caches_own_streams(model, tmp_path, monkeypatch):
    """Full blocks go to the file as generation coded them (no decode, no encode); only the residual is coded.
    The bytes are those of a save that decodes and codes every token again."""
    import hf_kvcompress.cache.files as files

    cache, _ = filled(model)
    decodes = cache.lossless.decodes
    counts = count_encodes(monkeypatch)
    fast = cache.save(tmp_path / "fast.kvc", predictor="generic").read_bytes()
    assert cache.lossless.decodes == decodes  # nothing decoded
    assert counts["encodes"] == LAYERS  # one residual block per layer (13 tokens), the 2 sealed blocks taken
    monkeypatch.setattr(files, "_generation_blocks", lambda *args: None)
    slow = cache.save(tmp_path / "slow.kvc", predictor="generic").read_bytes()
    assert counts["encodes"] == LAYERS + 3 * LAYERS and cache.lossless.decodes > decodes
    assert fast == slow


def test_saves_keep_generations_coder_or_code_for_size(model, tmp_path, monkeypatch):
    """A cache generating with ``huff`` (the default): a save with generation's predictor keeps its ``huff`` blocks
    (adopted at load, a ``lanes`` cache's likewise); a save that codes every token again (``self``) writes ``lanes``
    streams, which load bit for bit, and the loaded cache generates with its config's coder."""
    from hf_kvcompress.codec import coder_of_stream

    def coders(cache_or_blocks) -> set[str]:
        return {coder_of_stream(blob).name for layer in cache_or_blocks.kv_layers() for block in layer.blocks
                for row in block.rows for blob in row.blobs}

    cache, reference = filled(model)
    assert cache.config.lossless.coder == "huff" and coders(cache) == {"huff"}
    kept = CompressedCache.load(cache.save(tmp_path / "g.kvc", predictor="generic"), model=model, verify=False)
    # adopted as they are; layer 0's two blocks decoded once: its keys bind the file to its ids and the model
    assert kept.lossless.decodes == 2 and coders(kept) == {"huff"}
    again = CompressedCache.load(cache.save(tmp_path / "s.kvc", predictor="self"), model=model)
    assert again.config.lossless.coder == "huff" and coders(again) == {"huff"}  # re-sealed as it generates
    for loaded in (kept, again):
        for mine, theirs in zip(loaded.kv_layers(), reference.layers):
            assert same_bits(mine.keys, theirs.keys) and same_bits(mine.values, theirs.values)
    counts = {"lanes": 0}
    from hf_kvcompress.codec.lanes_coder import lanes

    original = lanes.decode_batch_impl

    def counting(*args, **kwargs):
        counts["lanes"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(lanes, "decode_batch_impl", counting)
    path = cache.save(tmp_path / "s2.kvc", predictor="self")
    CompressedCache.load(path, model=model, verify=True)
    assert counts["lanes"] > 0  # the re-coded file's streams are lanes'
    lanes_cache, _ = filled(model, CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=4,
                                                     lossless={"coder": "lanes"}))
    adopted = CompressedCache.load(lanes_cache.save(tmp_path / "l.kvc", predictor="generic"), model=model,
                                   verify=False)
    assert adopted.lossless.decodes == 2 and coders(adopted) == {"lanes"}
