"""Fuzz: thousands of bit flips, truncations and resealed (CRC-valid) corruptions of real streams. Every
case must decode bit-exactly or raise CorruptStreamError (a case that hung would hang the run: no wall-clock bound
here, which failed on busy machines; timing belongs in eval/). Resealed headers too:
nested config JSON, other shapes, windows spliced in from another stream or position (`decode_range`)."""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from codec_testutil import as_version1, assert_bit_exact, realistic, rebuild, reseal, window_payloads

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError
from hf_kvcompress.codec.ans_coder.layout import FULL_BODY, FULL_PREFIX, MAGIC, write_compact, write_stream
from hf_kvcompress.codec.ans_coder.streams import Decoder


def _streams():
    x, offset, scale = realistic((1, 2, 48, 64), seed=3)
    x32, o32, s32 = realistic((1, 1, 40, 64), seed=4, dtype=torch.float32)
    x16, o16, _s16 = realistic((1, 1, 40, 64), seed=5, dtype=torch.float16)
    small = dict(short_tokens=0, tier_windows=(64, 256, 1024), probe=64)
    return [
        ("bf16-fixed-stats", x, offset, scale, CodecConfig(coder="ans", fixed_window=512)),
        ("bf16-fixed-none", x, None, None, CodecConfig(coder="ans", fixed_window=1024)),
        ("bf16-metadata", x, offset, scale, CodecConfig(coder="ans", window="metadata", **small)),
        ("bf16-predicted", x, offset, scale, CodecConfig(coder="ans", window="predicted", **small)),
        ("bf16-causal-none", x, None, None, CodecConfig(coder="ans", window="causal", **small)),
        ("f32-fixed", x32, o32, s32, CodecConfig(coder="ans", fixed_window=256)),
        ("f16-metadata-meanonly", x16, o16, None, CodecConfig(coder="ans", window="metadata", **small)),
        ("bf16-compact-stats", x, offset, scale, CodecConfig(coder="ans", header="compact", fixed_window=65536, mean_steps=4)),
        ("bf16-compact-none-2win", x, None, None, CodecConfig(coder="ans", header="compact", fixed_window=3072)),
        ("f32-compact-metadata", x32, o32, s32, CodecConfig(coder="ans", header="compact", window="metadata", **small)),
        ("f16-compact-causal", x16, o16, None, CodecConfig(coder="ans", header="compact", window="causal", **small)),
        ("bf16-lanes-stats", x, offset, scale, CodecConfig(coder="lanes")),
        ("bf16-lanes-none", x, None, None, CodecConfig(coder="lanes", mean_steps=4)),
        ("f32-lanes", x32, o32, s32, CodecConfig(coder="lanes")),
        ("f16-lanes-meanonly", x16, o16, None, CodecConfig(coder="lanes")),
        ("bf16-lanes-elementwise", x, x.float() * 0.5, scale, CodecConfig(coder="lanes")),
    ]


STREAMS = _streams()
#: the constriction (`ans`) layouts: their header and window-table forgeries below; lanes streams have their own
#: (one window, no table) in test_codec_lanes.py
ANS_STREAMS = [s for s in STREAMS if s[4].coder == "ans"]


def _check(blob, x, mean, std, cfg, rng):
    # full streams: with and without their config; compact and lanes streams need it
    config = cfg if cfg.header == "compact" or cfg.coder == "lanes" or rng.random() < 0.5 else None
    try:
        if rng.random() < 0.25:
            n = x.numel()
            a = int(rng.integers(0, n))
            out = codec.decode_range(blob, a, n, mean, std, config=config)
            assert_bit_exact(out, x.reshape(-1)[a:])
        else:
            assert_bit_exact(codec.decode(blob, mean, std, config=config), x)
        outcome = "exact"
    except CorruptStreamError:
        outcome = "error"
    except ValueError as err:
        # a resealed header may claim fewer elements than the range asked for: refusing the range is right
        if "need 0 <= start <= stop" not in str(err):
            raise
        outcome = "error"
    return outcome


