"""Decode-step time of lossless caches against DynamicCache, measured in one process with the steps alternating.

`hf-kvcompress bench generate` runs each configuration's steps back to back; on a shared or drifting machine (this
project's 2-vCPU VM moves by 1.5x within minutes) a ratio from such a run can be off by that much. Here every
cache is built from the same prefill, and step ``i`` runs on every cache before step ``i + 1`` runs on any, so
the drift hits all of them alike. Prints the median wall seconds per step, the ratio to DynamicCache's, the
decoded scalars per second above DynamicCache's step, and whether the logits are bit-identical to
DynamicCache's (docs/results/lossless.md, "Codec threads").

``--against REV`` also steps the same caches built by the package as it was at git revision REV, imported
beside this one under another name (the package imports itself only relatively, so a renamed copy is a
second, independent package): a before/after comparison of a change in one process (docs/results/codec.md 12.5).

    python experiments/step_ab.py [--context 2048] [--steps 9] [--threads 1] [--workers 1,2] [--budget 0.05]
                           [--predictor generic] [--against 7b3c3f3]
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

import hf_kvcompress
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model


def package_at(revision: str):
    """``hf_kvcompress`` as it was at git revision ``revision``, imported as ``hf_kvcompress_at_<sha>``."""
    repo = Path(__file__).resolve().parent.parent
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", revision], check=True, capture_output=True,
                         text=True).stdout.strip()
    name = f"hf_kvcompress_at_{sha}"
    archive = subprocess.run(["git", "-C", str(repo), "archive", sha, "hf_kvcompress"], check=True,
                             capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix="step_ab_"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    (root / "hf_kvcompress").rename(root / name)
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--workers", default="1,2", help="LosslessConfig.workers values, comma-separated")
    parser.add_argument("--budget", type=float, default=hf_kvcompress.CompressionConfig().lossless.decoded_budget)
    parser.add_argument("--predictor", default="generic", help="an in-generation predictor without calibration")
    parser.add_argument("--against", default=None, help="a git revision whose package is stepped too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    ids = token_ids(tokenizer, args.context + args.steps, split="evaluation")
    prompt, forced = ids[:, : args.context], ids[:, args.context :]
    with torch.no_grad():
        reference = DynamicCache()
        model(prompt, cache=reference, use_cache=True)
    prefix = [(layer.keys, layer.values) for layer in reference.layers]
    packages = {"": hf_kvcompress}
    if args.against:
        packages[f"{args.against} "] = package_at(args.against)
    caches: dict[str, object] = {"DynamicCache": DynamicCache()}
    for w in [int(w) for w in args.workers.split(",")]:
        for tag, package in packages.items():
            settings = {"workers": w, "decoded_budget": args.budget, "predictor": args.predictor}
            config = package.CompressionConfig(mode="lossless", lossless=settings)
            caches[f"{tag}lossless workers={w}"] = package.CompressedCache(config, model=model)
    for cache in caches.values():
        for layer, (k, v) in enumerate(prefix):
            cache.update(k.clone(), v.clone(), layer)
    seconds: dict[str, list[float]] = {name: [] for name in caches}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
    decoded = dict.fromkeys(caches, 0)
    for i in tqdm(range(args.steps), desc="steps"):
        for name, cache in caches.items():
            lossless = getattr(cache, "lossless", None)  # None: DynamicCache
            before, scalars = (lossless.decodes if lossless is not None else 0), _block_scalars(cache)
            start = time.perf_counter()
            with torch.no_grad():
                out = model(forced[:, i : i + 1], cache=cache, use_cache=True)
            seconds[name].append(time.perf_counter() - start)
            logits[name].append(out.logits[:, -1].clone())
            if lossless is not None:
                decoded[name] += scalars * (lossless.decodes - before)
    base = statistics.median(seconds["DynamicCache"])
    print(f"SmolLM2 bf16, {args.context} tokens, torch threads {args.threads}, {args.steps} steps (medians, wall)")
    for name, values in seconds.items():
        same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(logits[name], logits["DynamicCache"]))
        step = statistics.median(values)
        rate = ""
        if name != "DynamicCache" and step > base:  # the scalars a step decodes: sealed blocks the pool lacks
            per_step = decoded[name] / args.steps
            rate = f"  {per_step / 1e6:.1f} M scalars a step, {per_step / 1e6 / (step - base):.0f} M/s above DynamicCache"
        print(f"{name:32s} {step:.3f} s  x{step / base:.2f}  identical {same}{rate}")


def _block_scalars(cache) -> int:
    """Scalars of one sealed block of ``cache`` (its blocks share a shape), 0 without any."""
    for layer in getattr(cache, "layers", []):
        for block in getattr(layer, "blocks", ()):
            return 2 * block.tokens * len(block.rows) * block.heads * block.dim
    return 0


if __name__ == "__main__":
    main()
