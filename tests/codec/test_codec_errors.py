"""Every error path: bad arguments raise TypeError / ValueError naming the problem; bad streams and
mismatched mean / std / marginal raise CorruptStreamError."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from codec_testutil import realistic, reseal

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError, Marginal
from hf_kvcompress.codec import tables as codec_model
from hf_kvcompress.codec.ans_coder.layout import FULL_PREFIX, MAGIC, VERSION


@pytest.fixture(scope="module")
def stream():
    x, offset, scale = realistic((1, 2, 64, 64))
    return x, offset, scale, codec.encode(x, offset, scale, CodecConfig(coder="ans"))


def test_corrupt_stream_error_is_value_error():
    assert issubclass(CorruptStreamError, ValueError)


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.zeros(3, dtype=np.float32), "x", None])
def test_x_must_be_tensor(bad):
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        codec.encode(bad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8, torch.bool, torch.complex64, torch.uint8])
def test_unsupported_dtype_named(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        codec.encode(torch.zeros(4, dtype=dtype))


def test_too_many_dims():
    with pytest.raises(ValueError, match="dims"):
        codec.encode(torch.zeros((1,) * 33, dtype=torch.bfloat16))


def test_bad_mean_std_shapes():
    x = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not broadcast"):
        codec.encode(x, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="more dims"):
        codec.encode(x, None, torch.ones(1, 1, 1, 1))
    with pytest.raises(ValueError, match="does not broadcast"):
        codec.encode(x, None, torch.ones(5))


@pytest.mark.parametrize(
    ("mean", "std", "match"),
    [
        (float("nan"), 1.0, "mean contains NaN"),
        (float("inf"), 1.0, "mean contains inf"),
        (0.0, float("nan"), "std contains NaN"),
        (0.0, float("inf"), "std contains inf"),
        (0.0, -1.0, "std must be >= 0"),
        (torch.tensor([0.0, float("nan")]), None, "NaN"),
        (1e39, 1.0, "inf"),  # overflows float32
    ],
)
def test_bad_mean_std_values(mean, std, match):
    with pytest.raises(ValueError, match=match):
        codec.encode(torch.zeros(2, dtype=torch.bfloat16), mean, std)


@pytest.mark.parametrize("bad", [True, "1.0", [1.0], torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.bool)])
def test_bad_mean_types(bad):
    with pytest.raises(TypeError):
        codec.encode(torch.zeros(2, dtype=torch.bfloat16), bad)


def test_bad_config_type_and_values():
    x = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="CodecConfig"):
        codec.encode(x, config={"window": "fixed"})
    with pytest.raises(ValueError, match="window"):
        CodecConfig(coder="ans", window="sliding")
    with pytest.raises(ValueError, match="fixed_window"):
        CodecConfig(coder="ans", fixed_window=0)
    with pytest.raises(ValueError, match="fixed_window"):
        CodecConfig(coder="ans", fixed_window=70000)
    with pytest.raises(TypeError, match="fixed_window"):
        CodecConfig(coder="ans", fixed_window=64.0)
    with pytest.raises(ValueError, match="multiple of min_window"):
        CodecConfig(coder="ans", tier_windows=(100, 1024, 4096))
    with pytest.raises(ValueError, match="non-decreasing"):
        CodecConfig(coder="ans", tier_windows=(1024, 256, 4096))
    with pytest.raises(ValueError, match="thresholds"):
        CodecConfig(coder="ans", thresholds=(0.5, 0.1))
    with pytest.raises(ValueError, match="escape"):
        CodecConfig(coder="ans", escape=(0, 1, 1))
    with pytest.raises(ValueError, match="sigma_global"):
        CodecConfig(coder="ans", sigma_global=-1.0)
    with pytest.raises(TypeError, match="marginal"):
        CodecConfig(coder="ans", marginal="default")
    with pytest.raises(ValueError, match="unknown field"):
        CodecConfig.from_dict({"window": "fixed", "colour": 3})
    with pytest.raises(TypeError, match="dict"):
        CodecConfig.from_dict([("window", "fixed")])


def test_config_round_trips_json():
    import json

    cfg = CodecConfig(coder="ans", window="causal", tier_windows=(128, 512, 2048), escape=(9, 8, 7), sigma_global=0.25)
    assert CodecConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    m = Marginal.from_samples(torch.randn(1000).to(torch.bfloat16))
    cfg = CodecConfig(coder="ans", marginal=m)
    assert CodecConfig.from_dict(json.loads(json.dumps(cfg.to_dict())), marginal=m) == cfg
    with pytest.raises(ValueError, match="marginal"):
        CodecConfig.from_dict(cfg.to_dict())


def test_blob_type():
    with pytest.raises(TypeError, match="bytes"):
        codec.decode("not bytes")
    with pytest.raises(TypeError, match="bytes"):
        codec.decode_range(123, 0, 1)


@pytest.mark.parametrize("blob", [b"", b"\x89KVC", b"hello world, this is not a stream" * 3, bytes(200)])
def test_foreign_or_short_input(blob):
    with pytest.raises(CorruptStreamError):
        codec.decode(blob)


def test_bad_magic_message(stream):
    *_, blob = stream
    with pytest.raises(CorruptStreamError, match="magic"):
        codec.decode(b"PK\x03\x04" + blob[4:])


def test_future_version(stream):
    _x, offset, scale, blob = stream
    b = bytearray(blob)
    struct.pack_into("<H", b, len(MAGIC), VERSION + 1)
    with pytest.raises(CorruptStreamError, match="newer"):
        codec.decode(bytes(b), offset, scale)


def test_truncated(stream):
    _x, offset, scale, blob = stream
    for cut in (len(blob) - 1, len(blob) // 2, FULL_PREFIX.size + 3, 10):
        with pytest.raises(CorruptStreamError):
            codec.decode(blob[:cut], offset, scale)
    with pytest.raises(CorruptStreamError):
        codec.decode(blob + b"\0\0\0\0", offset, scale)


def test_mean_std_mismatch_is_caught_by_fingerprint(stream):
    x, offset, scale, blob = stream
    with pytest.raises(CorruptStreamError, match="fingerprint"):
        codec.decode(blob, offset + 1e-3, scale)
    with pytest.raises(CorruptStreamError, match="fingerprint"):
        codec.decode(blob, offset, scale * 2)
    with pytest.raises(CorruptStreamError, match="fingerprint"):
        codec.decode(blob, offset, scale.expand(1, 2, 64, 64))  # same values, different shape
    with pytest.raises(CorruptStreamError, match="fingerprint"):
        codec.decode(blob, offset, torch.ones(7))  # not even broadcastable
    with pytest.raises(CorruptStreamError, match="encoded with a mean"):
        codec.decode(blob, None, scale)
    with pytest.raises(CorruptStreamError, match="encoded with a std"):
        codec.decode(blob, offset, None)
    plain = codec.encode(x, config=CodecConfig(coder="ans"))
    with pytest.raises(CorruptStreamError, match="without a mean"):
        codec.decode(plain, offset)
    with pytest.raises(CorruptStreamError, match="fingerprint"):
        codec.decode_range(blob, 0, 10, offset, scale + 1)


def test_marginal_mismatch():
    x = torch.randn(512).to(torch.bfloat16)
    m = Marginal.from_samples(x)
    blob = codec.encode(x, config=CodecConfig(coder="ans", marginal=m))
    with pytest.raises(CorruptStreamError, match="marginal"):
        codec.decode(blob)
    other = Marginal.from_samples(torch.randn(100).to(torch.bfloat16))
    with pytest.raises(CorruptStreamError, match="marginal"):
        codec.decode(blob, marginal=other)
    assert torch.equal(codec.decode(blob, marginal=m).view(torch.int16), x.view(torch.int16))
    with pytest.raises(TypeError, match="marginal"):
        codec.decode(blob, marginal="default")


def test_table_hash_mismatch(stream, monkeypatch):
    _x, offset, scale, blob = stream
    real = codec_model.get_tables()
    fake = codec_model.Tables(**{**real.__dict__, "sha256": "00" * 32})
    monkeypatch.setattr("hf_kvcompress.codec.ans_coder.streams.get_tables", lambda: fake)
    with pytest.raises(CorruptStreamError, match="tables"):
        codec.decode(blob, offset, scale)


def test_platform_table_check(monkeypatch):
    monkeypatch.setattr(codec_model, "TABLES_SHA256", "ff" * 32)
    codec_model.get_tables.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="different coding tables"):
            codec_model.get_tables()
    finally:
        monkeypatch.undo()
        codec_model.get_tables.cache_clear()
        codec_model.get_tables()


def test_decode_argument_checks(stream):
    x, offset, scale, blob = stream
    with pytest.raises(ValueError, match="threads"):
        codec.decode(blob, offset, scale, threads=0)
    with pytest.raises(ValueError, match="workers"):
        codec.decode(blob, offset, scale, workers=-1)
    with pytest.raises(ValueError, match="start"):
        codec.decode_range(blob, 5, 2, offset, scale)
    with pytest.raises(ValueError, match="stop"):
        codec.decode_range(blob, 0, x.numel() + 1, offset, scale)
    with pytest.raises(TypeError, match="start"):
        codec.decode_range(blob, 0.5, 2, offset, scale)


def test_resealed_garbage_is_rejected(stream):
    """Payload garbage with valid CRCs must still be caught (ANS leftovers, value range, data checksum)."""
    _x, offset, scale, blob = stream
    rng = np.random.default_rng(0)
    b = bytearray(blob)
    tail = len(b) - 64
    b[tail:] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    with pytest.raises(CorruptStreamError):
        codec.decode(reseal(bytes(b)), offset, scale)


def test_marginal_validation():
    with pytest.raises(ValueError, match="65536"):
        Marginal(np.zeros(10, dtype=np.int64))
    with pytest.raises(TypeError, match="integers"):
        Marginal(np.zeros(65536))
    with pytest.raises(ValueError, match="sum"):
        Marginal(np.zeros(65536, dtype=np.int64))
    with pytest.raises(TypeError, match="Tensor"):
        Marginal.from_samples([1.0])
    with pytest.raises(ValueError, match="prior_weight"):
        Marginal.from_samples(torch.zeros(3, dtype=torch.bfloat16), prior_weight=0.0)
    m = Marginal.from_samples(torch.randn(100, dtype=torch.float32))
    assert Marginal.from_tensor(m.to_tensor()) == m
