"""Every byte `save` and the `PrefixStore` write, pinned: cache files of several structures, dtypes, predictors and
coders (NaN payloads, infinities, -0.0 and subnormals among the values) and store chunks (adopted blocks, coded
blocks, keyed) hash as they did at 5325df7, before the container module took their framing. The hash covers the
magic, version, the header (less the fields that name the library version: ``library_version`` of a cache file,
``key`` and ``namespace`` of a chunk, which hash it; and ``reproducibility``, which named the writer's machine in
every file until 2026-12-07) and the payload; the trailing digest is checked to be the SHA-256 (or HMAC) of
everything before it. Each file also loads back bit for bit. The inputs are the same bits on every CPU
(`portable`, `portable_model`, `STORE_KV`), so the pins hold on every CPU: ``ATEN_CPU_CAPABILITY=default`` runs
them as another CPU would (.ci/run)."""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fresh_tiny_model, hybrid_model, random_ids, same_bits, sliding_model
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig, PrefixStore

_PREFIX = struct.Struct("<8sII")
#: the 16-bit patterns planted into every tensor: NaN payloads (quiet, negative, signalling), +-inf, -0.0,
#: subnormals, the largest finite value
_SPECIAL16 = {torch.bfloat16: [0x7FC1, 0xFFA5, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x8003, 0x7F7F],
              torch.float16: [0x7E01, 0xFEA5, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x8003, 0x7BFF]}
_SPECIAL32 = [0x7FC00001, 0xFFA60000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x80000003,
              0x7F7FFFFF]


