"""Fuzz: thousands of bit flips, truncations and resealed (CRC-valid) corruptions of real streams. Every
case must decode bit-exactly or raise CorruptStreamError, each within a time bound."""

from __future__ import annotations

import os
import time
import zlib

import numpy as np
import pytest
import torch
from codec_testutil import assert_bit_exact, realistic, reseal

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError

TIME_BOUND_S = 2.0  # per case; a clean decode of these streams takes a few milliseconds


def _streams():
    x, offset, scale = realistic((1, 2, 48, 64), seed=3)
    x32, o32, s32 = realistic((1, 1, 40, 64), seed=4, dtype=torch.float32)
    x16, o16, _s16 = realistic((1, 1, 40, 64), seed=5, dtype=torch.float16)
    small = dict(short_tokens=0, tier_windows=(64, 256, 1024), probe=64)
    return [
        ("bf16-fixed-stats", x, offset, scale, CodecConfig(fixed_window=512)),
        ("bf16-fixed-none", x, None, None, CodecConfig(fixed_window=1024)),
        ("bf16-metadata", x, offset, scale, CodecConfig(window="metadata", **small)),
        ("bf16-predicted", x, offset, scale, CodecConfig(window="predicted", **small)),
        ("bf16-causal-none", x, None, None, CodecConfig(window="causal", **small)),
        ("f32-fixed", x32, o32, s32, CodecConfig(fixed_window=256)),
        ("f16-metadata-meanonly", x16, o16, None, CodecConfig(window="metadata", **small)),
        ("bf16-compact-stats", x, offset, scale, CodecConfig(header="compact", fixed_window=65536, mean_steps=4)),
        ("bf16-compact-none-2win", x, None, None, CodecConfig(header="compact", fixed_window=3072)),
        ("f32-compact-metadata", x32, o32, s32, CodecConfig(header="compact", window="metadata", **small)),
        ("f16-compact-causal", x16, o16, None, CodecConfig(header="compact", window="causal", **small)),
        ("bf16-lanes-stats", x, offset, scale, CodecConfig(coder="lanes")),
        ("bf16-lanes-none", x, None, None, CodecConfig(coder="lanes", mean_steps=4)),
        ("f32-lanes", x32, o32, s32, CodecConfig(coder="lanes")),
        ("f16-lanes-meanonly", x16, o16, None, CodecConfig(coder="lanes")),
        ("bf16-lanes-elementwise", x, x.float() * 0.5, scale, CodecConfig(coder="lanes")),
    ]


STREAMS = _streams()


def _check(blob, x, mean, std, cfg, rng):
    t0 = time.perf_counter()
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
    elapsed = time.perf_counter() - t0
    assert elapsed < TIME_BOUND_S, f"case took {elapsed:.2f}s"
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
        cfg = CodecConfig(coder="lanes") if prefix == 3 else CodecConfig(header="compact")
        with pytest.raises(CorruptStreamError):
            codec.decode(blob, config=cfg if rng.random() < 0.8 else None)
