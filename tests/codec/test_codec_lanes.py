"""The lanes format (`CodecConfig(coder="lanes")`): compiled params equal the reference, every pattern and
shape round-trips, the batch API equals the per-stream one byte for byte, bad input is refused."""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch
from codec_testutil import (
    DTYPES,
    PARAM_TRIPLES,
    assert_bit_exact,
    from_patterns,
    params_bulk,
    params_inputs,
    pattern_sample,
    realistic,
    reseal,
    special_patterns,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError, Marginal, ParameterMismatchError
from hf_kvcompress.codec import lanes as L
from hf_kvcompress.codec.params import element_params, element_params_reference
from hf_kvcompress.codec.symbols import BF16, FP16, FP32

LANES = CodecConfig(coder="lanes")


def _jit_params(mean: np.ndarray, std: np.ndarray, fmt, steps: int):
    """The compiled per-element model (`params.params_kernel`, which the lanes coder runs on its threads)."""
    mb = np.ascontiguousarray(mean, dtype=np.float32).view(np.uint32).reshape(-1)
    sb = np.ascontiguousarray(std, dtype=np.float32).view(np.uint32).reshape(-1)
    return element_params(mb, sb, fmt, steps)


def _assert_params_equal(mean: np.ndarray, std: np.ndarray, fmt, steps: int) -> None:
    a = _jit_params(mean, std, fmt, steps)
    b = element_params_reference(mean.view(np.uint32), std.view(np.uint32), fmt, steps)
    for name, u, v in zip(("tid", "cp", "cn", "s"), a, b):
        assert np.array_equal(np.asarray(u, np.int64), np.asarray(v, np.int64)), name


# ------------------------------------------------------------------ compiled params == numpy reference

def _edges() -> np.ndarray:
    return np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.1754944e-38, 1.0, -1.0, 1.5, 3.0e38, -3.3e38,
                     3.4028235e38, -3.4028235e38, 65504.0, 65520.0, 6.1e-5, 5.96e-8, 2.0**-24, 0.999, 1.0039062,
                     1.0078125, 8.0, 7.9375, 0.12451172], dtype=np.float32)


@pytest.mark.parametrize("fmt", [BF16, FP16, FP32], ids=lambda f: f.name)
@pytest.mark.parametrize("steps", [8, 4, 2])
def test_jit_params_equal_reference_on_edges(fmt, steps):
    e = _edges()
    mean, std = np.meshgrid(e, np.concatenate([e[:2], np.abs(e)]).astype(np.float32))
    _assert_params_equal(mean.reshape(-1), std.reshape(-1), fmt, steps)


@settings(max_examples=60, deadline=None)
@given(PARAM_TRIPLES, st.sampled_from([BF16, FP16, FP32]), st.sampled_from([8, 4, 2]))
def test_jit_params_equal_reference(triples, fmt, steps):
    mean, std = params_inputs(triples)
    _assert_params_equal(mean, std, fmt, steps)


def test_jit_params_equal_reference_bulk():
    mean, std = params_bulk()
    for fmt in (BF16, FP16, FP32):
        for steps in (8, 4, 2):
            _assert_params_equal(mean, std, fmt, steps)


# ------------------------------------------------------------------ round trips

STATS = ("none", "scalar", "mean-only", "std-only", "channel", "full")


