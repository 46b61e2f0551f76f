"""Lossless generation side by side with DynamicCache: time per decode step, bytes held, bits/scalar, peak RSS.

For each context length the prompt is prefilled once with `DynamicCache`; every configuration then starts
from a copy of that K/V (a lossless cache codes it as it goes in, as at a prefill), runs the same
teacher-forced decode steps (DynamicCache's greedy tokens) and must give bit-identical logits. Per
configuration: the median seconds per decode step (wall clock, and this thread's CPU time, which other
processes on a shared machine do not inflate) and their ratios to DynamicCache's in the same run, the
block decodes per step, bytes held (an independent walk of the cache's tensors and bytes, and
``stats()['held_bytes']``), their ratio to DynamicCache's, bits per scalar of the sealed part, and the peak
RSS during the decode steps above the RSS before the cache was built (cache and step transients; the
building's own peak is recorded in the JSON) against DynamicCache's.

    hf-kvcompress bench generate [--contexts 512,2048,8192] [--steps 5] [--budgets 0,0.05,0.5]
        [--predictors generic,framed,self,none,context] [--coders huff,lanes] [--calibration-tokens 2048] [--out DIR]

Writes bench_generate.json, bench_generate.md and bench_generate.png.

Predictors (default: every one that `LosslessConfig` accepts for generation, from the predictor registry):
``generic`` (the in-generation default: per-block channel statistics as side data, no calibration), ``framed``
(generic with key statistics in a pre-RoPE frame the encoder picks per block), ``self`` (generic plus key maps
from the layer below fitted on the cache's own blocks, no calibration), ``none`` and ``context`` with a calibration
fitted here on ``--calibration-tokens`` of the calibration plays (context heads read the two layers below).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.predictors.registry import FITTED, NAMES, STORAGE_ONLY

from ..env import PeakMemory, machine, versions, walk_held_bytes
from .common import out_folder, workload

#: the predictors a cache may generate with, the default first (the rest in registry order)
IN_GENERATION = ("generic", *(n for n in NAMES if n not in STORAGE_ONLY and n != "generic"))
#: those that read a calibration fitted here (the model-free ones need none)
CALIBRATED = tuple(n for n in IN_GENERATION if n in FITTED)


def _calibrated_predictor(cache):
    """The predictor, when it only holds a calibration (walked as the model's, not the cache's); None for ``self``,
    whose fitted state is the cache's."""
    predictor = getattr(getattr(cache, "lossless", None), "predictor", None)
    return None if predictor is None or predictor.name == "self" else predictor


