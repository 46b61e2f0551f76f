"""Issue 48's formats, pinned: the ``mhuff`` streams, the ``below`` calibration, the ``grid`` cache file and the
LMCache grid chunk payload under tests/fixtures/formats/ (written by tests/fixtures/make_grid_fixtures.py) decode
bit for bit, and coding the same inputs again gives the same bytes. A restructuring that changes a byte fails here;
tests/test_format_fixtures.py does the same for the older formats. mhuff stream version 2 (``_v2`` files) is what
the coder writes; version 1's files still decode bit for bit, their streams recode with version 1's spec, and a
version 1 grid file saves again as the version 2 file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import same_bits
from safetensors.torch import load_file
from test_format_fixtures import assert_stream_pinned

from hf_kvcompress import CompressedCache, CompressionConfig, codec
from hf_kvcompress.cache.persist import read_header
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress.codec.huff_coder import huff, mhuff
from hf_kvcompress.integrations import kv_chunk
from hf_kvcompress.integrations.kv_chunk import MODE_GRID, ChunkCoder, parse_header
from hf_kvcompress.predictors.registry import CALIBRATED_STORAGE
from hf_kvcompress_eval.lossless import layer_kv

FORMATS = Path(__file__).resolve().parent / "fixtures" / "formats"
#: (suffix, entry) of every pinned mhuff stream, version 1 ("") and 2 ("_v2")
STREAMS = [(suffix, e) for suffix in ("", "_v2")
           for e in json.loads((FORMATS / f"mhuff_streams{suffix}.json").read_text())]
#: the grid file's configuration (make_grid_fixtures.CACHE_CONFIG)
CACHE_CONFIG = CompressionConfig(mode="lossless", block_tokens=16)


@pytest.fixture(scope="module")
def stream_tensors():
    """The pinned inputs (streams.safetensors, make_fixtures.py's) with the mhuff streams and spreads per element."""
    return {**load_file(str(FORMATS / "streams.safetensors")),
            **{f"{suffix}{name}": t for suffix in ("", "_v2")
               for name, t in load_file(str(FORMATS / f"mhuff_streams{suffix}.safetensors")).items()}}


@pytest.fixture(scope="module")
def calibration():
    return Calibration.load(FORMATS / "calibration_below")


@pytest.fixture(scope="module")
def grid_kv():
    tensors = load_file(str(FORMATS / "grid_kv.safetensors"))
    return [(tensors[f"L{layer}/k"], tensors[f"L{layer}/v"]) for layer in range(len(tensors) // 2)]


@pytest.mark.parametrize(("suffix", "entry"), STREAMS, ids=[f"{e['name']}{suffix}" for suffix, e in STREAMS])
def test_pinned_mhuff_stream_decodes_bit_exactly_and_recodes_byte_identically(stream_tensors, suffix, entry):
    config = CodecConfig(**entry["config"])
    assert config.coder == "mhuff"
    blob = stream_tensors[f"{suffix}stream/{entry['name']}"].numpy().tobytes()
    x = stream_tensors[f"{entry['input']}/x"]
    mean, std = {"plain": (None, None),
                 "model": (stream_tensors.get(f"{entry['input']}/mean"), stream_tensors.get(f"{entry['input']}/std")),
                 "element": (stream_tensors.get(f"{entry['input']}/mean"),
                             stream_tensors.get(f"{entry['input']}/element_std"))}[entry["stats"]]
    if suffix:  # version 2: what the coder writes
        assert blob[:3] == mhuff.MAGIC
        assert_stream_pinned(blob, x, mean, std, config, entry.get("batch"))
        return
    assert blob[:3] == mhuff.MAGIC_V1  # version 1: decodes; its spec codes the same bytes again
    if entry.get("batch") is not None:
        x, mean, std = (t[entry["batch"]][None] for t in (x, mean, std))
        assert huff.encode_family(x, mean, std, mhuff.SPEC_V1) == [blob]
        decoded = codec.decode_batch([blob], mean, std, config)[0]
        x = x[0]
    else:
        mean1, std1 = (None if t is None else t[None] for t in (mean, std))
        assert huff.encode_family(x[None], mean1, std1, mhuff.SPEC_V1) == [blob]
        decoded = codec.decode(blob, mean, std, config=config)
    assert decoded.dtype == x.dtype and same_bits(decoded, x)


def test_pinned_mhuff_streams_hold_special_values(stream_tensors):
    """What the streams pin includes NaN payloads, infinities, -0.0 and subnormals (make_fixtures.special_values)."""
    for name in ("bf16", "fp16"):
        bits = stream_tensors[f"{name}/x"].view(-1)[7:19]
        assert bits.isnan().sum() == 4 and bits.isinf().sum() == 2 and (bits == 0).sum() == 2


def test_pinned_below_calibration_loads_and_is_the_grid_files(calibration):
    assert calibration.predictors == ["below"]
    heads = calibration.stream_heads("below", 5)
    assert len(heads) == 2 * calibration.meta["model"]["kv_heads"]
    assert read_header(FORMATS / "grid.kvc")["calibration_sha256"] == calibration.digest


@pytest.mark.parametrize("name", ["grid", "grid_v2"])
def test_pinned_grid_cache_file_loads_bit_exactly_and_saves_byte_identically(calibration, grid_kv, tmp_path, name):
    """Either stream version loads; a save writes version 2, the same bytes as the pinned version 2 file."""
    path = FORMATS / f"{name}.kvc"
    header = read_header(path)
    assert header["predictor"]["name"] == CALIBRATED_STORAGE == "grid" and header["version"] == 3
    cache = CompressedCache.load(path, calibration=calibration)
    kv = layer_kv(cache)
    assert len(kv) == len(grid_kv) == 6
    for (k, v), (k0, v0) in zip(kv, grid_kv, strict=True):
        assert same_bits(k, k0) and same_bits(v, v0)
    assert any(k.isnan().any() or v.isinf().any() for k, v in kv)  # the special values written over layers 1, 3
    pinned = (FORMATS / "grid_v2.kvc").read_bytes()
    assert (path.read_bytes() == pinned) == (name == "grid_v2")
    assert cache.save(tmp_path / "again.kvc").read_bytes() == pinned
    fresh = CompressedCache(CACHE_CONFIG, calibration=calibration)  # the writer's way: model-free, filled by update
    for layer, (k, v) in enumerate(grid_kv):
        fresh.update(k, v, layer)
    assert fresh.save(tmp_path / "fresh.kvc").read_bytes() == pinned


@pytest.mark.parametrize("name", ["grid_chunks", "grid_chunks_v2"])
def test_pinned_grid_chunk_decodes_bit_exactly_and_recodes_byte_identically(calibration, name):
    """Either stream version decodes; an encode writes version 2, the pinned version 2 payload's bytes."""
    tensors = load_file(str(FORMATS / f"{name}.safetensors"))
    chunk, payload = tensors["chunk/input"], tensors["chunk/grid"].numpy().tobytes()
    pinned = load_file(str(FORMATS / "grid_chunks_v2.safetensors"))["chunk/grid"].numpy().tobytes()
    assert (payload == pinned) == (name == "grid_chunks_v2")
    assert chunk.isnan().any() and chunk.isinf().any()  # the grid K/V's first tokens, special values included
    assert parse_header(payload).mode == MODE_GRID and payload[8] == kv_chunk.VERSION == 3
    coder = ChunkCoder(calibration)
    assert same_bits(coder.decode(payload), chunk)
    assert coder.encode(chunk, first_position=0) == pinned
