"""What portable statistics cost (docs/lossless.md, "Where a saved file decodes"): save / load of a SmolLM2
lossless cache with the ``context`` predictor, and a model-free 256-token LMCache chunk's encode / decode, this
package against the package at git revision ``--against``, in one process, alternating (the machine's drift hits
both alike). Prints medians, sizes, and checks every round trip bit for bit.

    python eval/portable_ab.py [--tokens 2048] [--rounds 3] [--chunk-rounds 7] [--against 1e368bb]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from step_ab import package_at
from tqdm.auto import tqdm

import hf_kvcompress
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors.runner import run_decoder


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-rounds", type=int, default=7)
    parser.add_argument("--against", default="1e368bb")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    packages = {"this": hf_kvcompress, args.against: package_at(args.against)}
    ids = token_ids(tokenizer, args.tokens, split="evaluation", offset=0)
    caches = {}
    for name, package in packages.items():
        cache = package.CompressedCache(package.CompressionConfig(mode="lossless"), model=model)
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
        caches[name] = cache
    folder = Path(tempfile.mkdtemp(prefix="portable_ab_"))
    times: dict[str, list[float]] = {f"{n} {w}": [] for n in packages for w in ("save", "load")}
    sizes = {}
    for _ in tqdm(range(args.rounds), desc="save / load"):
        for name, package in packages.items():
            path = folder / f"{name}.kvc"
            start = time.perf_counter()
            caches[name].save(path)
            times[f"{name} save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            back = package.CompressedCache.load(path, model=model)
            times[f"{name} load"].append(time.perf_counter() - start)
            sizes[name] = path.stat().st_size
            assert all(_same(a.keys, b.keys) and _same(a.values, b.values)
                       for a, b in zip(caches[name].layers, back.layers)), f"{name}: load not bit-exact"
    scalars = sum(layer.keys.numel() * 2 for layer in caches["this"].layers)
    print(f"SmolLM2 bf16, {args.tokens} tokens, context predictor, {args.rounds} rounds, medians (wall)")
    for key, values in times.items():
        print(f"  {key:24s} {statistics.median(values):7.2f} s")
    for name, size in sizes.items():
        print(f"  {name:24s} {size} bytes, {8 * size / scalars:.4f} bits/scalar")

    cache, _ = run_decoder(model, token_ids(tokenizer, 512, split="evaluation", offset=2000))
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    layers, heads, tokens, dim = keys.shape
    chunk = torch.stack([keys, values]).permute(0, 1, 3, 2, 4).reshape(2, layers, tokens, heads * dim)
    chunk = chunk[:, :, 256:512].contiguous()
    coders = {name: importlib.import_module(package.__name__ + ".integrations.kv_chunk").ChunkCoder()
              for name, package in packages.items()}
    payloads = {name: coder.encode(chunk) for name, coder in coders.items()}
    chunk_times: dict[str, list[float]] = {f"{n} {w}": [] for n in coders for w in ("encode", "decode")}
    for _ in tqdm(range(args.chunk_rounds), desc="chunks"):
        for name, coder in coders.items():
            start = time.perf_counter()
            coder.encode(chunk)
            chunk_times[f"{name} encode"].append(time.perf_counter() - start)
            start = time.perf_counter()
            out = coder.decode(payloads[name])
            chunk_times[f"{name} decode"].append(time.perf_counter() - start)
            assert _same(out, chunk), f"{name}: chunk not bit-exact"
    print(f"model-free 256-token chunk, {args.chunk_rounds} rounds, medians (wall)")
    for key, values in chunk_times.items():
        print(f"  {key:24s} {statistics.median(values):7.3f} s")
    for name, payload in payloads.items():
        print(f"  {name:24s} {len(payload)} bytes")


if __name__ == "__main__":
    main()
