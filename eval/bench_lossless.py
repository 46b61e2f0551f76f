"""Lossless benchmark: bits per scalar of every predictor on held-out text, their cost against a bf16
prefill, and lossless generation speed against DynamicCache.

    python eval/bench_lossless.py [--calibration DIR] [--tokens 2048] [--out results/lossless]

Every number is measured in this run: each predictor's file is written with `CompressedCache.save`, read
back with `CompressedCache.load` and checked bit for bit against the original K/V.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.persist import read_header, reproducibility, stream_bytes
from hf_kvcompress.calibration import Calibration, library_versions
from hf_kvcompress.cli import default_calibration_dir
from hf_kvcompress.data import token_ids
from hf_kvcompress.generation import greedy_generate
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors import make_predictor

PREDICTORS = [("generic", None), ("none", None), ("context", None), ("probe", 8), ("probe", 15), ("probe", 22),
              ("twin", None)]


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", default=None, help="calibration folder (default: the model's)")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens to code")
    parser.add_argument("--offset", type=int, default=4096, help="where in the evaluation text they start")
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--gen-prompt", type=int, default=300)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--out", default="results/lossless")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_model()
    folder = Path(args.calibration) if args.calibration else default_calibration_dir(model)
    calibration = Calibration.load(folder, model)
    ids = token_ids(tokenizer, args.tokens, split="evaluation", offset=args.offset)
    config = CompressionConfig(mode="none", block_tokens=args.block_tokens, residual_tokens=0)

    with torch.inference_mode():
        prefill_s = best_of(lambda: model(ids, cache=DynamicCache()))
    caches = {}
    for calibrated in (False, True):
        cache = CompressedCache(config, model=model, calibration=calibration if calibrated else None)
        with torch.inference_mode():
            model(ids, cache=cache)
        caches[calibrated] = cache
    layers = caches[True].kv_layers()
    scalars_per_layer_kind = layers[0].keys.numel()

    rows = []
    for name, k in tqdm(PREDICTORS, desc="predictors"):
        label = name if k is None else f"{name} k={k}"
        calibrated = name != "generic"
        cache = caches[calibrated]
        pred_name = "context" if name == "generic" else name
        path = out / f"{label.replace(' ', '_').replace('=', '')}.kvc"
        predictor = make_predictor(pred_name, calibration=cache.calibration, model=model, probe_layer=k or 8)
        rerun_s = 0.0
        if not predictor.practical_in_generation:
            rerun_s = best_of(lambda p=predictor: p.model_extras(ids), repeats=2)
        start = time.perf_counter()
        cache.save(path, predictor=pred_name, probe_layer=k)
        save_s = time.perf_counter() - start
        start = time.perf_counter()
        loaded = CompressedCache.load(path, model=model, calibration=cache.calibration,
                                      config=CompressionConfig(mode="none", block_tokens=args.block_tokens,
                                                               residual_tokens=0))
        load_s = time.perf_counter() - start
        exact = all(same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
                    for a, b in zip(cache.kv_layers(), loaded.kv_layers()))
        header = read_header(path)
        per_layer = stream_bytes(header)
        file_bytes = path.stat().st_size
        k_bits = [8 * layer["k"] / scalars_per_layer_kind for layer in per_layer]
        v_bits = [8 * layer["v"] / scalars_per_layer_kind for layer in per_layer]
        all_bits = 8 * file_bytes / (2 * scalars_per_layer_kind * len(per_layer))
        rows.append({
            "predictor": label,
            "k_bits": sum(k_bits) / len(k_bits),
            "v_bits": sum(v_bits) / len(v_bits),
            "all_bits_with_headers": all_bits,
            "ratio": 16.0 / all_bits,
            "rerun_fraction_of_prefill": rerun_s / prefill_s,
            "save_s": save_s,
            "load_s": load_s,
            "bit_exact": exact,
            "file_bytes": file_bytes,
            "per_layer_k": k_bits,
            "per_layer_v": v_bits,
        })
        path.unlink()

    print(f"\nSmolLM2-135M bf16, {args.tokens} held-out tokens (evaluation split, offset {args.offset}), "
          f"{len(layers)} layers, bf16 prefill {prefill_s:.2f} s; bits per scalar (16 = raw bf16)")
    print(f"{'predictor':>12} {'K':>6} {'V':>6} {'all*':>6} {'ratio':>6} {'rerun/prefill':>13} {'save s':>7} "
          f"{'load s':>7} exact")
    for r in rows:
        print(f"{r['predictor']:>12} {r['k_bits']:6.3f} {r['v_bits']:6.3f} {r['all_bits_with_headers']:6.3f} "
              f"{r['ratio']:6.3f} {r['rerun_fraction_of_prefill']:13.3f} {r['save_s']:7.1f} {r['load_s']:7.1f} "
              f"{r['bit_exact']}")
    print("  * whole file: streams, std scales, side data, header with token ids")
    print("\nper layer, K/V bits per scalar:")
    print("layer " + " ".join(f"{r['predictor']:>13}" for r in rows))
    for i in range(len(layers)):
        print(f"{i:>5} " + " ".join(f"{r['per_layer_k'][i]:6.2f}/{r['per_layer_v'][i]:<6.2f}" for r in rows))

    generation = None
    if not args.skip_generation:
        prompt = token_ids(tokenizer, args.gen_prompt, split="evaluation", offset=args.offset)
        lossless_config = CompressionConfig(mode="lossless", block_tokens=128, residual_tokens=64)
        ref = greedy_generate(model, prompt, DynamicCache(), args.gen_tokens, progress="DynamicCache")
        cache = CompressedCache(lossless_config, model=model, calibration=calibration)
        run = greedy_generate(model, prompt, cache, args.gen_tokens, progress="lossless (context)")
        stats = cache.stats()
        generation = {
            "prompt_tokens": args.gen_prompt,
            "new_tokens": args.gen_tokens,
            "dynamic_tokens_per_s": ref.tokens_per_second,
            "lossless_tokens_per_s": run.tokens_per_second,
            "identical": bool(torch.equal(ref.sequences, run.sequences)),
            "lossless_bits_per_scalar": stats["bits_per_scalar"],
            "lossless_ratio": stats["compression_ratio"],
        }
        print(f"\ngeneration, {args.gen_prompt}-token prompt + {args.gen_tokens} tokens: DynamicCache "
              f"{ref.tokens_per_second:.2f} tok/s, lossless {run.tokens_per_second:.2f} tok/s "
              f"(identical: {generation['identical']}, cache {stats['bits_per_scalar']:.2f} bits/scalar incl. the "
              f"raw residual, ratio {stats['compression_ratio']:.2f})")

    result = {
        "tokens": args.tokens, "offset": args.offset, "block_tokens": args.block_tokens, "prefill_s": prefill_s,
        "rows": rows, "generation": generation, "calibration": calibration.meta["text"],
        "versions": library_versions(), "machine": {**reproducibility(), "platform": platform.platform()},
    }
    (out / "lossless.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "lossless_bits_per_layer.png")
    print(f"\nwrote {out / 'lossless.json'} and {out / 'lossless_bits_per_layer.png'}")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in rows:
        for ax, key in zip(axes, ("per_layer_k", "per_layer_v")):
            ax.plot(r[key], marker=".", label=r["predictor"])
    for ax, title in zip(axes, ("keys", "values")):
        ax.set_title(f"{title}: coded bits per scalar by layer")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bits / scalar (16 = raw bf16)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
