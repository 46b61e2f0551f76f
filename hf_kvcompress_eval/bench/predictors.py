"""The rate / speed frontier of every in-generation predictor, side by side in one run (issue 34).

SmolLM2-135M-Instruct bf16, held-out Shakespeare (evaluation split), torch and the codec on ``--threads`` threads.
Each calibrated predictor's heads are fitted as a first use fits them (`calibration.FIRST_USE_TOKENS` of the
calibration split in chunks of `FIRST_USE_CHUNK`), one fit per predictor (its CPU seconds), saved and loaded back
(as the first use does: the heads are read from the file when first used). The prompt of ``--tokens`` tokens is
prefilled once with `DynamicCache`; every predictor's cache is filled from a copy of that K/V. Per predictor:

- ``bits``: bits per scalar of the sealed blocks generation holds (streams, scale bytes and side data; the heads
  apart, in ``heads MB``: what `stats()` counts of them, fp16);
- ``file bits``: a `save(predictor=...)` file of the same cache (its portable coding, header included);
- ``step x``: the median of ``--steps`` teacher-forced decode steps over ``generic``'s (round robin over the
  predictors, so that a busy machine slows all alike), the tokens and every logit checked equal (int views) to
  DynamicCache's;
- ``load x``: `CompressedCache.load` of the file plus one decode step (where its blocks are decoded), over
  ``generic``'s, medians of ``--repeats`` interleaved runs; the loaded cache checked bit for bit;
- ``step CPU x`` / ``load CPU x``: the same over the process's CPU seconds (every thread of it: torch's and the
  codec's), which other processes on a shared machine inflate far less than the wall clock;
- ``held x``: ``stats()['held_bytes']`` after the steps over DynamicCache's bytes, at ``--tokens`` and, for
  ``--held-predictors``, at ``--held-tokens`` (the heads included).

An entry ``name:coder`` codes that predictor's generation blocks with ``coder`` (`LosslessConfig.coder`; a bare name
takes the config's default for it), so one run sets coders side by side (``below:huff,below:lanes``).

    hf-kvcompress bench predictors [--predictors generic,none,context,below,below:huff] [--tokens 2048] [--steps 5]
        [--repeats 3] [--held-tokens 8192] [--held-predictors generic,below] [--threads 1] [--out ...]

Writes results.json and frontier.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import FIRST_USE_CHUNK, FIRST_USE_TOKENS, Calibration
from hf_kvcompress.layer.storage import storage_bytes
from hf_kvcompress.predictors.registry import FITTED, head_set

from ..env import machine, versions
from .common import Workload, out_folder, workload
from .generate import IN_GENERATION, fill, run_steps


def run(args: argparse.Namespace) -> int:
    if args.fit_tokens is None:  # the options leave it open: FIRST_USE_TOKENS lives in the calibration module
        args.fit_tokens = FIRST_USE_TOKENS
    from hf_kvcompress.errors import CliError

    names = args.predictors.split(",")
    held_names = args.held_predictors.split(",") if args.held_tokens else []
    if names[0] != "generic" or {predictor_of(n) for n in names + held_names} - set(IN_GENERATION):
        raise CliError(f"--predictors: generic first, then names from {list(IN_GENERATION)}, each optionally "
                       "name:coder (--held-predictors too)")
    torch.set_num_threads(args.threads)
    out = out_folder(args, "predictors")
    work = workload(args.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        # one fit per head set (``grid`` reads ``below``'s: `registry.head_set`)
        fitted = list(dict.fromkeys(head_set(n) for n in (predictor_of(n) for n in names + held_names) if n in FITTED))
        folder, fits = fit_heads(work, fitted, args, Path(tmp))

        def calibration(name: str) -> Calibration | None:
            """A fresh load per cache (its held bytes count what it reads), None for a model-free predictor."""
            return Calibration.load(folder, work.model) if predictor_of(name) in FITTED else None

        rows = frontier(work, names, calibration, args, Path(tmp))
        for name, row in rows.items():
            row.update(fits.get(head_set(predictor_of(name)), {}))
        (out / "results.json").write_text(json.dumps({"rows": rows, "partial": True}, indent=1))  # before the held run
        held = held_ratios(work, held_names, calibration, args.held_tokens, args) if held_names else {}
    result = {"model": f"{work.name} bf16", "tokens": args.tokens, "threads": args.threads, "steps": args.steps,
              "repeats": args.repeats, "held_tokens": args.held_tokens, "machine": machine(), "versions": versions(),
              "rows": rows, "held": held, "smoke": args.smoke}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (out / "frontier.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'results.json'} and {out / 'frontier.md'}")
    return 0


def fit_heads(work: Workload, names: list[str], args, tmp: Path) -> tuple[Path | None, dict[str, dict]]:
    """One first-use fit per calibrated predictor (CPU seconds, heads bytes), merged and saved (its folder)."""
    merged, fits = None, {}
    chunk = min(FIRST_USE_CHUNK, args.fit_tokens)
    ids = work.ids(args.fit_tokens, split="calibration")
    for name in names:
        started = time.process_time()
        fitted = Calibration.fit(work.model, None, ids=ids, tokens=args.fit_tokens, chunk=chunk, predictors=(name,),
                                 progress=False)
        heads = sum(t.numel() * t.element_size() for key, t in fitted.tensors.items() if key.startswith(f"{name}/"))
        fits[name] = {"fit_cpu_s": time.process_time() - started, "heads_bytes": heads}
        merged = fitted if merged is None else merged.with_heads_of(fitted)
    if merged is None:
        return None, fits
    merged.save(tmp / "calibration")
    return tmp / "calibration", fits


def predictor_of(entry: str) -> str:
    """The predictor of a ``--predictors`` entry (``name`` or ``name:coder``)."""
    return entry.split(":")[0]


def config(entry: str, args) -> CompressionConfig:
    """The cache's config of a ``--predictors`` entry: ``name:coder`` sets `LosslessConfig.coder`."""
    name, _, coder = entry.partition(":")
    lossless = {"predictor": name, **({"coder": coder} if coder else {})}
    return CompressionConfig(mode="lossless", block_tokens=args.block_tokens, lossless=lossless)


