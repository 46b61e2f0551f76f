"""The lossless serde through LMCache's own machinery: the registry, `create_serde_processor`, the
`SerdeL2AdapterWrapper` over an L2 adapter, LMCache's ``--l2-adapter`` parser and its 0.5.6 ``fs`` adapter.

Needs the optional ``lmcache`` install (docs/lmcache.md); skipped cleanly without it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lmcache.v1.distributed.serde", reason="LMCache is not installed (extra: lmcache)")
pytestmark = pytest.mark.lmcache

from chunk_testutil import SMOLLM2_SHAPE, channel_chunk, model_chunks, tiny_calibrated  # noqa: E402
from helpers import same_bits  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry  # noqa: E402
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper  # noqa: E402
from lmcache.v1.distributed.serde import (  # noqa: E402
    SerdeConfig,
    create_serde_processor,
    get_registered_serde_types,
    serialized_layout_desc,
)
from lmcache_testutil import (  # noqa: E402
    VariableSizeL2Adapter,
    key,
    l1_manager,
    memory_objs,
    wait_for,
    wait_load,
    wait_store,
)

from hf_kvcompress.integrations.kv_chunk import HEADER, ChunkError  # noqa: E402
from hf_kvcompress.integrations.lmcache import SERDE_NAME, adapter_spec, coder_from_kwargs, register  # noqa: E402

SMOLLM2_KWARGS = {"layers": 30, "kv_heads": 3, "head_dim": 64, "rope_theta": 100000.0}


@pytest.fixture
def l1():
    manager = l1_manager()
    yield manager
    manager.close()


def serde_round_trip(l1, kwargs: dict, chunks: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[bool]]:
    """Serialize ``chunks`` and deserialize them again through `create_serde_processor`'s processor.
    Returns the decoded chunks, the serialized sizes and the two task results (serialize, deserialize)."""
    serde = create_serde_processor(SerdeConfig(type=SERDE_NAME, kwargs=kwargs))
    try:
        shape, dtype = chunks[0].shape, chunks[0].dtype
        keys = [key(i) for i in range(len(chunks))]
        src = memory_objs(l1, keys, shape, dtype, tag="src")
        for obj, chunk in zip(src, chunks):
            obj.tensor.copy_(chunk)
        layout = serialized_layout_desc(MemoryLayoutDesc([shape], [dtype]), serde)
        assert layout.shapes[0][0] == HEADER.size + chunks[0].numel() * 2  # the size bound
        temp_keys = [key(100 + i) for i in range(len(chunks))]
        temps = l1.reserve_write(temp_keys, [True] * len(chunks), layout, tag="temp")
        temps = [temps[k][1] for k in temp_keys]
        task = serde.submit_serialize(src, temps, keys)
        stored = wait_for(lambda: serde.query_serialize_result(task), "serialize")
        sizes = [t.get_size() for t in temps]
        dst = memory_objs(l1, [key(200 + i) for i in range(len(chunks))], shape, dtype, tag="dst")
        for obj in dst:
            obj.tensor.fill_(0)
        task = serde.submit_deserialize(temps, dst, keys)
        loaded = wait_for(lambda: serde.query_deserialize_result(task), "deserialize")
        return [obj.tensor.clone() for obj in dst], sizes, [stored, loaded]
    finally:
        serde.close()


def test_the_serde_is_registered_once():
    assert SERDE_NAME in get_registered_serde_types()
    register()  # importing twice (or calling register again) must not raise "already registered"
    assert get_registered_serde_types().count(SERDE_NAME) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_processor_round_trips_random_chunks(l1, dtype):
    chunks = [channel_chunk((2, 4, 64, 32), dtype, seed=s) for s in range(3)]
    decoded, sizes, ok = serde_round_trip(l1, {}, chunks)
    assert ok == [True, True]
    assert all(same_bits(a, b) for a, b in zip(decoded, chunks))
    assert all(size < chunk.numel() * 2 for size, chunk in zip(sizes, chunks))


def test_processor_round_trips_real_shaped_chunks(l1):
    chunks = [channel_chunk(SMOLLM2_SHAPE, seed=9)]
    decoded, sizes, ok = serde_round_trip(l1, SMOLLM2_KWARGS, chunks)
    assert ok == [True, True]
    assert same_bits(decoded[0], chunks[0])
    assert sizes[0] < chunks[0].numel() * 2


def test_processor_round_trips_calibrated_real_kv(l1, tmp_path):
    model, calibration = tiny_calibrated()
    calibration.save(tmp_path / "cal")
    chunks = model_chunks(model, 128, 64)
    decoded, _, ok = serde_round_trip(l1, {"calibration": str(tmp_path / "cal")}, chunks)
    assert ok == [True, True]
    assert all(same_bits(a, b) for a, b in zip(decoded, chunks))


def test_portable_option_codes_without_a_rope_frame(tmp_path):
    coder = coder_from_kwargs({"portable": True, "layers": 30, "kv_heads": 3, "head_dim": 64})
    assert coder.rope.is_identity and coder.calibration is None
    assert coder_from_kwargs(SMOLLM2_KWARGS).rope.inv_freq.numel() == 32
    _, calibration = tiny_calibrated()
    calibration.save(tmp_path / "cal")
    with pytest.raises(ValueError, match="model-free coding without a RoPE frame"):
        coder_from_kwargs({"portable": True, "calibration": str(tmp_path / "cal")})


def test_calibration_fingerprint_lookup(tmp_path, monkeypatch):
    _, calibration = tiny_calibrated()
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    calibration.save(tmp_path / "calibrations" / calibration.fingerprint)
    coder = coder_from_kwargs({"calibration_fingerprint": calibration.fingerprint})
    assert coder.calibration is not None and coder.calibration.fingerprint == calibration.fingerprint
    with pytest.raises(Exception, match="no calibration"):
        coder_from_kwargs({"calibration_fingerprint": "0123456789abcdef"})


@pytest.mark.parametrize("kwargs, message", [
    ({"bogus": 1}, "unknown option"),
    ({"layers": 0}, "layers must be >= 1"),
    ({"rope_theta": 10000.0}, "even head_dim"),
    ({"pad_to_estimate": "yes"}, "true or false"),
    ({"max_workers": 0}, "max_workers must be >= 1"),
    ({"threads": 0}, "threads must be >= 1"),
    ({"calibration": "/nonexistent", "calibration_fingerprint": "ab"}, "not both"),
    ({"portable": "yes"}, "true or false"),
    ({"portable": True, "rope_theta": 10000.0, "head_dim": 64}, "not both"),
])
def test_bad_serde_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_serde_processor(SerdeConfig(type=SERDE_NAME, kwargs=kwargs))


def test_another_models_chunk_is_refused(l1):
    serde = create_serde_processor(SerdeConfig(type=SERDE_NAME, kwargs=SMOLLM2_KWARGS))
    try:
        # the size bound is given for any layout (LMCache calls it outside its error handling) ...
        other = MemoryLayoutDesc([torch.Size([2, 24, 16, 128])], [torch.bfloat16])
        assert serde.estimate_serialized_size(other) == HEADER.size + 2 * 24 * 16 * 128 * 2
        # ... and serializing refuses: the task fails (the store is dropped), nothing is coded
        for shape, dtype in (((2, 24, 16, 128), torch.bfloat16), ((2, 30, 16, 192), torch.float32),
                             ((30, 16, 576), torch.bfloat16)):
            src = memory_objs(l1, [key(1)], shape, dtype)
            layout = serialized_layout_desc(MemoryLayoutDesc([torch.Size(shape)], [dtype]), serde)
            temps = l1.reserve_write([key(2)], [True], layout, tag="temp")
            task = serde.submit_serialize(src, [temps[key(2)][1]], [key(1)])
            assert wait_for(lambda t=task: serde.query_serialize_result(t), "serialize") is False
            l1.finish_write_and_delete([key(1)], tag="test")
            l1.finish_write_and_delete([key(2)], tag="temp")
    finally:
        serde.close()
    coder = coder_from_kwargs(SMOLLM2_KWARGS)
    for shape, dtype, match in (((2, 24, 16, 128), torch.bfloat16, "another model"),
                                ((2, 30, 16, 192), torch.float32, "bfloat16 and float16"),
                                ((30, 16, 576), torch.bfloat16, "KV_2LTD")):
        with pytest.raises(ChunkError, match=match):
            coder.encode(torch.zeros(shape, dtype=dtype))


def test_adapter_wrapper_refuses_another_models_chunk(l1):
    """Through the wrapper: storing another model's chunk fails cleanly; loading it into this model's
    layout is a miss."""
    inner = VariableSizeL2Adapter()
    adapter = wrapper(l1, inner, SMOLLM2_KWARGS)
    try:
        chunk = channel_chunk((2, 24, 16, 128), seed=3)
        src = memory_objs(l1, [key(1)], chunk.shape, chunk.dtype, tag="engine")
        src[0].tensor.copy_(chunk)
        assert not wait_store(adapter, adapter.submit_store_task([key(1)], src)).is_successful()
        assert inner.stored == {}
        inner.stored[key(1)] = coder_from_kwargs({}).encode(chunk)  # written by a server without shape checks
        dst = memory_objs(l1, [key(2)], SMOLLM2_SHAPE, torch.bfloat16, tag="prefetch")
        bitmap = wait_load(adapter, adapter.submit_load_task([key(1)], dst))
        assert not bitmap.test(0)
    finally:
        adapter.close()


def wrapper(l1, inner, kwargs):
    return SerdeL2AdapterWrapper(inner=inner, serde=create_serde_processor(SerdeConfig(SERDE_NAME, kwargs)),
                                 l1_manager=l1)


def store_and_load(adapter, l1, chunks, first_key: int = 0):
    keys = [key(first_key + i) for i in range(len(chunks))]
    src = memory_objs(l1, keys, chunks[0].shape, chunks[0].dtype, tag="engine")
    for obj, chunk in zip(src, chunks):
        obj.tensor.copy_(chunk)
    stored = wait_store(adapter, adapter.submit_store_task(keys, src))
    dst = memory_objs(l1, [key(first_key + 1000 + i) for i in range(len(chunks))], chunks[0].shape,
                      chunks[0].dtype, tag="prefetch")
    for obj in dst:
        obj.tensor.fill_(0)
    bitmap = wait_load(adapter, adapter.submit_load_task(keys, dst))
    hits = [bitmap.test(i) for i in range(len(chunks))]
    return stored, hits, [obj.tensor.clone() for obj in dst]


@pytest.mark.parametrize("kwargs", [{}, SMOLLM2_KWARGS])
def test_adapter_wrapper_round_trip_keeps_variable_sizes(l1, kwargs):
    inner = VariableSizeL2Adapter()
    adapter = wrapper(l1, inner, kwargs)
    try:
        shape = SMOLLM2_SHAPE if kwargs else (2, 3, 64, 48)
        chunks = [channel_chunk(shape, seed=s) for s in range(2)]
        stored, hits, loaded = store_and_load(adapter, l1, chunks)
        assert stored.is_successful()
        assert hits == [True, True]
        assert all(same_bits(a, b) for a, b in zip(loaded, chunks))
        raw = chunks[0].numel() * 2
        assert all(len(data) < raw for data in inner.stored.values())  # stored compressed
        assert stored.bytes_transferred() == sum(len(data) for data in inner.stored.values())
    finally:
        adapter.close()


def test_adapter_wrapper_turns_damaged_payloads_into_misses(l1):
    inner = VariableSizeL2Adapter()
    adapter = wrapper(l1, inner, {})
    try:
        chunks = [channel_chunk((2, 2, 32, 32), seed=s) for s in range(2)]
        keys = [key(i) for i in range(2)]
        src = memory_objs(l1, keys, chunks[0].shape, chunks[0].dtype, tag="engine")
        for obj, chunk in zip(src, chunks):
            obj.tensor.copy_(chunk)
        assert wait_store(adapter, adapter.submit_store_task(keys, src)).is_successful()
        for k in keys:  # damage each stored payload: one flipped bit in the body, one truncation
            data = bytearray(inner.stored[k])
            data[len(data) // 2] ^= 0x10
            inner.stored[k] = bytes(data)
        inner.stored[keys[1]] = inner.stored[keys[1]][: HEADER.size + 5]
        dst = memory_objs(l1, [key(10), key(11)], chunks[0].shape, chunks[0].dtype, tag="prefetch")
        bitmap = wait_load(adapter, adapter.submit_load_task(keys, dst))
        assert [bitmap.test(i) for i in range(2)] == [False, False]  # misses, never a wrong chunk
    finally:
        adapter.close()


def fs_adapter(l1, base_path, **serde_kwargs):
    """An ``fs`` adapter with this serde, built from an ``--l2-adapter`` JSON by LMCache's own parser."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", adapter_spec(str(base_path), **serde_kwargs)])
    (config,) = parse_args_to_l2_adapters_config(args).adapters
    assert config.serde_config.type == SERDE_NAME
    inner = create_l2_adapter_from_registry(config)
    return SerdeL2AdapterWrapper(inner=inner, serde=create_serde_processor(config.serde_config), l1_manager=l1)


