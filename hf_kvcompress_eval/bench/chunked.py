"""Chunked lossy prefill (issue 36; docs/lossy.md, *Chunked prefill*): peak resident memory and time of a prefill of
``--contexts`` tokens, each setting in a fresh process so that peaks do not mix.

SmolLM2-135M-Instruct in bf16 (sdpa), held-out Shakespeare (evaluation split), ``--threads`` threads. Per context
length the settings are: ``DynamicCache`` in one forward (``dynamic``) and in chunks of ``--chunk`` tokens
(``dynamic chunked``, `hf_kvcompress.generation.prefill_in_chunks`, what ``generate(prefill_chunk_size=...)``
does); a one-shot lossy prefill of each ``--oneshot`` method (one forward, summarised at its end); and the chunked
lossy prefill of each ``--methods`` method (default: every registered one) at ``--budget``.

Per setting: *peak MB*, the resident-memory growth over the prefill (``VmHWM`` after resetting it, less the RSS
before: cache, activations, attention scores, the summaries' temporaries); *held MB*, the cache's ``held_bytes`` at
the end (checked against an independent walk of the cache, `hf_kvcompress_eval.env.walk_held_bytes`); for chunked
lossy settings *most / bound*, the largest ratio over the chunks of the bytes held after a chunk to the layers'
budgets plus one chunk (<= 1: within budget plus one chunk at every chunk); the prefill seconds and their ratio to
``dynamic chunked`` of the same context (run in the same invocation: the machine's load moves the seconds); the
summaries' seconds. Rows are appended to ``results.jsonl`` as they finish and a rerun skips the settings already
there (``--fresh`` starts over); ``table.md`` and ``results.json`` are written from all rows at the end.

    hf-kvcompress bench chunked [--contexts 8192,16384] [--chunk 512] [--budget 0.25] [--methods summary,streaming]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .common import out_folder, workload

#: the values ``--smoke`` puts in place of the defaults (a tiny random model: numbers that mean nothing)


def settings(args: argparse.Namespace) -> list[tuple[int, str, bool]]:
    """``(context, method or 'dynamic', chunked)`` in run order: per context ``dynamic chunked`` first (the ratios'
    reference), the chunked lossy rows, then the one-shot ones (a long run cut short keeps the chunked rows)."""
    from hf_kvcompress import LossyConfig
    from hf_kvcompress.errors import CliError

    known = list(LossyConfig.METHODS)
    methods = known if args.methods == "all" else [m for m in args.methods.split(",") if m]
    oneshot = [m for m in args.oneshot.split(",") if m]
    unknown = sorted(set(methods + oneshot) - set(known))
    if unknown:
        raise CliError(f"--methods / --oneshot: unknown method(s) {unknown}; registered: {known}")
    if args.chunk < 1:
        raise CliError("--chunk must be >= 1")
    out = []
    for context in (int(c) for c in args.contexts.split(",")):
        if context < 1:
            raise CliError("--contexts: every length must be >= 1")
        rows = [] if args.no_dynamic else [(context, "dynamic", True)]
        rows += [(context, m, True) for m in methods] + ([] if args.no_dynamic else [(context, "dynamic", False)])
        out += rows + [(context, m, False) for m in oneshot]
    return out


def key(context: int, method: str, chunked: bool) -> str:
    return f"{context} {method}{' chunked' if chunked else ''}"


def run(args: argparse.Namespace) -> int:
    if args.worker:
        print(json.dumps(measure(args, *json.loads(args.worker))))
        return 0
    out = out_folder(args, "chunked")
    rows_file = out / "results.jsonl"
    if args.fresh and rows_file.exists():
        rows_file.unlink()
    todo = settings(args)
    done = {row["key"] for row in read_rows(rows_file)}
    for context, method, chunked in todo:
        if key(context, method, chunked) in done:
            continue
        row = run_one(args, context, method, chunked)
        with rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(format_row(row, read_rows(rows_file)), flush=True)
    rows = read_rows(rows_file)
    meta = {"model": "tiny random Llama (smoke)" if args.smoke else "SmolLM2-135M-Instruct bf16 sdpa",
            "chunk": args.chunk, "budget": args.budget, "window": args.window, "threads": args.threads,
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = "\n".join([HEADER] + [format_row(row, rows) for row in rows])
    (out / "table.md").write_text(f"{json.dumps(meta)}\n\n```\n{table}\n```\n")
    print(f"\n{table}\n\nwrote {out / 'results.json'} and {out / 'table.md'}")
    return 0


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(args: argparse.Namespace, context: int, method: str, chunked: bool) -> dict:
    """One setting in a fresh process (its own peak); its JSON row."""
    command = [sys.executable, "-m", "hf_kvcompress.cli", "bench", "chunked", "--worker",
               json.dumps([context, method, chunked]), "--chunk", str(args.chunk), "--budget", str(args.budget),
               "--window", str(args.window), "--threads", str(args.threads), "--out", str(out_folder(args, "chunked"))]
    command += ["--smoke"] if args.smoke else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench chunked: setting {key(context, method, chunked)!r} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, context: int, method: str, chunked: bool) -> dict:
    """The prefill of one setting in this process."""
    from transformers import DynamicCache

    from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
    from hf_kvcompress.generation import prefill_in_chunks
    from hf_kvcompress_eval.env import PeakMemory, walk_held_bytes

    torch.set_num_threads(args.threads)
    work = workload(args.smoke, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = work.model
    ids = work.ids(context, split="evaluation")
    if method == "dynamic":
        cache = DynamicCache()
    else:
        lossy = LossyConfig(method=method, budget=args.budget)
        cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=args.window, lossy=lossy), model=model)
    worst = 0.0
    with PeakMemory() as peak, torch.inference_mode():
        start = time.perf_counter()
        if not chunked:
            model(ids, cache=cache, logits_to_keep=1)
        for at in range(0, context, args.chunk) if chunked else ():
            prefill_in_chunks(model, ids[:, at : at + args.chunk], cache, args.chunk)
            if method != "dynamic":  # held bytes after the chunk against the layers' budgets plus one chunk
                bound = sum(layer.budget_bytes() + args.chunk * layer.token_bytes for layer in cache.layers)
                worst = max(worst, cache.stats()["held_bytes"] / bound)
        seconds = time.perf_counter() - start
    row = {"key": key(context, method, chunked), "context": context, "method": method, "chunked": chunked,
           "peak_mb": peak.peak_bytes / 1e6 if peak.peak_bytes is not None else None, "seconds": seconds}
    if method == "dynamic":
        row["held_mb"] = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        row["held_mb"] /= 1e6
        return row
    held = cache.stats()["held_bytes"]
    walked = walk_held_bytes(cache, skip=(model,))
    if walked != held:
        raise RuntimeError(f"bench chunked: {row['key']}: held_bytes {held} but the walk finds {walked}")
    per_layer = [layer.summary_seconds for layer in cache.layers]
    row.update(held_mb=held / 1e6, most_over_bound=worst if chunked else None,
               summary_s=sum(map(sum, per_layer)), summaries=max(map(len, per_layer), default=0))
    return row


HEADER = (f"{'tokens':>6} {'setting':<28} {'peak MB':>8} {'held MB':>8} {'most/bound':>10} {'prefill s':>9} "
          f"{'x dyn ch':>8} {'summ s':>8}")


def format_row(row: dict, rows: list[dict]) -> str:
    base = next((r["seconds"] for r in rows if r["key"] == key(row["context"], "dynamic", True)), None)
    ratio = f"{row['seconds'] / base:8.2f}" if base else f"{'-':>8}"
    bound = row.get("most_over_bound")
    peak = f"{row['peak_mb']:8.1f}" if row["peak_mb"] is not None else f"{'-':>8}"
    setting = row["key"].split(" ", 1)[1]
    return (f"{row['context']:>6} {setting:<28} {peak} {row['held_mb']:8.2f} "
            f"{f'{bound:.3f}' if bound is not None else '-':>10} {row['seconds']:9.2f} {ratio} "
            f"{row.get('summary_s', 0.0):8.2f}")