def prefilled(model, ids: torch.Tensor) -> tuple[list, DynamicCache]:
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=reference, use_cache=True)
    return [(layer.keys, layer.values) for layer in reference.layers], reference


def frontier(work: Workload, names: list[str], calibration, args, tmp: Path) -> dict[str, dict]:
    model = work.model
    ids = work.ids(args.tokens + args.steps + 1, split="evaluation")
    prompt, tokens = ids[:, : args.tokens], ids[:, args.tokens : args.tokens + args.steps]
    prefix, reference = prefilled(model, prompt)
    _, _, expected = run_steps(model, reference, tokens)
    caches, rows = {}, {}
    for name in names:
        cache = CompressedCache(config(name, args), model=model, calibration=calibration(name))
        fill(cache, prefix)
        caches[name] = cache
        scalars = sum(len(b.rows) * b.heads * b.tokens * (b.dim + b.value_dim) for layer in cache.kv_layers()
                      for b in layer.blocks)
        rows[name] = {"bits": 8.0 * sum(b.nbytes() for layer in cache.kv_layers() for b in layer.blocks) / scalars,
                      "step_s": [], "load_s": [], "step_cpu_s": [], "load_cpu_s": [], "identical": True}
        path = cache.save(tmp / f"{name}.kvc", predictor=predictor_of(name))
        rows[name]["file_bits"] = 8.0 * path.stat().st_size / scalars
    for i in range(args.steps):  # round robin: each step of each predictor beside the others'
        for name in names:
            cpu = time.process_time()
            times, _, logits = run_steps(model, caches[name], tokens[:, i : i + 1])
            rows[name]["step_cpu_s"].append(time.process_time() - cpu)
            rows[name]["step_s"].append(times[0])
            rows[name]["identical"] &= torch.equal(logits[0].view(torch.int32), expected[i].view(torch.int32))
    for name in names:
        stats = caches[name].stats()
        rows[name]["held_ratio"] = stats["held_bytes"] / stats["raw_bytes"]
    del caches
    for _ in range(args.repeats):
        for name in names:
            start, cpu = time.perf_counter(), time.process_time()
            loaded = CompressedCache.load(tmp / f"{name}.kvc", model=model, calibration=calibration(name))
            _, _, logits = run_steps(model, loaded, tokens[:, :1])
            rows[name]["load_s"].append(time.perf_counter() - start)
            rows[name]["load_cpu_s"].append(time.process_time() - cpu)
            rows[name]["identical"] &= torch.equal(logits[0].view(torch.int32), expected[0].view(torch.int32))
    for key in ("step", "load", "step_cpu", "load_cpu"):
        base = statistics.median(rows["generic"][f"{key}_s"])
        for row in rows.values():
            row[f"{key}_ratio"] = statistics.median(row[f"{key}_s"]) / base
    return rows


