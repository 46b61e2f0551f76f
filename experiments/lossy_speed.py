"""Prefill time and memory of lossy mode against `DynamicCache` (docs/lossy.md, *Speed and queries*): SmolLM2, one prefill of ``--context``
tokens of the evaluation split; the lossy cache summarises right after each layer's attention.

Prints, per method: prefill seconds (best of ``--repeat``), the ratio to `DynamicCache`'s prefill, seconds spent in
summaries (all layers) and ``stats()["held_bytes"]`` against the bytes `DynamicCache` holds.

    python experiments/lossy_speed.py                       # 2,048 tokens, budget 0.3, summary and Top-K
    python experiments/lossy_speed.py --profile summary     # also cProfile one lossy prefill (top 25 by own time)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, make) -> tuple[float, object]:
    cache = make()
    start = time.perf_counter()
    model(ids, cache=cache, logits_to_keep=1)
    return time.perf_counter() - start, cache


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--methods", nargs="+", default=["summary", "topk"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--profile", choices=["summary", "topk"], help="cProfile one lossy prefill of this method")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    ids = token_ids(tokenizer, args.context, split="evaluation")
    full_s, full_cache = min((prefill(model, ids, DynamicCache) for _ in range(args.repeat)), key=lambda r: r[0])
    full_bytes = dynamic_bytes(full_cache)
    print(f"SmolLM2 {args.dtype}, {args.context} tokens, {args.threads} thread(s), budget {args.budget}")
    print(f"{'method':<10} {'prefill s':>9} {'x Dynamic':>9} {'summary s':>9} {'held MB':>8} {'x Dynamic':>9}")
    print(f"{'dynamic':<10} {full_s:>9.2f} {1.0:>9.2f} {0.0:>9.2f} {full_bytes / 1e6:>8.2f} {1.0:>9.3f}")
    for method in args.methods:
        config = CompressionConfig(mode="lossy", residual_tokens=args.window,
                                   lossy=LossyConfig(method=method, budget=args.budget))

        def make(config=config):
            return CompressedCache(config, model=model)

        runs = [prefill(model, ids, make) for _ in range(args.repeat)]
        seconds, cache = min(runs, key=lambda r: r[0])
        try:
            stats = cache.stats(per_layer=True)
        except TypeError:  # the code before that page's speed work (248945f, comparison runs): per-layer stats from the layers
            stats = cache.stats()
            stats["per_layer"] = [layer.stats() for layer in cache.layers]
        if "held_bytes" not in stats:  # a version before that speed work (comparison runs): K/V plus the query buffers
            stats["held_bytes"] = stats["stored_bytes"] + sum(s.get("query_bytes", 0) for s in stats["per_layer"])
        summary_s = sum(s["summary_seconds"] for s in stats["per_layer"])
        print(f"{method:<10} {seconds:>9.2f} {seconds / full_s:>9.2f} {summary_s:>9.2f} "
              f"{stats['held_bytes'] / 1e6:>8.2f} {stats['held_bytes'] / full_bytes:>9.3f}")
        del cache, runs
    if args.profile:
        config = CompressionConfig(mode="lossy", residual_tokens=args.window,
                                   lossy=LossyConfig(method=args.profile, budget=args.budget))
        profiler = cProfile.Profile()
        profiler.enable()
        prefill(model, ids, lambda: CompressedCache(config, model=model))
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
