"""Lossless generation on a CUDA device against DynamicCache, prepared to run in one short device session (issue 53):
SmolLM2-135M at 8k-32k tokens, per context and coder: the median decode step as a multiple of DynamicCache's, the
bytes held as a fraction of DynamicCache's, whether the teacher-forced tokens' logits (hence the greedy tokens)
are bit-identical, and each coder's decode speed on the device (GB/s of decoded K/V: one layer's sealed blocks,
encoded on the host, decoded by `codec.decode_batch` into a tensor on the device: the Triton decoder there; for
huff and mhuff also the host's share of it, parsing, checks and decode tables).

    python experiments/device_generate.py [--contexts 8192,16384,32768] [--steps 8] [--coders huff,lanes,mhuff]
        [--budget 0.05] [--json PATH]
    python experiments/device_generate.py --dry-run   # seconds, on the CPU with the tiny random model (CI)

Budget: ~4 minutes on one H100 for the default arguments (prefill, host encoding of every block, 8 steps per
cache; the ``--max-seconds`` guard, 420 s, skips the contexts left when it runs out and says so). The dry run checks
that the script runs (tests/evaluation/test_device_generate.py); its numbers mean nothing. Step times are
wall-clock medians with the device synchronised around each step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_kvcompress import CompressedCache, CompressionConfig, codec
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress_eval.bench.common import workload
from hf_kvcompress_eval.bench.generate import fill

#: the lossless caches measured: the generation default (generic: coder chosen automatically, huff) and lanes
CACHE_CODERS = ("auto", "lanes")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steps(model, cache, tokens: torch.Tensor, device: torch.device) -> tuple[list[float], list[torch.Tensor]]:
    """Teacher-forced decode steps: (wall seconds, last-position logits) per step."""
    times, logits = [], []
    for i in range(tokens.shape[1]):
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(tokens[:, i : i + 1], cache=cache, use_cache=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        logits.append(out.logits[:, -1].clone())
    return times, logits


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def decode_speed(layer_kv: tuple[torch.Tensor, torch.Tensor], coder: str, block_tokens: int, repeats: int,
                 device: torch.device) -> dict:
    """One layer's K/V as the cache's streams (a head's block ``[dim, tokens]``, per-channel statistics), encoded on
    the host, decoded into a tensor on ``device`` ``repeats`` times: decoded GB/s (median), bits per scalar."""
    k, v = layer_kv
    x = torch.cat([k, v], 1)[0].cpu()  # [2 * heads, tokens, dim]
    t = (x.shape[1] // block_tokens) * block_tokens
    x = x[:, :t].reshape(x.shape[0], -1, block_tokens, x.shape[-1]).permute(1, 0, 3, 2)  # [blocks, 2h, dim, tok]
    x = x.reshape(-1, x.shape[-2], block_tokens).contiguous()
    mean = x.float().mean(-1, keepdim=True)
    std = x.float().std(-1, keepdim=True) + 1e-6
    cfg = CodecConfig(coder=coder)
    blobs = codec.encode_batch(x, mean, std, cfg)
    mean_d, std_d = mean.to(device), std.to(device)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    seconds = []
    for i in range(repeats + 1):  # the first one compiles / builds tables: not counted
        _sync(device)
        t0 = time.perf_counter()
        codec.decode_batch(blobs, mean_d, std_d, cfg, out=out, verify=i == 0)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    exact = torch.equal(out.cpu().view(torch.int16), x.view(torch.int16))
    s = statistics.median(seconds[1:])
    return {"coder": coder, "streams": len(blobs), "decoded_MB": x.numel() * x.element_size() / 1e6,
            "seconds": s, "GB_s": x.numel() * x.element_size() / s / 1e9, "host_seconds": host_part(blobs, mean, std,
                                                                                                    coder, repeats),
            "bits_per_scalar": 8 * sum(map(len, blobs)) / x.numel(), "exact": exact}


def host_part(blobs: list[bytes], mean: torch.Tensor, std: torch.Tensor, coder: str, repeats: int) -> float | None:
    """The huff family's host share of a device decode (parsing, checks, contexts, decode tables: what runs before
    the kernel), median seconds; None for other coders."""
    if coder not in ("huff", "mhuff"):
        return None
    from hf_kvcompress.codec.huff_coder import huff, huff_triton, mhuff

    spec = huff.SPEC if coder == "huff" else mhuff.SPEC
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        huff_triton.host_tables(huff.prepare_decode(blobs, mean, std, None, False, spec))
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    work = workload(args.dry_run)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    model = work.model.to(device)
    contexts = [int(c) for c in args.contexts.split(",")]
    result: dict = {"model": work.name, "device": str(device) if device.type == "cpu" else
                    torch.cuda.get_device_name(device), "rows": [], "decode": [], "skipped": []}
    for context in contexts:
        if time.perf_counter() - start > args.max_seconds:
            result["skipped"].append(context)
            print(f"context {context}: skipped (past --max-seconds {args.max_seconds})", flush=True)
            continue
        ids = work.ids(context + args.steps, split="evaluation").to(device)
        prompt, forced = ids[:, :context], ids[:, context:]
        with torch.no_grad():
            reference = DynamicCache()
            model(prompt, cache=reference, use_cache=True)
        prefix = [(layer.keys.clone(), layer.values.clone()) for layer in reference.layers]
        base_times, base_logits = steps(model, reference, forced, device)
        base_step, base_bytes = statistics.median(base_times), dynamic_bytes(reference)
        del reference
        for coder in CACHE_CODERS:
            lossless = {"predictor": "generic", "decoded_budget": args.budget}
            if coder != "auto":
                lossless["coder"] = coder
            config = CompressionConfig(mode="lossless", block_tokens=args.block_tokens, lossless=lossless)
            cache = CompressedCache(config, model=model)
            t0 = time.perf_counter()
            fill(cache, prefix)
            fill_s = time.perf_counter() - t0
            times, logits = steps(model, cache, forced, device)
            row = {"context": context, "coder": cache.config.lossless.coder, "auto": cache.config.lossless.coder_auto,
                   "step_s": statistics.median(times), "dynamic_step_s": base_step,
                   "step_x": statistics.median(times) / base_step, "held_x": cache.stats()["held_bytes"] / base_bytes,
                   "fill_s": fill_s,
                   "identical": all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                    for a, b in zip(base_logits, logits))}
            result["rows"].append(row)
            print(f"context {context} {row['coder']}{' (auto)' if row['auto'] else ''}: step {row['step_s']:.4f} s = "
                  f"{row['step_x']:.2f}x DynamicCache ({base_step:.4f} s), held {row['held_x']:.3f}x, "
                  f"identical {row['identical']}, fill {fill_s:.1f} s", flush=True)
            del cache
        for coder in args.coders.split(","):
            r = decode_speed(prefix[len(prefix) // 2], coder, args.block_tokens, args.repeats, device)
            r["context"] = context
            result["decode"].append(r)
            print(f"context {context} decode {coder}: {r['streams']} streams, {r['decoded_MB']:.1f} MB in "
                  f"{r['seconds'] * 1e3:.2f} ms = {r['GB_s']:.2f} GB/s"
                  + ("" if r["host_seconds"] is None else f" (host share {r['host_seconds'] * 1e3:.2f} ms)")
                  + f", {r['bits_per_scalar']:.3f} bits/scalar, exact {r['exact']}", flush=True)
        del prefix
    result["seconds"] = time.perf_counter() - start
    print(f"done in {result['seconds']:.0f} s")
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="8192,16384,32768")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--coders", default="huff,lanes,mhuff", help="the coders whose device decode is timed")
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--budget", type=float, default=0.05, help="LosslessConfig.decoded_budget")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=420.0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--dry-run", action="store_true", help="the tiny random model on the CPU, small contexts")
    args = p.parse_args(argv)
    if args.dry_run:
        args.contexts, args.steps, args.block_tokens, args.repeats = "48,80", 2, 16, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = all(r["identical"] for r in result["rows"]) and all(r["exact"] for r in result["decode"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