@pytest.mark.parametrize(("name", "x", "mean", "std", "cfg"), STREAMS, ids=[s[0] for s in STREAMS])
def test_fuzz_bit_flips_and_truncations(name, x, mean, std, cfg):
    blob = codec.encode(x, mean, std, cfg)
    assert_bit_exact(codec.decode(blob, mean, std, config=cfg), x)
    # a stable seed (str hashes change per process); FUZZ_SEED explores other cases by hand
    rng = np.random.default_rng(zlib.crc32(name.encode()) + int(os.environ.get("FUZZ_SEED", "0")))
    outcomes = {"exact": 0, "error": 0}
    n = len(blob)
    for _ in range(600):
        kind = rng.integers(0, 6)
        b = bytearray(blob)
        if kind == 0:  # 1..4 random bit flips anywhere
            for pos in rng.integers(0, n * 8, rng.integers(1, 5)):
                b[pos // 8] ^= 1 << (pos % 8)
        elif kind == 1:  # truncation
            b = b[: rng.integers(0, n)]
        elif kind == 2:  # flips in the payload, CRCs recomputed: exercises the decoder proper
            for pos in rng.integers(n // 2 * 8, n * 8, rng.integers(1, 4)):
                b[pos // 8] ^= 1 << (pos % 8)
            b = bytearray(reseal(bytes(b)))
        elif kind == 3:  # flips in header / window table, CRCs recomputed: exercises the parser
            head = 64 if cfg.header == "compact" or cfg.coder == "lanes" else 400
            for pos in rng.integers(0, min(n, head) * 8, rng.integers(1, 3)):
                b[pos // 8] ^= 1 << (pos % 8)
            b = bytearray(reseal(bytes(b)))
        elif kind == 4:  # random bytes appended or inserted
            at = int(rng.integers(0, n + 1))
            b[at:at] = rng.integers(0, 256, rng.integers(1, 9), dtype=np.uint8).tobytes()
        else:  # a random slice of bytes overwritten
            at = int(rng.integers(0, n))
            k = int(rng.integers(1, 16))
            b[at : at + k] = rng.integers(0, 256, len(b[at : at + k]), dtype=np.uint8).tobytes()
        outcomes[_check(bytes(b), x, mean, std, cfg, rng)] += 1
    assert outcomes["error"] > 0


def test_fuzz_random_inputs_never_crash():
    rng = np.random.default_rng(7)
    for _ in range(300):
        blob = rng.integers(0, 256, rng.integers(0, 400), dtype=np.uint8).tobytes()
        prefix = rng.integers(0, 4)
        if prefix == 1:
            blob = b"\x89KVCdc\r\n" + blob
        elif prefix == 2:  # compact magic and version, then garbage
            blob = b"\x89Kc\x01" + blob
        elif prefix == 3:  # lanes magic, then garbage
            blob = b"\x89KL" + blob
        cfg = CodecConfig(coder="lanes") if prefix == 3 else CodecConfig(coder="ans", header="compact")
        with pytest.raises(CorruptStreamError):
            codec.decode(blob, config=cfg if rng.random() < 0.8 else None)


# ------------------------------------------------------------------ resealed headers: every CRC recomputed


def _with_config_json(blob: bytes, cfg_json: bytes) -> bytes:
    """A full-layout stream whose config JSON is replaced, lengths and header CRC fixed up."""
    _magic, version, reserved, body_len = FULL_PREFIX.unpack_from(blob, 0)
    head_end = FULL_PREFIX.size + body_len
    ndim = blob[FULL_PREFIX.size + 1]
    cfg_at = FULL_PREFIX.size + FULL_BODY.size + 8 * ndim
    old_len = struct.unpack_from("<I", blob, cfg_at)[0]
    body = blob[FULL_PREFIX.size : cfg_at] + struct.pack("<I", len(cfg_json)) + cfg_json
    head = FULL_PREFIX.pack(MAGIC, version, reserved, len(body)) + body
    assert cfg_at + 4 + old_len == head_end
    return head + struct.pack("<I", zlib.crc32(head)) + blob[head_end + 4 :]


@pytest.mark.parametrize("cfg_json", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"0" + b"}" * 50_000,
                                      b"[]", b"null", b'{"window":{"window":{}}}', b"\xff"])
def test_resealed_config_json_is_refused(cfg_json):
    x, offset, scale = realistic((1, 1, 16, 64), seed=8)
    blob = codec.encode(x, offset, scale, CodecConfig(coder="ans", fixed_window=512))
    with pytest.raises(CorruptStreamError, match="config"):
        codec.decode(_with_config_json(blob, cfg_json), offset, scale)


SHAPE_EDITS = {
    "permuted": lambda s: s[::-1],
    "leading 1": lambda s: (1, *s),
    "dim doubled": lambda s: (*s[:-1], 2 * s[-1]),
    "dim halved": lambda s: (*s[:-1], s[-1] // 2),
    "zero": lambda s: (*s[:-1], 0),
    "flat": lambda s: (int(np.prod(s)),),
    "huge": lambda s: (*s[:-1], 1 << 40),
}


@pytest.mark.parametrize(("name", "x", "mean", "std", "cfg"), ANS_STREAMS, ids=[s[0] for s in ANS_STREAMS])
def test_resealed_shapes(name, x, mean, std, cfg):
    """A header resealed with another shape: refused, or (no mean/std to pin the shape) the same bits in
    the shape claimed. Never other values."""
    blob = codec.encode(x, mean, std, cfg)
    header = Decoder(blob, mean, std, None, cfg).h
    config = cfg if cfg.header == "compact" else None
    for edit, change in SHAPE_EDITS.items():
        forged = _with_header(blob, mean, std, cfg, replace(header, shape=tuple(change(header.shape))))
        try:
            out = codec.decode(forged, mean, std, config=config)
        except CorruptStreamError:
            continue
        assert mean is None and std is None, f"{edit}: decoded despite stats pinning the shape"
        assert_bit_exact(out.reshape(-1), x.reshape(-1))


def _with_header(blob, mean, std, cfg, header) -> bytes:
    """``blob`` re-serialised under ``header`` (every CRC but the window CRCs recomputed)."""
    d = Decoder(blob, mean, std, None, cfg)
    return (write_compact if d.h.compact else write_stream)(header, d.entries.copy(), window_payloads(d))


SPLICEABLE = [s for s in ANS_STREAMS if s[4].window == "fixed" and s[1].numel() > s[4].fixed_window]


@pytest.mark.parametrize(("name", "x", "mean", "std", "cfg"), SPLICEABLE, ids=[s[0] for s in SPLICEABLE])
@pytest.mark.parametrize("version", [2, 1])
def test_window_splices_are_refused_by_decode_range(name, x, mean, std, cfg, version):
    """A window (table entry and payload) taken from a sibling stream with the same mean/std, or from
    another position of the same stream, framing CRCs recomputed: `decode_range` over it refuses it, as
    `decode` does; ranges that avoid it decode exactly."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    sibling = (x.float() + torch.randn(x.shape, generator=g) * x.float().std() * 0.1).to(x.dtype)
    blobs = [codec.encode(t, mean, std, cfg) for t in (x, sibling)]
    if version == 1:
        blobs = [as_version1(b, t, mean, std, cfg) for b, t in zip(blobs, (x, sibling))]
    a, b = (Decoder(blob, mean, std, None, cfg) for blob in blobs)
    full = cfg.fixed_window
    n = x.numel()
    rng = np.random.default_rng(zlib.crc32(name.encode()) + version)
    config = cfg if cfg.header == "compact" else None
    full_windows = np.flatnonzero(a.lengths == full)
    for _ in range(6):
        w = int(rng.choice(full_windows))
        others = full_windows[full_windows != w]
        donor, source = (b, w) if rng.random() < 0.5 or not others.size else (a, int(rng.choice(others)))
        entries, payloads = a.entries.copy(), window_payloads(a)
        entries[w] = donor.entries[source]
        payloads[w] = window_payloads(donor)[source]
        forged = rebuild(blobs[0], mean, std, cfg, entries=entries, payloads=payloads, version=version)
        if donor is a and payloads[w] == window_payloads(a)[w]:
            continue  # two identical windows: nothing was changed
        with pytest.raises(CorruptStreamError):
            codec.decode(forged, mean, std, config=config)
        lo = w * full + int(rng.integers(0, full))
        with pytest.raises(CorruptStreamError):
            codec.decode_range(forged, lo, min(n, lo + int(rng.integers(1, 2 * full))), mean, std, config=config)
        if version == 2 and w + 1 < a.lengths.size:  # a range after the splice is unaffected
            start = (w + 1) * full
            assert_bit_exact(codec.decode_range(forged, start, n, mean, std, config=config), x.reshape(-1)[start:])


@pytest.mark.parametrize("coder", sorted(codec.CODERS))
def test_meta_tensors_are_a_clear_error(coder):
    cfg = CodecConfig(coder=coder)
    x = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        codec.encode(x, config=cfg)
    with pytest.raises(ValueError, match="meta device"):
        codec.encode_batch(x[None], config=cfg)
    real = torch.randn(4, 8).bfloat16()
    with pytest.raises(ValueError, match="meta device"):
        codec.encode(real, torch.empty(4, 8, device="meta"), 1.0, cfg)
    blob = codec.encode(real, torch.zeros(4, 8), 1.0, cfg)
    with pytest.raises(ValueError, match="meta device"):
        codec.decode(blob, torch.empty(4, 8, device="meta"), 1.0, config=cfg)
