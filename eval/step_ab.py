"""Decode-step time of lossless caches against DynamicCache, measured in one process with the steps alternating.

`eval/bench_generate.py` runs each configuration's steps back to back; on a shared or drifting machine (this
project's 2-vCPU VM moves by 1.5x within minutes) a ratio from such a run can be off by that much. Here every
cache is built from the same prefill, and step ``i`` runs on every cache before step ``i + 1`` runs on any, so
the drift hits all of them alike. Prints the median wall seconds per step, the ratio to DynamicCache's, and
whether the logits are bit-identical to DynamicCache's (docs/lossless.md, "Codec threads").

    python eval/step_ab.py [--context 2048] [--steps 9] [--threads 1] [--workers 1,2] [--budget 0.05]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--workers", default="1,2", help="LosslessConfig.workers values, comma-separated")
    parser.add_argument("--budget", type=float, default=CompressionConfig().lossless.decoded_budget)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    ids = token_ids(tokenizer, args.context + args.steps, split="evaluation")
    prompt, forced = ids[:, : args.context], ids[:, args.context :]
    with torch.no_grad():
        reference = DynamicCache()
        model(prompt, cache=reference, use_cache=True)
    prefix = [(layer.keys, layer.values) for layer in reference.layers]
    caches: dict[str, object] = {"DynamicCache": DynamicCache()}
    for w in [int(w) for w in args.workers.split(",")]:
        config = CompressionConfig(mode="lossless", lossless={"workers": w, "decoded_budget": args.budget})
        caches[f"lossless workers={w}"] = CompressedCache(config, model=model)
    for cache in caches.values():
        for layer, (k, v) in enumerate(prefix):
            cache.update(k.clone(), v.clone(), layer)
    seconds: dict[str, list[float]] = {name: [] for name in caches}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
    for i in tqdm(range(args.steps), desc="steps"):
        for name, cache in caches.items():
            start = time.perf_counter()
            with torch.no_grad():
                out = model(forced[:, i : i + 1], cache=cache, use_cache=True)
            seconds[name].append(time.perf_counter() - start)
            logits[name].append(out.logits[:, -1].clone())
    base = statistics.median(seconds["DynamicCache"])
    print(f"SmolLM2 bf16, {args.context} tokens, torch threads {args.threads}, {args.steps} steps (medians, wall)")
    for name, values in seconds.items():
        same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(logits[name], logits["DynamicCache"]))
        print(f"{name:22s} {statistics.median(values):.3f} s  x{statistics.median(values) / base:.2f}  "
              f"identical {same}")


if __name__ == "__main__":
    main()
