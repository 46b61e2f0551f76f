"""What binding stored K/V to their tokens costs (issue 37; docs/prefix_store.md "Trust").

SmolLM2-135M-Instruct bf16 (the embedded model), held-out Shakespeare, one torch thread, prefixes of 2,048 and
8,192 tokens stored in a `PrefixStore` (generic). Per repetition, interleaved: the prefill of the prefix
(`DynamicCache`, the reference), `first_kv` (the embeddings and layer 0's K and V projections: what the binding
recomputes), and `cache_for` of the prefix + 64 tokens three ways: as it is (the hit's blocks decoded once and
layer 0 bound), without the binding's forward, and adopting only (the lookup before issue 37). Medians, as
fractions of the prefill. Writes ``results/store_binding/results.json``.

    python experiments/store_binding.py [--prefixes 2048,8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from transformers import DynamicCache

from hf_kvcompress import PrefixStore
from hf_kvcompress.cache import chunks as chunks_module
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors.rerun import first_kv


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(model, ids: torch.Tensor, prefix: int, root: str, repeats: int) -> dict[str, float]:
    """Median seconds of each step (module docstring) over ``repeats`` interleaved runs after a warm-up."""
    runs: dict[str, list[float]] = {}

    def lookup() -> None:
        PrefixStore(model, path=root).cache_for(ids)

    for _ in range(repeats + 1):
        with torch.no_grad():
            times = {"prefill": timed(lambda: model(ids[:, :prefix], cache=DynamicCache())),
                     "first_keys": timed(lambda: first_kv(model, ids[:, :prefix])),
                     "cache_for": timed(lookup)}
        with mock.patch.object(chunks_module, "binding_problem", lambda *a, **k: None):
            times["unbound"] = timed(lookup)
        with mock.patch.object(chunks_module.Chunks, "first_bad", lambda *a, **k: None):
            times["adopt_only"] = timed(lookup)
        for name, seconds in times.items():
            runs.setdefault(name, []).append(seconds)
    return {name: statistics.median(values[1:]) for name, values in runs.items()}  # the first: a warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    out = {"model": "SmolLM2-135M-Instruct bf16", "threads": 1, "prefixes": {}}
    for prefix in (int(p) for p in args.prefixes.split(",")):
        ids = token_ids(tokenizer, prefix + 64, split="evaluation", offset=3000)
        with tempfile.TemporaryDirectory() as root:
            store = PrefixStore(model, path=root)
            cache = DynamicCache()
            with torch.no_grad():
                model(ids[:, :prefix], cache=cache)
            store.put(ids[:, :prefix], cache)
            medians = measure(model, ids, prefix, root, args.repeats)
        out["prefixes"][prefix] = {"seconds": medians, "x_prefill": {n: medians[n] / medians["prefill"] for n in medians}}
        print(prefix, {n: round(v, 4) for n, v in out["prefixes"][prefix]["x_prefill"].items()}, flush=True)
    folder = Path("results/store_binding")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
