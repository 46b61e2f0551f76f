"""Every byte `save` and the `PrefixStore` write, pinned: cache files of several structures, dtypes, predictors and
coders (NaN payloads, infinities, -0.0 and subnormals among the values) and store chunks (adopted blocks, coded
blocks, keyed) hash as they did at 5325df7, before the container module took their framing. The hash covers the
prefix, the header (less the fields that name this machine or library version: ``library_version`` and
``reproducibility`` of a cache file, ``key`` and ``namespace`` of a chunk, which hash the library version) and the
payload; the trailing digest is checked to be the SHA-256 (or HMAC) of everything before it. Each file also
loads back bit for bit."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import fresh_tiny_model, hybrid_model, random_ids, same_bits, sliding_model
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig, PrefixStore

_PREFIX = struct.Struct("<8sII")
#: the 16-bit patterns planted into every tensor: NaN payloads (quiet, negative, signalling), +-inf, -0.0,
#: subnormals, the largest finite value
_SPECIAL16 = {torch.bfloat16: [0x7FC1, 0xFFA5, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x8003, 0x7F7F],
              torch.float16: [0x7E01, 0xFEA5, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x8003, 0x7BFF]}
_SPECIAL32 = [0x7FC00001, 0xFFA60000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x80000003,
              0x7F7FFFFF]


def special(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian K/V with every special value planted at spread positions."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).contiguous()
    bits = x.view(torch.int32 if dtype == torch.float32 else torch.int16).view(-1)
    patterns, width = (_SPECIAL32, 32) if dtype == torch.float32 else (_SPECIAL16[dtype], 16)
    for i, pattern in enumerate(patterns):  # as the signed integers the bits view holds
        bits[(i * 7919 + seed) % bits.numel()] = pattern - (1 << width if pattern >> (width - 1) else 0)
    return x


def _filled(config: CompressionConfig, dtype: torch.dtype, layers: int = 6, rows: int = 2, tokens: int = 70,
            model_config=None) -> tuple[CompressedCache, list[tuple[torch.Tensor, torch.Tensor]]]:
    cache = CompressedCache(config, model_config=model_config, calibration=None)
    kv = []
    for layer in range(layers):
        keys, values = special((rows, 2, tokens, 16), dtype, 2 * layer), special((rows, 2, tokens, 16), dtype,
                                                                                   2 * layer + 1)
        cache.update(keys, values, layer)
        kv.append((keys, values))
    return cache, kv


def _config(coder: str | None = None, predictor: str = "generic") -> CompressionConfig:
    return CompressionConfig(block_tokens=16, residual_tokens=16,
                             lossless=LosslessConfig(predictor=predictor, coder=coder, workers=1))


def write_files(folder: Path) -> dict[str, tuple[Path, dict]]:
    """Every file of the pinned set: name -> (path, what it is: kind, secret, the K/V it holds per layer)."""
    out: dict[str, tuple[Path, dict]] = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tag = str(dtype).replace("torch.", "")
        for coder in ("huff", "lanes"):
            cache, kv = _filled(_config(coder), dtype)
            # 'framed' pinned with float16 only: at 5325df7 it refused the largest finite bf16 / fp32 values (an
            # infinite std); it codes them since 2026-12-04 (tests/cache/test_extreme_values.py), the pins stay
            for predictor in ("generic", "none", "self") + (("framed",) if dtype == torch.float16 else ()):
                name = f"v3-{tag}-{coder}-{predictor}"
                out[name] = (cache.save(folder / f"{name}.kvc", predictor=predictor), {"kind": "kvc", "kv": kv})
    # version 4: sliding windows beside full attention (a window that seals blocks and one that stays raw)
    for window in (48, 12):
        model = sliding_model(window, torch.bfloat16)
        cache = CompressedCache(CompressionConfig(block_tokens=8, residual_tokens=4), model=model, calibration=None)
        with torch.no_grad():
            model(random_ids(1, 70, seed=window), cache=cache, use_cache=True)
        for predictor in ("generic", "none"):
            name = f"v4-sliding{window}-{predictor}"
            out[name] = (cache.save(folder / f"{name}.kvc", predictor=predictor), {"kind": "kvc", "kv": None})
    model = hybrid_model("lfm2", torch.bfloat16)  # conv states beside attention
    cache = CompressedCache(_config(), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 40, seed=5), cache=cache, use_cache=True)
    out["v4-lfm2-generic"] = (cache.save(folder / "v4-lfm2.kvc"), {"kind": "kvc", "kv": None})
    # the store: blocks adopted from a CompressedCache, blocks coded from a DynamicCache, a keyed store
    model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6)
    ids = random_ids(1, 80, seed=9)
    compressed = CompressedCache(_config(), model=model, calibration=None)
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=compressed, use_cache=True)
        model(ids, cache=dynamic, use_cache=True)
    for name, cache, secret in (("adopted", compressed, None), ("coded", dynamic, None),
                                ("keyed", compressed, b"pinned secret")):
        store = PrefixStore(model, path=folder / f"store-{name}", chunk_tokens=32, config=_config(), secret=secret)
        assert store.put(ids, cache) == 64
        for index, key in enumerate(store.keys(ids)):
            out[f"chunk-{name}-{index}"] = (store.folder / f"{key.hex()}.kvp", {"kind": "kvp", "secret": secret})
    return out


def canonical(path: Path, kind: str, secret: bytes | None = None) -> str:
    """The SHA-256 of a file's prefix, header (less the fields that depend on this machine or library version)
    and payload, after checking that its trailing digest covers everything before it."""
    data = path.read_bytes()
    body, digest = data[:-32], data[-32:]
    want = hashlib.sha256(body).digest() if secret is None else hmac.new(secret, body, hashlib.sha256).digest()
    assert digest == want, f"{path.name}: the trailing digest is not over the file"
    _magic, _version, size = _PREFIX.unpack_from(data)
    header = json.loads(data[_PREFIX.size : _PREFIX.size + size])
    dropped = ("library_version", "reproducibility") if kind == "kvc" else ("key", "namespace")
    for field in dropped:
        assert field in header
        header[field] = None
    kept = json.dumps(header, separators=(",", ":")).encode()
    return hashlib.sha256(data[: _PREFIX.size] + kept + data[_PREFIX.size + size : -32]).hexdigest()


#: `canonical` of every file of `write_files`, measured at 5325df7 (tests/cache/test_written_bytes.py)
PINNED = json.loads((Path(__file__).resolve().parent / "written_bytes.json").read_text()) \
    if (Path(__file__).resolve().parent / "written_bytes.json").exists() else {}


def test_save_and_store_write_the_pinned_bytes_and_load_them_back(tmp_path):
    files = write_files(tmp_path)
    got = {name: canonical(path, info["kind"], info.get("secret")) for name, (path, info) in files.items()}
    assert set(got) == set(PINNED)
    assert {name: h for name, h in got.items() if PINNED[name] != h} == {}
    for name, (path, info) in files.items():
        if info["kind"] == "kvc" and info["kv"] is not None:
            loaded = CompressedCache.load(path)
            for layer, (keys, values) in enumerate(info["kv"]):
                held = loaded.layer(layer)
                assert same_bits(held.keys, keys) and same_bits(held.values, values), name


if __name__ == "__main__":  # prints the hashes to pin (run at the commit whose bytes are the reference)
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        written = write_files(Path(folder))
        canon = {name: canonical(path, info["kind"], info.get("secret")) for name, (path, info) in written.items()}
        whole = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, (path, _) in written.items()}
    json.dump({"canonical": canon, "whole": whole}, sys.stdout, indent=1, sort_keys=True)
    pytest  # noqa: B018  (imported for the test above)