def fill(cache, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in enumerate(prefix):
        cache.update(k.clone(), v.clone(), layer)


def run_steps(model, cache, tokens: torch.Tensor) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Teacher-forced decode steps: (wall seconds, this thread's CPU seconds, logits) per step. Everything runs
    on this thread (torch and the codec on one thread each), so CPU seconds do not count the time other
    processes on a shared machine take from it."""
    times, cpu, logits = [], [], []
    for i in range(tokens.shape[1]):
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            out = model(tokens[:, i : i + 1], cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        logits.append(out.logits[:, -1].clone())
    return times, cpu, logits


def measure(model, name: str, make_cache, prefix, tokens, reference_logits) -> tuple[dict, list]:
    gc.collect()
    with PeakMemory() as build:
        cache = make_cache()
        t0 = time.perf_counter()
        fill(cache, prefix)
        fill_seconds = time.perf_counter() - t0
    decodes0 = cache.lossless.decodes if isinstance(cache, CompressedCache) and cache.lossless else 0
    with PeakMemory() as steps:  # resets the high-water mark: the steps' own peak, cache included
        times, cpu, logits = run_steps(model, cache, tokens)
    growth = None
    if build.start is not None and steps.start is not None and steps.peak_bytes is not None:
        growth = steps.start * 1024 + steps.peak_bytes - build.start * 1024  # above the RSS before the cache
    row = {
        "config": name,
        "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpu),
        "steps": len(times),
        "fill_s": fill_seconds,
        "fill_peak_rss_growth": build.peak_bytes,
        "peak_rss_growth": growth,
        # the calibration's loaded heads are walked: stats() counts them (a calibration shared by several caches
        # in one process, as here, is counted by each)
        "walk_bytes": walk_held_bytes(cache, skip=[getattr(cache, "model_config", None),
                                                   _calibrated_predictor(cache)]),
    }
    if isinstance(cache, CompressedCache):
        stats = cache.stats()
        sealed_bits = [8.0 * sum(b.nbytes() for b in layer.blocks) for layer in cache.kv_layers()]
        sealed_scalars = [sum(2 * b.tokens * b.heads * b.dim * len(b.rows) for b in layer.blocks)
                          for layer in cache.kv_layers()]
        row.update(held_bytes=stats["held_bytes"], decoded_bytes=stats["decoded_bytes"],
                   bits_per_scalar=stats["bits_per_scalar"],
                   sealed_bits_per_scalar=sum(sealed_bits) / max(1, sum(sealed_scalars)),
                   decodes_per_step=(cache.lossless.decodes - decodes0) / len(times) if cache.lossless else 0)
    else:
        row.update(held_bytes=row["walk_bytes"], decoded_bytes=0, bits_per_scalar=16.0,
                   sealed_bits_per_scalar=16.0, decodes_per_step=0)
    if reference_logits is not None:
        row["identical"] = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                               for a, b in zip(reference_logits, logits))
    del cache
    return row, logits


def run(args: argparse.Namespace) -> int:
    out = out_folder(args, "generate")
    work = workload(args.smoke)
    model = work.model
    predictors = list(IN_GENERATION) if args.predictors == "all" else args.predictors.split(",")
    calibration = None
    if any(p in CALIBRATED for p in predictors):
        folder = out / f"calibration-{args.calibration_tokens}"
        if (folder / "calibration.json").exists():
            calibration = Calibration.load(folder, model)
        else:
            t0 = time.perf_counter()
            calibration = work.fit_calibration(args.calibration_tokens, min(512, args.calibration_tokens // 2),
                                               CALIBRATED)
            calibration.save(folder)
            print(f"calibration ({', '.join(CALIBRATED)}) on {args.calibration_tokens} tokens: {time.perf_counter() - t0:.0f} s")
    warm_up(model, args.coders.split(","))
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        ids = work.ids(context + args.steps, split="evaluation")
        prompt, forced = ids[:, :context], ids[:, context:]
        with torch.no_grad():
            reference = DynamicCache()
            model(prompt, cache=reference, use_cache=True)
        prefix = [(layer.keys.clone(), layer.values.clone()) for layer in reference.layers]
        del reference
        configs = [("DynamicCache", DynamicCache)]
        for predictor in predictors:
            for coder in args.coders.split(","):
                for budget in [float(b) for b in args.budgets.split(",")]:
                    config = CompressionConfig(
                        mode="lossless", block_tokens=args.block_tokens, residual_tokens=args.residual_tokens,
                        lossless={"predictor": predictor, "decoded_budget": budget, "coder": coder,
                                  **({} if args.workers is None else {"workers": args.workers})})
                    cal = calibration if predictor in CALIBRATED else None
                    configs.append((f"{predictor} {coder} budget={budget:g}",
                                    lambda config=config, cal=cal: CompressedCache(config, model=model,
                                                                                   calibration=cal)))
        reference_logits, base = None, None
        for name, make in tqdm(configs, desc=f"context {context}"):
            row, logits = measure(model, name, make, prefix, forced, reference_logits)
            if reference_logits is None:
                reference_logits, base = logits, row
            row.update(context=context, step_ratio=row["step_s"] / base["step_s"],
                       cpu_ratio=row["step_cpu_s"] / base["step_cpu_s"],
                       held_ratio=row["held_bytes"] / base["held_bytes"],
                       rss_ratio=(row["peak_rss_growth"] / base["peak_rss_growth"]
                                  if row["peak_rss_growth"] and base["peak_rss_growth"] else None))
            rows.append(row)
            print(format_row(row), flush=True)
    result = {"model": work.name, "rows": rows, "args": vars(args), "versions": versions(), "machine": machine()}
    (out / "bench_generate.json").write_text(json.dumps(result, indent=1))
    (out / "bench_generate.md").write_text(table(rows) + "\n")
    plot(rows, out / "bench_generate.png", work.name)
    print("\n" + table(rows))
    print(f"\nwrote {out / 'bench_generate.json'}, bench_generate.md and bench_generate.png")
    return 0


def warm_up(model, coders: list[str]) -> None:
    """Build the codec's tables and compile what compiles once per process, outside every measurement."""
    for coder in coders:
        config = CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=0, lossless={"coder": coder})
        cache = CompressedCache(config, model=model, calibration=None)
        with torch.no_grad():
            model(torch.arange(3, 40).unsqueeze(0), cache=cache, use_cache=True)
            model(torch.tensor([[5]]), cache=cache, use_cache=True)


HEADER = ("| context | config | step s | x Dynamic | step CPU s | x Dynamic | decodes/step | held MB (walk) | held MB (stats) | x Dynamic "
          "| decoded MB | bits/scalar (sealed) | peak RSS MB | x Dynamic | identical |")


def format_row(r: dict) -> str:
    mb = 1 / 2**20
    rss = "-" if r["peak_rss_growth"] is None else f"{r['peak_rss_growth'] * mb:.0f}"
    rss_ratio = "-" if r["rss_ratio"] is None else f"{r['rss_ratio']:.2f}"
    return (f"| {r['context']} | {r['config']} | {r['step_s']:.3f} | {r['step_ratio']:.2f} | "
            f"{r['step_cpu_s']:.3f} | {r['cpu_ratio']:.2f} | "
            f"{r['decodes_per_step']:.0f} | {r['walk_bytes'] * mb:.1f} | {r['held_bytes'] * mb:.1f} | "
            f"{r['held_ratio']:.3f} | {r['decoded_bytes'] * mb:.1f} | {r['bits_per_scalar']:.2f} "
            f"({r['sealed_bits_per_scalar']:.2f}) | {rss} | {rss_ratio} | {r.get('identical', '-')} |")


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER, "|" + " ---: |" * (HEADER.count("|") - 1), *map(format_row, rows)])


def plot(rows: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for context in sorted({r["context"] for r in rows}):
        sub = [r for r in rows if r["context"] == context]
        ax.scatter([r["held_ratio"] for r in sub], [r["cpu_ratio"] for r in sub], label=f"{context} tokens")
        for r in sub:
            ax.annotate(r["config"].replace("budget=", "b="), (r["held_ratio"], r["cpu_ratio"]), fontsize=6)
    ax.set_xlabel("bytes held / DynamicCache's")
    ax.set_ylabel("decode step CPU time / DynamicCache's")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Lossless generation: step time against memory ({model}, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