def held_ratios(work: Workload, names: list[str], calibration, tokens: int, args) -> dict[str, dict]:
    """Per predictor: ``held_bytes`` of a cache of ``tokens`` prompt tokens (one decode step taken) over
    DynamicCache's bytes (``ratio``), and its parts (`held_parts`, bytes)."""
    ids = work.ids(tokens + 1, split="evaluation")
    prefix, _ = prefilled(work.model, ids[:, :tokens])
    out = {}
    for name in names:
        cache = CompressedCache(config(name, args), model=work.model, calibration=calibration(name))
        fill(cache, prefix)
        run_steps(work.model, cache, ids[:, tokens:])
        stats = cache.stats(per_layer=True)
        out[name] = {"ratio": stats["held_bytes"] / stats["raw_bytes"], "raw_bytes": stats["raw_bytes"],
                     "held_bytes": stats["held_bytes"], "parts": held_parts(cache, stats)}
        del cache
    return out


def held_parts(cache: CompressedCache, stats: dict) -> dict[str, int]:
    """``stats()['held_bytes']`` of a lossless cache split by what holds it: sealed blocks (streams, scale bytes,
    side data), residual buffers, the decoded pool, the chain memo (with a decode started ahead), the predictor's
    state (its heads; its RoPE cos / sin tables apart), the calibration's marginals the codec reads and the rest of the
    calibration's tensors in memory, the token ids; ``other`` is what the parts leave of ``held_bytes`` (0 when they
    cover it)."""
    coding = cache.lossless
    frame = getattr(coding.predictor, "frame", None)
    rope = storage_bytes(frame.tensors()) if frame is not None else 0
    parts = {
        "streams": sum(b.nbytes() for layer in cache.kv_layers() for b in layer.blocks),
        "residual": sum(s["residual_bytes"] for s in stats["per_layer"]),
        "decoded pool": storage_bytes(coding.pool.tensors()),
        "chain memo": storage_bytes(coding.chain_tensors()) + coding.ahead_bytes(),
        "heads": storage_bytes(coding.predictor.state_tensors()) - rope,
        "rope tables": rope,
        "marginals": storage_bytes(coding.marginal_tensors()),
        "token ids": stats["token_ids_bytes"],
    }
    parts["calibration, other"] = stats["calibration_bytes"] - parts["marginals"]
    parts["other"] = stats["held_bytes"] - sum(parts.values())
    return parts


def table(result: dict) -> str:
    lines = [f"{result['model']}, {result['tokens']} tokens, {result['threads']} thread(s); step: median of "
             f"{result['steps']}, load: median of {result['repeats']} (load + one step); ratios to generic's",
             "| predictor | bits | file bits | step x | load x | step CPU x | load CPU x | held x | fit CPU-s | heads MB "
             "| exact |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in result["rows"].items():
        fit = f"{r['fit_cpu_s']:.1f}" if "fit_cpu_s" in r else "-"
        heads = f"{r['heads_bytes'] / 1e6:.1f}" if "heads_bytes" in r else "-"
        lines.append(f"| {name} | {r['bits']:.3f} | {r['file_bits']:.3f} | {r['step_ratio']:.2f} | "
                     f"{r['load_ratio']:.2f} | {r['step_cpu_ratio']:.2f} | {r['load_cpu_ratio']:.2f} | "
                     f"{r['held_ratio']:.3f} | {fit} | {heads} | {r['identical']} |")
    for name, held in result["held"].items():
        lines.append(f"held x DynamicCache at {result['held_tokens']} tokens, {name}: {held['ratio']:.3f}")
    if result["held"]:
        lines += ["", f"held bytes at {result['held_tokens']} tokens by part, x DynamicCache's (MB)",
                  "| part | " + " | ".join(result["held"]) + " |", "| --- |" + " ---: |" * len(result["held"])]
        parts = dict.fromkeys(p for held in result["held"].values() for p in held["parts"])
        for part in parts:
            cells = [(h["parts"].get(part, 0), h["raw_bytes"]) for h in result["held"].values()]
            lines.append(f"| {part} | " + " | ".join(f"{b / raw:.4f} ({b / 1e6:.1f})" for b, raw in cells) + " |")
    return "\n".join(lines)
