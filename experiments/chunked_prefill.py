"""Peak memory and time of a chunked lossy prefill (issue 36; docs/lossy.md, *Chunked prefill*): SmolLM2, one prefill
of ``--context`` tokens of the evaluation split, each setting in a fresh process so that peaks do not mix.

Settings: ``DynamicCache`` in one forward and in chunks of ``--chunk`` tokens; each ``--methods`` lossy cache in one
forward and in chunks (`hf_kvcompress.generation.prefill_in_chunks`, what ``generate(prefill_chunk_size=...)`` does).
Prints per setting: the peak resident-memory growth over the prefill (``VmHWM`` after resetting it, less the RSS
before; everything the prefill allocates: cache, activations, attention scores), the prefill seconds and their ratio
to ``DynamicCache``'s one-shot prefill in the same run, the held bytes at the end, and for lossy caches the summaries'
seconds per chunk (all layers; mean and largest) and their share of the prefill.

    python experiments/chunked_prefill.py --context 8192 --chunk 512 --budget 0.25 --threads 1
    python experiments/chunked_prefill.py --context 4096 --per-chunk      # each chunk's peak and summaries
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.generation import prefill_in_chunks
from hf_kvcompress.models import load_model
from hf_kvcompress_eval.env import PeakMemory


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def one(args: argparse.Namespace) -> dict:
    """One setting, in this process: ``args.one`` is ``dynamic`` or a method name; ``args.chunked`` says how."""
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = token_ids(tokenizer, args.context, split="evaluation")
    if args.one == "dynamic":
        cache = DynamicCache()
    else:
        lossy = LossyConfig(method=args.one, budget=args.budget)
        cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=args.window, lossy=lossy), model=model)
    chunks = []
    with PeakMemory() as peak, torch.inference_mode():
        start = time.perf_counter()
        if args.per_chunk:  # each chunk on its own: its peak (what the allocator kept before it is trimmed first)
            for at in range(0, args.context, args.chunk):
                with PeakMemory() as chunk_peak:
                    prefill_in_chunks(model, ids[:, at : at + args.chunk], cache, args.chunk)
                layers = [layer for layer in cache.layers if getattr(layer, "blocks", None)]
                chunks.append({"peak_mb": chunk_peak.peak_bytes / 1e6, "entries": max(
                    (layer.entries for layer in layers), default=0), "summary_s": sum(
                    layer.summary_seconds[-1] for layer in layers if layer.summary_seconds
                    and len(layer.summary_seconds) == len(chunks) + 1)})
        elif args.chunked:
            prefill_in_chunks(model, ids, cache, args.chunk)
        else:
            model(ids, cache=cache, logits_to_keep=1)
        seconds = time.perf_counter() - start
    out = {"setting": f"{args.one}{' chunked' if args.chunked else ''}", "peak_mb": peak.peak_bytes / 1e6,
           "seconds": seconds, "chunks": chunks}
    if args.one == "dynamic":
        out["held_mb"] = dynamic_bytes(cache) / 1e6
    else:
        stats = cache.stats(per_layer=True)
        out["held_mb"] = stats["held_bytes"] / 1e6
        per_layer = [layer.summary_seconds for layer in cache.layers]
        chunks = max(len(s) for s in per_layer)
        per_chunk = [sum(s[i] for s in per_layer if i < len(s)) for i in range(chunks)]
        out.update(summary_s=sum(per_chunk), chunk_mean_s=sum(per_chunk) / max(chunks, 1),
                   chunk_max_s=max(per_chunk, default=0.0), summaries=chunks)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["summary"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-oneshot-lossy", action="store_true", help="skip the one-shot lossy prefills")
    parser.add_argument("--per-chunk", action="store_true",
                        help="chunked lossy rows only, each chunk measured on its own: its peak, the layers' most "
                             "entries after it, its summaries' seconds")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--chunked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return
    settings = [] if args.per_chunk else [("dynamic", False), ("dynamic", True)]
    for method in args.methods:
        settings += [(method, True)] if args.no_oneshot_lossy or args.per_chunk else [(method, False), (method, True)]
    print(f"SmolLM2 bfloat16, {args.context} tokens, chunks of {args.chunk}, budget {args.budget}, window "
          f"{args.window}, {args.threads} thread(s)")
    print(f"{'setting':<18} {'peak MB':>8} {'held MB':>8} {'prefill s':>9} {'x dyn':>6} {'summ s':>7} "
          f"{'chunk s':>7} {'max s':>6} {'summ %':>6}")
    base = None
    for name, chunked in settings:
        command = [sys.executable, __file__, "--one", name, "--context", str(args.context), "--chunk", str(args.chunk),
                   "--budget", str(args.budget), "--window", str(args.window), "--threads", str(args.threads)]
        flags = (["--chunked"] if chunked else []) + (["--per-chunk"] if args.per_chunk else [])
        run = subprocess.run(command + flags, capture_output=True, text=True, check=True)
        row = json.loads(run.stdout.strip().splitlines()[-1])
        base = base or row["seconds"]
        extra = ""
        if "summary_s" in row:
            extra = (f"{row['summary_s']:>7.2f} {row['chunk_mean_s']:>7.3f} {row['chunk_max_s']:>6.3f} "
                     f"{100 * row['summary_s'] / row['seconds']:>6.1f}")
        print(f"{row['setting']:<18} {row['peak_mb']:>8.1f} {row['held_mb']:>8.2f} {row['seconds']:>9.2f} "
              f"{row['seconds'] / base:>6.2f} {extra}", flush=True)
        for i, chunk in enumerate(row["chunks"]):
            print(f"  chunk {i:>3}: peak {chunk['peak_mb']:7.1f} MB, summaries {chunk['summary_s']:6.2f} s, "
                  f"most entries per layer {chunk['entries']}", flush=True)


if __name__ == "__main__":
    main()
