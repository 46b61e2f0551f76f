"""Today's formats, pinned: every stream, cache file, calibration and LMCache chunk payload under
tests/fixtures/formats/ written by tests/fixtures/make_fixtures.py decodes bit for bit, and coding the same
inputs again gives the same bytes. A restructuring that changes a byte fails here. Issue 48's formats (``mhuff``,
``grid`` files and chunks; make_grid_fixtures.py's): tests/test_grid_format_fixtures.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import same_bits
from safetensors.torch import load_file

from hf_kvcompress import CompressedCache, codec
from hf_kvcompress.cache.container import frame
from hf_kvcompress.cache.persist import MAGIC
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress.integrations.kv_chunk import HEADER, ChunkCoder
from hf_kvcompress_eval.lossless import layer_kv

FORMATS = Path(__file__).resolve().parent / "fixtures" / "formats"
STREAMS = json.loads((FORMATS / "streams.json").read_text())
CACHES = json.loads((FORMATS / "caches.json").read_text())


@pytest.fixture(scope="module")
def stream_tensors():
    return load_file(str(FORMATS / "streams.safetensors"))


@pytest.fixture(scope="module")
def calibration():
    return Calibration.load(FORMATS / "calibration")


def _inputs(tensors, entry):
    x = tensors[f"{entry['input']}/x"]
    if not entry["model"]:
        return x, None, None
    return x, tensors[f"{entry['input']}/mean"], tensors[f"{entry['input']}/std"]


@pytest.mark.parametrize("entry", STREAMS, ids=[e["name"] for e in STREAMS])
def test_pinned_stream_decodes_bit_exactly_and_recodes_byte_identically(stream_tensors, entry):
    config = CodecConfig(**entry["config"])
    blob = stream_tensors[f"stream/{entry['name']}"].numpy().tobytes()
    x, mean, std = _inputs(stream_tensors, entry)
    assert_stream_pinned(blob, x, mean, std, config, entry.get("batch"))


def assert_stream_pinned(blob: bytes, x, mean, std, config: CodecConfig, batch: int | None) -> None:
    """``blob`` decodes to ``x`` bit for bit and ``x`` codes to ``blob`` byte for byte (``batch``: member ``batch``
    of a batched call's inputs, coded as a batch of one)."""
    if batch is not None:
        x, mean, std = x[batch], mean[batch], std[batch]
        decoded = codec.decode_batch([blob], mean[None], std[None], config)[0]
        assert codec.encode_batch(x[None], mean[None], std[None], config)[0] == blob
    else:
        decoded = codec.decode(blob, mean, std, config=config)
        assert codec.encode(x, mean, std, config) == blob
    assert decoded.dtype == x.dtype and decoded.shape == x.shape
    assert same_bits(decoded, x)


@pytest.mark.parametrize("entry", CACHES, ids=[e["name"] for e in CACHES])
def test_pinned_cache_file_loads_bit_exactly_and_resaves_byte_identically(calibration, entry, tmp_path):
    path = FORMATS / f"{entry['name']}.kvc"
    expected = load_file(str(FORMATS / "caches_kv.safetensors"))
    # no skip on any CPU: the calibrated files hold portable statistics (cache format version 3), written on an
    # AMD EPYC; a machine whose float64 kernels round otherwise must still decode them bit for bit
    cache = CompressedCache.load(path, calibration=calibration if entry["calibration"] else None)
    kv = layer_kv(cache)
    assert len(kv) == 6
    for layer, (k, v) in enumerate(kv):
        assert same_bits(k, expected[f"{entry['name']}/L{layer}/k"])
        assert same_bits(v, expected[f"{entry['name']}/L{layer}/v"])
    again = cache.save(tmp_path / "again.kvc")
    assert again.read_bytes() == path.read_bytes()


#: the ``reproducibility`` the pinned files recorded until 2026-12-07 (written on an AMD EPYC), when every file did
_RECORDED = {"torch": "2.13.0+cpu", "threads": 2, "machine": "x86_64", "processor": "x86_64", "cpu_capability": "AVX512"}


@pytest.mark.parametrize("entry", CACHES, ids=[e["name"] for e in CACHES])
def test_a_file_that_records_its_writers_machine_loads_and_resaves_without_it(calibration, entry, tmp_path):
    """Files written before 2026-12-07 describe the writer's machine in their header whatever the predictor: they
    still load bit for bit, and save again to the pinned bytes, which name no machine (the same on every CPU)."""
    path = FORMATS / f"{entry['name']}.kvc"
    data = path.read_bytes()
    size = int.from_bytes(data[12:16], "little")
    header = json.loads(data[16 : 16 + size])
    assert header["reproducibility"] is None
    older = tmp_path / "older.kvc"
    older.write_bytes(b"".join(frame(MAGIC, header["version"], {**header, "reproducibility": _RECORDED},
                                     data[16 + size : -32])))
    cache = CompressedCache.load(older, calibration=calibration if entry["calibration"] else None)
    expected = load_file(str(FORMATS / "caches_kv.safetensors"))
    for layer, (k, v) in enumerate(layer_kv(cache)):
        assert same_bits(k, expected[f"{entry['name']}/L{layer}/k"])
        assert same_bits(v, expected[f"{entry['name']}/L{layer}/v"])
    assert cache.save(tmp_path / "again.kvc").read_bytes() == data


def test_pinned_calibration_loads_and_its_checksum_holds(calibration):
    assert calibration.predictors == ["context", "none"]
    assert calibration.meta["version"] == 4
    heads = calibration.stream_heads("context", 5)
    assert len(heads) == 2 * calibration.meta["model"]["kv_heads"]


def test_pinned_lmcache_chunks_decode_bit_exactly_and_recode_byte_identically(calibration):
    tensors = load_file(str(FORMATS / "chunks.safetensors"))
    chunk = tensors["chunk/input"]
    _, layers, _, _ = chunk.shape
    kv_heads = calibration.meta["model"]["kv_heads"]
    plain = ChunkCoder(layers=layers, kv_heads=kv_heads, head_dim=calibration.meta["model"]["head_dim"])
    calibrated = ChunkCoder(calibration)
    for name, coder, kwargs in (("plain", plain, {}), ("calibrated", calibrated, {"first_position": 0})):
        payload = tensors[f"chunk/{name}"].numpy().tobytes()
        decoded = coder.decode(payload)  # portable statistics (chunk format version 2): decodes on every CPU
        assert same_bits(decoded, chunk)
        again = coder.encode(chunk, **kwargs)  # version 3 (the grid mode added); these modes' bytes unchanged
        assert payload[8] == 2 and again[8] == 3
        assert again[:8] + again[9 : HEADER.size - 4] + again[HEADER.size :] == \
            payload[:8] + payload[9 : HEADER.size - 4] + payload[HEADER.size :]


def test_stream_scale_factors_are_the_correctly_rounded_quarter_octaves():
    """Every stream's std is multiplied by ``scale_factor(code)``; written-out constants (no libm ``pow``, whose last
    bit may differ between C libraries) that must be ``2 ** (code / 4)`` correctly rounded, checked exactly for every
    code: the factor's rounding interval holds the fourth root of ``2 ** code``."""
    from fractions import Fraction

    from hf_kvcompress.blockcoder import SCALE_MAX, SCALE_MIN, scale_factor

    for code in range(SCALE_MIN, SCALE_MAX + 1):
        factor = scale_factor(code)
        half_ulp = Fraction(math.ulp(factor)) / 2
        assert (Fraction(factor) - half_ulp) ** 4 < Fraction(2) ** code < (Fraction(factor) + half_ulp) ** 4, code