def portable(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian-like values (an Irwin-Hall sum of 12 uniforms: mean 0, std 1) from integers only, converted exactly:
    the same bits on every CPU. ``torch.randn`` is not: its vectorised kernel gives other bits under AVX2, AVX512
    and plain code (``ATEN_CPU_CAPABILITY=default``), and so do model forwards."""
    rng = np.random.default_rng(seed)
    total = rng.integers(0, 1 << 16, size=(12, *shape), dtype=np.int64).sum(axis=0) - 6 * (1 << 16)
    return torch.from_numpy(total.astype(np.float32) / np.float32(1 << 16)).to(dtype)  # |total| < 2^20: exact


def portable_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose weight matrices (and conv kernels) are `portable` values times 0.02 (a model's
    usual init scale): its identity, recorded in a file's header, is the same on every CPU."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for index, (_name, weight) in enumerate(sorted(model.named_parameters())):
            if weight.dim() >= 2:
                weight.copy_(portable(tuple(weight.shape), torch.float32, 1000 + index) * 0.02)
    return model


def feeding(cache, kv: Callable[[int, str, tuple[int, ...], torch.dtype], torch.Tensor]):
    """``cache`` with its updates (K/V, conv states) given ``kv(layer, what, shape, dtype)`` in place of what the
    model computed (a model's forward gives other bits on another CPU): the model's forward then drives the cache's
    structure (windows, states, token ids) on portable values."""
    update, update_conv = cache.update, getattr(cache, "update_conv_state", None)

    def fed(keys, values, layer_idx, *args, **kwargs):
        return update(kv(layer_idx, "k", tuple(keys.shape), keys.dtype),
                      kv(layer_idx, "v", tuple(values.shape), values.dtype), layer_idx, *args, **kwargs)

    def fed_conv(states, layer_idx, *args, **kwargs):
        return update_conv(kv(layer_idx, "conv", tuple(states.shape), states.dtype), layer_idx, *args, **kwargs)

    cache.update = fed
    if update_conv is not None:
        cache.update_conv_state = fed_conv
    return cache


def synthetic(layer: int, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`portable` values for one update (seeded by layer, part and length)."""
    return portable(shape, dtype, 10_000 * layer + 100 * ("k", "v", "conv").index(what) + shape[-2 if what != "conv" else -1])


def special(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian-like K/V (`portable`) with every special value planted at spread positions."""
    x = portable(shape, dtype, seed).contiguous()
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
        model = portable_model(sliding_model(window, torch.bfloat16))
        cache = CompressedCache(CompressionConfig(block_tokens=8, residual_tokens=4), model=model, calibration=None)
        with torch.no_grad():
            model(random_ids(1, 70, seed=window), cache=feeding(cache, synthetic), use_cache=True)
        for predictor in ("generic", "none"):
            name = f"v4-sliding{window}-{predictor}"
            out[name] = (cache.save(folder / f"{name}.kvc", predictor=predictor), {"kind": "kvc", "kv": None})
    model = portable_model(hybrid_model("lfm2", torch.bfloat16))  # conv states beside attention
    cache = CompressedCache(_config(), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 40, seed=5), cache=feeding(cache, synthetic), use_cache=True)
    out["v4-lfm2-generic"] = (cache.save(folder / "v4-lfm2.kvc"), {"kind": "kvc", "kv": None})
    # the store: blocks adopted from a CompressedCache, blocks coded from a DynamicCache, a keyed store; their K/V
    # are this model's own (`STORE_KV`: layer 0's keys must be what the model computes, `binding`)
    model = portable_model(fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6))
    ids = random_ids(1, 80, seed=9)
    compressed = CompressedCache(_config(), model=model, calibration=None)
    dynamic = DynamicCache(config=model.config)
    pinned = load_file(str(STORE_KV))
    with torch.no_grad():
        model(ids, cache=feeding(compressed, lambda layer, what, *_: pinned[f"L{layer}/{what}"]), use_cache=True)
        model(ids, cache=feeding(dynamic, lambda layer, what, *_: pinned[f"L{layer}/{what}"]), use_cache=True)
    for name, cache, secret in (("adopted", compressed, None), ("coded", dynamic, None),
                                ("keyed", compressed, b"pinned secret")):
        store = PrefixStore(model, path=folder / f"store-{name}", chunk_tokens=32, config=_config(), secret=secret)
        assert store.put(ids, cache) == 64
        for index, key in enumerate(store.keys(ids)):
            out[f"chunk-{name}-{index}"] = (store.folder / f"{key.hex()}.kvp", {"kind": "kvp", "secret": secret})
    return out


def canonical(path: Path, kind: str, secret: bytes | None = None) -> str:
    """The SHA-256 of a file's magic and version, header (less the fields that depend on the library version, and on
    files written before 2026-12-07 the writer's machine) and payload, after checking that its trailing digest covers everything before it."""
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
    lossless = (header.get("config") or {}).get("lossless") or {}
    if lossless.get("save_predictor") == "auto":  # the default since 2026-12-07 (issue 48), "generic" before
        lossless["save_predictor"] = "generic"
    kept = json.dumps(header, separators=(",", ":")).encode()
    # magic and version, not the header's length: it changes with the dropped fields (a longer machine record)
    return hashlib.sha256(data[:12] + kept + data[_PREFIX.size + size : -32]).hexdigest()


#: the K/V the store's chunks hold: `portable_model`'s forward on the 80 ids, computed once (``python
#: tests/cache/test_written_bytes.py store-kv``); its layer-0 keys agree with any CPU's within `binding`'s tolerance
STORE_KV = Path(__file__).resolve().parent / "written_bytes_store_kv.safetensors"
#: `canonical` of every file of `write_files`, measured at 5325df7 on the inputs of then (torch.randn, random model
#: weights and forwards: other bits on another CPU) and again, for the portable inputs of today, on 2026-12-07
#: (the code's bytes unchanged: the commit at 5325df7's files and today's hash alike on the same inputs)
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


def write_store_kv() -> None:
    """`STORE_KV`: the K/V of `portable_model`'s forward on the store's 80 ids (once: a forward's bits depend on
    the CPU)."""
    model = portable_model(fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6))
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(random_ids(1, 80, seed=9), cache=dynamic, use_cache=True)
    save_file({f"L{i}/{part}": getattr(layer, name).contiguous() for i, layer in enumerate(dynamic.layers)
               for part, name in (("k", "keys"), ("v", "values"))}, str(STORE_KV))


if __name__ == "__main__":  # prints the hashes to pin (run at the commit whose bytes are the reference)
    import sys
    import tempfile

    if sys.argv[1:] == ["store-kv"]:
        write_store_kv()
        sys.exit()
    with tempfile.TemporaryDirectory() as folder:
        written = write_files(Path(folder))
        canon = {name: canonical(path, info["kind"], info.get("secret")) for name, (path, info) in written.items()}
        whole = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, (path, _) in written.items()}
    json.dump({"canonical": canon, "whole": whole}, sys.stdout, indent=1, sort_keys=True)
    pytest  # noqa: B018  (imported for the test above)