def test_fs_adapter_0_5_6_reads_compressed_payloads_as_misses(l1, tmp_path):
    """LMCache 0.5.6's fs adapter reads back estimate_serialized_size bytes and reports a shorter file as
    a miss ("Incomplete read"): compressed chunks are stored but never hit (docs/lmcache.md). An LMCache
    with PR #3796's size lookup turns these into hits; either way a load is never a wrong chunk."""
    adapter = fs_adapter(l1, tmp_path)
    try:
        chunks = [channel_chunk((2, 3, 64, 48), seed=1)]
        stored, hits, loaded = store_and_load(adapter, l1, chunks)
        assert stored.is_successful()
        files = list(tmp_path.rglob("*.data"))
        assert len(files) == 1 and files[0].stat().st_size < chunks[0].numel() * 2  # stored compressed
        if importlib.metadata.version("lmcache") == "0.5.6":
            assert hits == [False]  # the documented limitation
        assert hits == [False] or (hits == [True] and same_bits(loaded[0], chunks[0]))
    finally:
        adapter.close()


def test_fs_adapter_with_padding_round_trips(l1, tmp_path):
    """``pad_to_estimate``: files as long as the estimate (zero tail) read back as hits on 0.5.6."""
    adapter = fs_adapter(l1, tmp_path, pad_to_estimate=True)
    try:
        chunks = [channel_chunk((2, 3, 64, 48), seed=s) for s in range(2)]
        stored, hits, loaded = store_and_load(adapter, l1, chunks)
        assert stored.is_successful() and hits == [True, True]
        assert all(same_bits(a, b) for a, b in zip(loaded, chunks))
        sizes = {f.stat().st_size for f in tmp_path.rglob("*.data")}
        assert sizes == {HEADER.size + chunks[0].numel() * 2}
    finally:
        adapter.close()


def test_server_launcher_registers_the_serde_and_runs_lmcache():
    result = subprocess.run([sys.executable, "-m", "hf_kvcompress.integrations.lmcache_server", "--help"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--l2-adapter" in result.stdout