def _stats(kind: str, x: torch.Tensor, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xf = x.float().nan_to_num(0.0, 0.0, 0.0)
    shape = tuple(x.shape)
    cshape = (1,) * (len(shape) - 1) + shape[-1:] if shape else ()
    if kind == "none":
        return None, None
    if kind == "scalar":
        return 0.25, 1.5
    if kind == "mean-only":
        return torch.randn(cshape, generator=g), None
    if kind == "std-only":
        return None, torch.rand(cshape, generator=g) * 3
    if kind == "channel":
        return torch.randn(cshape, generator=g), torch.rand(cshape, generator=g) * 3
    noise = torch.randn(shape, generator=g)
    return (xf + noise * 0.1).clamp(-1e30, 1e30), (noise.abs() * 0.2).clamp(max=1e30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_pattern_round_trips(dtype):
    """All 2^16 bf16 / fp16 patterns (a wide sample of float32 ones), special values, several stats."""
    pats = pattern_sample(dtype)
    x = from_patterns(pats, dtype)
    for mean, std in ((None, None), (torch.tensor(0.3), torch.tensor(2.0)), (1e4, 0.0), (-2.5, 1e-3),
                      (torch.randn(x.shape), torch.rand(x.shape) * 10)):
        blob = codec.encode(x, mean, std, LANES)
        assert_bit_exact(codec.decode(blob, mean, std, config=LANES), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", STATS)
def test_realistic_stat_shapes(dtype, kind):
    x, _, _ = realistic((2, 3, 40, 64), dtype=dtype)
    mean, std = _stats(kind, x)
    blob = codec.encode(x, mean, std, LANES)
    assert_bit_exact(codec.decode(blob, mean, std, config=LANES), x)
    assert_bit_exact(codec.decode_range(blob, 77, 5000, mean, std, config=LANES), x.reshape(-1)[77:5000])


def test_empty_scalar_and_odd_shapes():
    for dtype in DTYPES:
        for shape in ((0,), (3, 0, 2), (), (1,), (7,), (5, 1, 3), (1000,)):
            x = torch.randn(shape).to(dtype)
            assert_bit_exact(codec.decode(codec.encode(x, config=LANES), config=LANES), x)
            assert_bit_exact(codec.decode(codec.encode(x, 0.0, 1.0, LANES), 0.0, 1.0, config=LANES), x)


def test_non_contiguous_and_mean_dtypes():
    x = torch.randn(64, 48).to(torch.bfloat16).t()
    mean = torch.zeros(48, 1, dtype=torch.float64)
    std = torch.ones(1, 64, dtype=torch.bfloat16)
    blob = codec.encode(x, mean, std, LANES)
    assert_bit_exact(codec.decode(blob, mean, std, config=LANES), x.contiguous())
    assert_bit_exact(codec.decode(blob, mean.float(), std.float(), config=LANES), x.contiguous())


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers(1, 700),
       st.sampled_from(STATS), st.floats(-6, 6), st.sampled_from([0.0, 0.01, 0.5]), st.integers(0, 2**32 - 1),
       st.lists(st.integers(1, 32768), min_size=3, max_size=3), st.sampled_from([8, 4, 2]))
def test_round_trip_property(dtype, lead, last, kind, log_scale, frac_random, seed, escape, steps):
    shape = (*lead, last)
    n = math.prod(shape)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(n) * 10.0**log_scale).to(dtype)
    width = 32 if dtype == torch.float32 else 16
    rand_bits = rng.integers(0, 2**width, n, dtype=np.uint64).astype(np.int64)
    x = torch.where(torch.from_numpy(rng.random(n) < frac_random), from_patterns(rand_bits, dtype), x)
    sp = special_patterns(dtype)
    x[torch.from_numpy(rng.integers(0, n, min(n, sp.size)))] = from_patterns(sp[: min(n, sp.size)], dtype)
    x = x.reshape(shape)
    cfg = CodecConfig(coder="lanes", escape=tuple(escape), mean_steps=steps)
    mean, std = _stats(kind, x, seed % 1000)
    blob = codec.encode(x, mean, std, cfg)
    assert_bit_exact(codec.decode(blob, mean, std, config=cfg), x)


# ------------------------------------------------------------------ batch API

BATCH_STATS = {
    "none": lambda x: (None, None),
    "shared-channel": lambda x: (torch.randn(1, 1, x.shape[-1]), torch.rand(1, 1, x.shape[-1]) + 0.1),
    "per-stream-channel": lambda x: (torch.randn(x.shape[0], 1, x.shape[-1]), torch.rand(x.shape[0], 1, x.shape[-1])),
    "per-element": lambda x: (x.float() * 0.9, x.float().abs() * 0.1 + 1e-3),
    "mean-only-1d": lambda x: (torch.randn(x.shape[-1]), None),
    "std-only-scalar": lambda x: (None, 2.0),
}


def _pick(stat, i: int, n: int):
    """Stream i's slice of a batch stat (as the per-stream API gets it)."""
    if not isinstance(stat, torch.Tensor) or stat.dim() < 3:
        return stat
    return stat[i] if stat.shape[0] == n else stat[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(BATCH_STATS))
def test_batch_equals_per_stream(dtype, kind):
    x, _, _ = realistic((1, 5, 48, 64), seed=2, dtype=dtype)
    x = x[0]
    mean, std = BATCH_STATS[kind](x)
    blobs = codec.encode_batch(x, mean, std, LANES)
    assert len(blobs) == x.shape[0]
    for i, b in enumerate(blobs):
        assert b == codec.encode(x[i], _pick(mean, i, 5), _pick(std, i, 5), LANES)
    assert codec.encode_batch(x, mean, std, LANES, threads=2) == blobs
    for threads in (1, 2, 8):
        assert_bit_exact(codec.decode_batch(blobs, mean, std, LANES, threads=threads), x)
    out = torch.empty_like(x)
    got = codec.decode_batch(blobs, mean, std, LANES, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_bit_exact(out, x)


def test_decode_into_strided_out():
    """``decode_batch(out=...)`` into views (transposed, sliced, streams spread over lead dims, a stream shape
    that does not fold into two strides): the same bits as a plain decode, and nothing outside the view written."""
    x, offset, scale = realistic((1, 6, 16, 24), seed=3)
    x, offset, scale = x[0], offset[0], scale[0]  # 6 streams of [16, 24]
    blobs = codec.encode_batch(x, offset, scale, LANES)
    want = codec.decode_batch(blobs, offset, scale, LANES)
    assert_bit_exact(want, x)
    sentinel = torch.tensor(-7.0, dtype=x.dtype)

    def check(buffer: torch.Tensor, view: torch.Tensor, expect: torch.Tensor) -> None:
        buffer.fill_(sentinel)
        got = codec.decode_batch(blobs, offset, scale, LANES, out=view)
        assert got is view
        assert_bit_exact(view.reshape(expect.shape), expect)
        mask = torch.ones(buffer.shape, dtype=torch.bool)
        mask.as_strided(view.shape, view.stride(), view.storage_offset() - buffer.storage_offset()).fill_(False)
        assert (buffer.view(torch.int16)[mask] == sentinel.view(torch.int16)).all()

    # each stream transposed in a [6, 24, 16] buffer (element (c, t) of a stream at t * 16 + c)
    buf = torch.empty(6, 24, 16, dtype=x.dtype)
    check(buf, buf.transpose(1, 2), x)
    # every other token of a wider buffer, and streams in a [2, 3] lead with gaps between them
    buf = torch.empty(2, 4, 16, 50, dtype=x.dtype)
    check(buf, buf[:, 1:, :, 1:49:2], x.view(2, 3, 16, 24))
    # the layout a cache reads: [blocks, k/v, heads, rows, dim, tokens] over [k/v, rows, heads, tokens, dim]
    buf = torch.empty(2, 1, 3, 40, 16, dtype=x.dtype)
    view = buf[:, :, :, :24].permute(0, 2, 1, 4, 3)  # [k/v, heads, rows, dim, tokens]
    check(buf, view, x.view(2, 3, 1, 16, 24))
    # streams of [4, 4, 24] laid out so that their dims do not fold: decoded contiguous, then copied
    x3 = x.view(6, 4, 4, 24)
    blobs = codec.encode_batch(x3, offset.view(6, 1, 1, 24), scale.view(6, 1, 1, 24), LANES)
    buf = torch.empty(6, 4, 8, 24, dtype=x.dtype)
    view = buf[:, :, ::2].transpose(1, 2)
    assert L.out_layout(view, (4, 4, 24)) is None
    got = codec.decode_batch(blobs, offset.view(6, 1, 1, 24), scale.view(6, 1, 1, 24), LANES, out=view)
    assert got is view
    assert_bit_exact(view, x3)


@pytest.mark.parametrize("threads", [1, 2])
def test_start_decode_batch_equals_decode_batch(threads, batch):
    """`codec.start_decode_batch`: background threads take chunks while the caller goes on, `finish` takes the
    rest and gives decode_batch's bits (into ``out`` too); a damaged stream raises at `finish`, naming it; a
    cancelled job hands out nothing more."""
    x, offset, scale, blobs = batch
    want = codec.decode_batch(blobs, offset, scale, LANES)
    job = codec.start_decode_batch(blobs, offset, scale, LANES, threads=threads, chunks=3)
    assert_bit_exact(job.finish(), want)
    out = torch.empty(2, 2, 64, 64, dtype=x.dtype).transpose(-1, -2)  # a strided view, lead dims [2, 2]
    job = codec.start_decode_batch(blobs, offset, scale, LANES, out, threads=threads, chunks=8)
    assert job.finish() is out
    assert_bit_exact(out.reshape(4, 64, 64), want)
    bad = bytearray(blobs[3])
    bad[len(bad) // 2] ^= 0x04
    job = codec.start_decode_batch([*blobs[:3], bytes(bad)], offset, scale, LANES, threads=threads, chunks=4)
    with pytest.raises(CorruptStreamError, match="stream 3"):
        job.finish()
    with pytest.raises(ParameterMismatchError):  # checked before anything starts, as in decode_batch
        codec.start_decode_batch(blobs, offset + 1e-3, scale, LANES, threads=threads)
    job = codec.start_decode_batch(blobs, offset, scale, LANES, threads=threads, chunks=64)
    job.cancel()
    assert job._take() is None


def test_rate_close_to_ans():
    """The same tables at the same precision: the lanes stream is within 0.02 bit/scalar of the ans one."""
    x, offset, scale = realistic((1, 2, 256, 64), seed=6)
    cfg = CodecConfig(coder="ans", header="compact", fixed_window=65536)
    for h in range(2):
        a = len(codec.encode(x[0, h], offset[0, h], scale[0, h], cfg))
        b = len(codec.encode(x[0, h], offset[0, h], scale[0, h], LANES))
        assert abs(b - a) * 8 / x[0, h].numel() < 0.02


def test_marginal_in_config():
    x = torch.randn(3, 512).to(torch.bfloat16)
    m = Marginal.from_samples(x)
    cfg = CodecConfig(coder="lanes", marginal=m)
    blobs = codec.encode_batch(x, None, None, cfg)
    assert_bit_exact(codec.decode_batch(blobs, None, None, cfg), x)
    assert_bit_exact(codec.decode(blobs[1], config=LANES, marginal=m), x[1])
    with pytest.raises(CorruptStreamError, match="digest"):
        codec.decode(blobs[1], config=LANES)


def test_a_marginals_tables_go_with_it():
    # the lanes coder's p_hat tables are kept by the marginal they derive from: a calibration's marginals (one per
    # head) must not stay in a process-wide memo after the calibration is gone
    # (the configs that name a marginal sit in bounded LRU memos, which keep it while they hold the config)
    m = Marginal.from_samples(torch.randn(3, 512).to(torch.bfloat16))
    tables = L.phat_tables(m, BF16)
    assert L.phat_tables(m, BF16) is tables  # built once
    held = weakref.ref(tables[0])
    del m, tables
    gc.collect()
    assert held() is None


# ------------------------------------------------------------------ refusals

@pytest.fixture(scope="module")
def batch():
    x, offset, scale = realistic((1, 4, 64, 64), seed=8)
    x, offset, scale = x[0], offset[0], scale[0]
    return x, offset, scale, codec.encode_batch(x, offset, scale, LANES)


def test_mismatched_stats_refused(batch):
    x, offset, scale, blobs = batch
    with pytest.raises(ParameterMismatchError, match="fingerprint"):
        codec.decode_batch(blobs, offset + 1e-3, scale, LANES)
    with pytest.raises(ParameterMismatchError, match="fingerprint"):
        codec.decode_batch(blobs, offset, scale.expand(4, 64, 64), LANES)  # same values, another shape
    with pytest.raises(ParameterMismatchError):
        codec.decode_batch(blobs, offset, torch.ones(7), LANES)
    with pytest.raises(ParameterMismatchError, match="stream 2"):
        codec.decode_batch([*blobs[:2], blobs[3], blobs[3]], offset, scale, LANES)
    with pytest.raises(CorruptStreamError, match="encoded with a std"):
        codec.decode_batch(blobs, offset, None, LANES)
    with pytest.raises(ParameterMismatchError, match="fingerprint"):
        codec.decode(blobs[0], offset[1], scale[0], config=LANES)
    with pytest.raises(ParameterMismatchError):
        codec.decode(blobs[0], offset[0], torch.ones(7), config=LANES)
    plain = codec.encode(x[0], config=LANES)
    with pytest.raises(CorruptStreamError, match="without a mean"):
        codec.decode(plain, offset[0], config=LANES)


def test_config_and_arguments_refused(batch):
    x, offset, scale, blobs = batch
    # without config= a lanes stream is checked against the default config (lanes): LANES's streams decode,
    # another config's fail on the digest, naming the config
    assert torch.equal(codec.decode(blobs[0], offset[0], scale[0]), x[0])
    other = CodecConfig(coder="lanes", escape=(256, 128, 32))
    with pytest.raises(CorruptStreamError, match="config"):
        codec.decode(codec.encode(x[0], offset[0], scale[0], other), offset[0], scale[0])
    with pytest.raises(CorruptStreamError, match="digest"):
        codec.decode(blobs[0], offset[0], scale[0], config=other)
    with pytest.raises(CorruptStreamError, match=r"a 'lanes' stream.*coder='ans'"):  # another coder's config
        codec.decode_batch(blobs, offset, scale, CodecConfig(coder="ans"))
    with pytest.raises(ValueError, match="window"):
        CodecConfig(coder="lanes", window="metadata")
    with pytest.raises(ValueError, match="coder='ans'"):  # the message says which coder has adaptive windows
        CodecConfig(window="metadata")
    with pytest.raises(ValueError, match="coder"):
        CodecConfig(coder="rans")
    with pytest.raises(ValueError, match="threads"):
        codec.decode_batch(blobs, offset, scale, LANES, threads=0)
    with pytest.raises(TypeError, match="sequence"):
        codec.decode_batch(blobs[0], offset, scale, LANES)
    with pytest.raises(ValueError, match="no streams"):
        codec.decode_batch([], offset, scale, LANES)
    with pytest.raises(ValueError, match="one shape"):
        codec.decode_batch([*blobs[:3], codec.encode(x[0, :10], offset[0], scale[0], LANES)], offset, scale, LANES)
    with pytest.raises(ValueError, match="out"):
        codec.decode_batch(blobs, offset, scale, LANES, out=torch.empty(4, 64, 64))
    with pytest.raises(ValueError, match="overlap"):
        codec.decode_batch(blobs, offset, scale, LANES, out=torch.empty(1, 64, 64, dtype=torch.bfloat16).expand(4, 64, 64))
    with pytest.raises(ValueError, match="out"):
        codec.decode_batch(blobs, offset, scale, LANES, out=torch.empty(3, 64, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        codec.encode_batch(x.to(torch.int32), None, None, LANES)
    with pytest.raises(ValueError, match="start"):
        codec.decode_range(blobs[0], 5, 2, offset[0], scale[0], config=LANES)
    assert "coder" not in CodecConfig(coder="ans").to_dict()
    assert CodecConfig.from_dict(LANES.to_dict()) == LANES


def test_truncated_and_extended(batch):
    _x, offset, scale, blobs = batch
    b = blobs[1]
    for cut in (len(b) - 1, len(b) - 4, len(b) // 2, 30, 10, 3, 0):
        with pytest.raises(CorruptStreamError):
            codec.decode(b[:cut], offset[1], scale[1], config=LANES)
    for extra in (b"\0", b"\0\0\0\0", b"\x01\x02\x03\x04\x05\x06\x07\x08"):
        with pytest.raises(CorruptStreamError):
            codec.decode(b + extra, offset[1], scale[1], config=LANES)


def test_every_payload_word_is_guarded(batch):
    """Each payload byte flipped (one at a time): always an error, never other values."""
    _x, offset, scale, blobs = batch
    b = blobs[2]
    start = L.parse_header(b).data_start
    for pos in range(start, len(b), 3):
        bad = bytearray(b)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptStreamError):
            codec.decode(bytes(bad), offset[2], scale[2], config=LANES)


def test_header_fields_are_guarded(batch):
    """Every header bit flipped, with and without the header CRC recomputed: an error, or (a shape that
    still fits) never different values."""
    x, offset, scale, blobs = batch
    b = blobs[0]
    end = L.parse_header(b).data_start
    for bit in range(end * 8):
        bad = bytearray(b)
        bad[bit // 8] ^= 1 << (bit % 8)
        for blob in (bytes(bad), reseal(bytes(bad))):
            try:
                y = codec.decode(blob, offset[0], scale[0], config=LANES)
            except CorruptStreamError:
                continue
            assert_bit_exact(y, x[0])


@pytest.mark.parametrize("with_std", [True, False], ids=["std", "sigma-code"])
def test_batch_header_check_agrees_with_parsing_each(batch, with_std):
    """The compiled header check of a batch (`jit.check_headers`) against parsing every header on its own: for
    every bit of a later stream's header flipped, with and without its CRC recomputed, it either hands the
    batch to the per-stream parse (which then raises, or finds a layout the check does not take) or gives
    exactly the fields that parse gives."""
    x, offset, _scale, blobs = batch
    if not with_std:
        blobs = codec.encode_batch(x, offset, None, LANES)
    end = L.parse_header(blobs[2]).data_start
    fast_count = 0
    for bit in range(end * 8):
        bad = bytearray(blobs[2])
        bad[bit // 8] ^= 1 << (bit % 8)
        for blob in (bytes(bad), reseal(bytes(bad))):
            group = [blobs[0], blobs[1], blob, blobs[3]]
            sizes = np.array([len(b) for b in group], dtype=np.int64)
            fast = L._headers_like_first(group, sizes, L.parse_header(group[0]))
            try:
                slow = L._headers_one_by_one(group, sizes)
            except (CorruptStreamError, ValueError):
                assert fast is None
                continue
            if fast is not None:
                fast_count += 1
                for name, u, v in zip(L.Headers._fields, fast, slow):
                    assert np.array_equal(u, v), name
    assert fast_count > 0  # resealed flips of the digest, fp, check and lane bits stay on the fast path
    sizes = np.array([len(b) for b in blobs], dtype=np.int64)
    fast = L._headers_like_first(blobs, sizes, L.parse_header(blobs[0]))
    assert fast is not None
    for u, v in zip(fast, L._headers_one_by_one(blobs, sizes)):
        assert np.array_equal(u, v)


def test_huge_shape_claim_refused_before_allocating():
    """A resealed header claiming 2^50 elements fails on the words-per-element bound, not in allocation."""
    b = codec.encode(torch.zeros(1000, dtype=torch.bfloat16), 0.0, 0.0, LANES)
    assert_bit_exact(codec.decode(b, 0.0, 0.0, config=LANES), torch.zeros(1000, dtype=torch.bfloat16))
    n0 = len(L.varint_bytes(1000))
    bad = reseal(b[:5] + L.varint_bytes(1 << 50) + b[5 + n0 :])
    with pytest.raises(CorruptStreamError, match="cannot fit"):
        codec.decode(bad, 0.0, 0.0, config=LANES)
    big = torch.zeros(1 << 20, dtype=torch.bfloat16)  # the bound leaves room for legitimately tiny streams
    assert_bit_exact(codec.decode(codec.encode(big, 0.0, 0.0, LANES), 0.0, 0.0, config=LANES), big)


def test_verify_mask_skips_only_the_check_hash(batch):
    """``decode_batch(verify=...)``: a stream whose check field is wrong (header CRC resealed) fails where its
    hash is verified and decodes exactly where it is not; the structural checks run either way (a flipped
    payload word still fails unverified, or decodes to the true values)."""
    x, offset, scale, blobs = batch
    n = len(blobs)
    h = L.parse_header(blobs[1])
    bad = bytearray(blobs[1])
    bad[h.data_start - 8] ^= 0x01  # the check field (the last u32 before the header CRC)
    wrong_check = reseal(bytes(bad))
    streams = [blobs[0], wrong_check, *blobs[2:]]
    with pytest.raises(CorruptStreamError, match="checksum"):
        codec.decode_batch(streams, offset, scale, LANES)
    for threads in (1, 2):
        mask = np.ones(n, dtype=bool)
        mask[1] = False
        assert_bit_exact(codec.decode_batch(streams, offset, scale, LANES, threads=threads, verify=mask), x)
        mask[1], mask[0] = True, False
        with pytest.raises(CorruptStreamError, match="checksum"):
            codec.decode_batch(streams, offset, scale, LANES, threads=threads, verify=mask)
    start = L.parse_header(blobs[2]).data_start
    for pos in range(start, len(blobs[2]), 7):
        flipped = bytearray(blobs[2])
        flipped[pos] ^= 0x10
        try:
            y = codec.decode_batch([blobs[0], blobs[1], bytes(flipped), *blobs[3:]], offset, scale, LANES,
                                   verify=False)
        except CorruptStreamError:
            continue
        assert_bit_exact(y, x)
    for wrong in ([True] * (n - 1), np.ones(n, dtype=np.int64), "yes"):
        with pytest.raises(ValueError, match="verify must be a bool"):
            codec.decode_batch(blobs, offset, scale, LANES, verify=wrong)
