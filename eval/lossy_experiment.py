"""Lossy mode on SmolLM2 + Shakespeare: how the seed-004 summary compares with Top-K, StreamingLLM and plain SVD
at the same memory.

For each method and keep ratio (fraction of the full cache's bytes, side data included) it measures:
1. relative attention-output error on held-out queries (the queries of the continuation, never used as
   reference queries) over the compressed context, averaged over layers and heads, and the worst layer;
2. perplexity of the continuation after the compressed context, against the full cache (the continuation is fed
   in chunks of ``interval`` tokens, so summaries keep running as they would during decoding);
3. retrieval accuracy on synthetic needle-in-a-haystack prompts (the context is compressed before the question
   arrives; the answer is generated with ``generate``);
4. time per summary (all layers).

    python eval/lossy_experiment.py            # the full run (about an hour on one CPU core)
    python eval/lossy_experiment.py --quick    # a few minutes, small settings

Prints a table and writes ``results.json`` and ``lossy.png`` under ``--out`` (default ``results/lossy/``).
All tuning was done on the calibration split; everything here runs on the evaluation split.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lossy_capture import Captured, capture, replayed_cache
from lossy_needles import answer_correct, make_needles

from hf_kvcompress import CompressionConfig, LossyConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.lossy.blocks import block_bias
from hf_kvcompress.models import load_model

#: name -> LossyConfig fields. "summary-seed" is the seed's pipeline as written (entropy selection, plain OLS
#: by gelsd, no biases, the most recent queries at their own positions); "summary" is the improved default.
METHODS: dict[str, dict] = {
    "streaming": {"method": "streaming"},
    "topk": {"method": "topk"},
    "svd": {"method": "svd"},
    "summary-seed": {
        "method": "summary", "selection": "entropy", "fit_bias": False, "ridge": 0.0,
        "query_horizon": 0, "reference_queries": 256,
    },
    "summary": {"method": "summary"},
}


@dataclass(frozen=True)
class Settings:
    context: int = 2048
    continuation: int = 512
    segments: int = 2
    needles: int = 50
    needle_context: int = 512
    needle_batch: int = 10
    ratios: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5)
    interval: int = 256
    window: int = 64
    sinks: int = 4
    heldout_stride: int = 4


QUICK = Settings(
    context=384, continuation=128, segments=1, needles=10, needle_context=256, needle_batch=10,
    ratios=(0.2, 0.5), interval=64, window=32,
)


def lossy_config(settings: Settings, method: str, ratio: float) -> CompressionConfig:
    fields = {"budget": ratio, "interval": settings.interval, "sinks": settings.sinks, **METHODS[method]}
    return CompressionConfig(mode="lossy", residual_tokens=settings.window, lossy=LossyConfig(**fields))


# ---------------------------------------------------------------------- measurements


def held_entries(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and float biases ``[b, h, n]`` of everything a layer holds."""
    keys, values = layer.keys, layer.values
    parts = []
    for block in layer.blocks:
        bias = block_bias(block)
        parts.append(torch.zeros(keys.shape[0], keys.shape[1], block.entries) if bias is None else bias.float())
    res = torch.zeros(keys.shape[0], keys.shape[1], layer.residual_length)
    if getattr(layer, "residual_valid", None) is not None:
        res = torch.where(layer.residual_valid[:, None, :], 0.0, float("-inf")).expand_as(res)
    return keys.float(), values.float(), torch.cat([*parts, res], dim=-1)


def attention_errors(cache, full: Captured, context: int, stride: int, scaling: float) -> list[float]:
    """Per layer: mean relative error of the held-out queries' attention output over the context."""
    errors = []
    for layer, (q, k, v) in zip(cache.layers, full.states):
        queries = q[..., context::stride, :].float()
        groups = queries.shape[1] // k.shape[1]
        k_full = k[..., :context, :].float().repeat_interleave(groups, 1)
        v_full = v[..., :context, :].float().repeat_interleave(groups, 1)
        o_full = torch.softmax(queries @ k_full.transpose(-1, -2) * scaling, -1) @ v_full
        k_c, v_c, bias = held_entries(layer)
        k_c, v_c, bias = (t.repeat_interleave(groups, 1) for t in (k_c, v_c, bias))
        logits = queries @ k_c.transpose(-1, -2) * scaling + bias[..., None, :]
        o_c = torch.softmax(logits, -1) @ v_c
        rel = (o_c - o_full).norm(dim=-1) / o_full.norm(dim=-1).clamp_min(1e-12)
        errors.append(rel.mean().item())
    return errors


def summary_times(cache) -> list[float]:
    """Seconds per summary event, summed over layers."""
    per_layer = [layer.summary_seconds for layer in cache.layers]
    events = min(len(s) for s in per_layer)
    return [sum(s[i] for s in per_layer) for i in range(events)]


@torch.inference_mode()
def continuation_nll(model, cache, ids: torch.Tensor, context: int, chunk: int, first_logits: torch.Tensor):
    """NLL of every continuation token: the first from the (shared) full prefill, the rest from the cache."""
    cont = ids[:, context:]
    losses = [torch.nn.functional.cross_entropy(first_logits.float(), cont[:, 0], reduction="none")]
    for start in range(0, cont.shape[1] - 1, chunk):
        piece = cont[:, start : start + chunk]
        logits = model(piece, cache=cache).logits.float()
        target = cont[:, start + 1 : start + chunk + 1]
        losses.append(torch.nn.functional.cross_entropy(logits[0, : target.shape[1]], target[0], reduction="none"))
    return torch.cat([x.reshape(-1) for x in losses])


# ---------------------------------------------------------------------- the experiment


def run_perplexity(model, tokenizer, settings: Settings, methods: list[str], results: dict, bar) -> None:
    total = settings.context + settings.continuation
    scaling = float(model.model.layers[0].self_attn.scaling)
    for seg in range(settings.segments):
        ids = token_ids(tokenizer, total, split="evaluation", offset=seg * 10_000)
        full = capture(model, ids, logits_to_keep=settings.continuation + 1)
        full_nll = torch.nn.functional.cross_entropy(
            full.logits[0, :-1].float(), ids[0, settings.context :], reduction="none"
        )
        results["full"]["nll"].extend(full_nll.tolist())
        context_states = full.slice(0, settings.context)
        for method in methods:
            for ratio in settings.ratios:
                bar.set_postfix_str(f"segment {seg} {method} {ratio}")
                cache = replayed_cache(model, lossy_config(settings, method, ratio), context_states)
                stats = cache.stats()
                errors = attention_errors(cache, full, settings.context, settings.heldout_stride, scaling)
                nll = continuation_nll(model, cache, ids, settings.context, settings.interval, full.logits[:, 0])
                entry = results[method][str(ratio)]
                entry["kept"].append(stats["stored_bytes"] / stats["raw_bytes"])
                entry["layer_errors"].append(errors)
                entry["nll"].extend(nll.tolist())
                entry["summary_seconds"].extend(summary_times(cache))
                bar.update(1)
        del full, context_states


def run_needles(model, tokenizer, settings: Settings, methods: list[str], results: dict, bar) -> None:
    needles = make_needles(tokenizer, settings.needles, settings.needle_context, split="evaluation")
    configs = [("full", None, CompressionConfig(mode="none"))] + [
        (m, r, lossy_config(settings, m, r)) for m in methods for r in settings.ratios
    ]
    for start in range(0, settings.needles, settings.needle_batch):
        context = needles.context[start : start + settings.needle_batch]
        prompt = torch.cat([context, needles.question.expand(context.shape[0], -1)], dim=1)
        states = capture(model, context)
        for name, ratio, config in configs:
            bar.set_postfix_str(f"needles {start} {name} {ratio}")
            cache = replayed_cache(model, config, states)
            with torch.inference_mode():
                out = model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=7,
                    min_new_tokens=7, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                )
            answers = needles.answers[start : start + context.shape[0]]
            hits = [answer_correct(tokenizer, row[prompt.shape[1] :], a) for row, a in zip(out, answers)]
            entry = results[name] if ratio is None else results[name][str(ratio)]
            entry["needle_hits"].extend(hits)
            bar.update(1)


def summarise(results: dict, settings: Settings, methods: list[str]) -> list[dict]:
    full_ppl = math.exp(sum(results["full"]["nll"]) / len(results["full"]["nll"]))
    full_acc = sum(results["full"]["needle_hits"]) / max(1, len(results["full"]["needle_hits"]))
    rows = [{"method": "full", "ratio": 1.0, "kept": 1.0, "attn_err": 0.0, "worst_layer": None, "worst_err": 0.0,
             "ppl": full_ppl, "needle_acc": full_acc, "sec_per_summary": 0.0}]
    for method in methods:
        for ratio in settings.ratios:
            e = results[method][str(ratio)]
            per_layer = torch.tensor(e["layer_errors"]).mean(0)  # mean over segments
            rows.append({
                "method": method,
                "ratio": ratio,
                "kept": sum(e["kept"]) / len(e["kept"]),
                "attn_err": per_layer.mean().item(),
                "worst_layer": int(per_layer.argmax()),
                "worst_err": per_layer.max().item(),
                "ppl": math.exp(sum(e["nll"]) / len(e["nll"])),
                "needle_acc": sum(e["needle_hits"]) / max(1, len(e["needle_hits"])),
                "sec_per_summary": sum(e["summary_seconds"]) / max(1, len(e["summary_seconds"])),
            })
    return rows


def format_table(rows: list[dict], settings: Settings) -> str:
    head = (f"{'method':<13} {'ratio':>5} {'kept':>6} {'attn err':>9} {'worst layer':>13} "
            f"{'ppl':>8} {'d ppl':>7} {'needle':>7} {'s/summary':>10}")
    lines = [head, "-" * len(head)]
    full_ppl = rows[0]["ppl"]
    for r in rows:
        worst = "-" if r["worst_layer"] is None else f"{r['worst_err']:.3f} (L{r['worst_layer']})"
        lines.append(
            f"{r['method']:<13} {r['ratio']:>5.2f} {r['kept']:>6.3f} {r['attn_err']:>9.4f} {worst:>13} "
            f"{r['ppl']:>8.3f} {r['ppl'] - full_ppl:>+7.3f} {r['needle_acc']:>7.2f} {r['sec_per_summary']:>10.2f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("attn_err", "held-out attention error"), ("ppl", "perplexity (next tokens)"),
              ("needle_acc", "needle accuracy"), ("sec_per_summary", "seconds per summary")]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    full = rows[0]
    for ax, (key, title) in zip(axes, panels):
        for method in methods:
            mine = [r for r in rows if r["method"] == method]
            ax.plot([r["ratio"] for r in mine], [r[key] for r in mine], marker="o", label=method)
        if key in ("ppl", "needle_acc"):
            ax.axhline(full[key], color="black", linestyle="--", label="full cache")
        ax.set_title(title)
        ax.set_xlabel("keep ratio (bytes)")
        if key == "ppl":
            ax.set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small settings, a few minutes")
    parser.add_argument("--out", type=Path, default=Path("results/lossy"))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--segments", type=int, help="perplexity segments (default: 2, quick: 1)")
    parser.add_argument("--needles", type=int, help="needle prompts (default: 50, quick: 10)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (float32 is faster on CPU)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a busy 2-core machine more threads made small matmuls 30x slower)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    overrides = {k: v for k, v in (("segments", args.segments), ("needles", args.needles)) if v is not None}
    settings = dataclasses.replace(settings, **overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    methods = args.methods
    results: dict = {"full": {"nll": [], "needle_hits": []}}
    for m in methods:
        results[m] = {str(r): {"kept": [], "layer_errors": [], "nll": [], "needle_hits": [], "summary_seconds": []}
                      for r in settings.ratios}
    runs = len(methods) * len(settings.ratios)
    batches = math.ceil(settings.needles / settings.needle_batch)
    start = time.perf_counter()
    with tqdm(total=settings.segments * runs + batches * (runs + 1), desc="lossy experiment") as bar:
        args.out.mkdir(parents=True, exist_ok=True)
        run_perplexity(model, tokenizer, settings, methods, results, bar)
        # a long run killed during the needles keeps its perplexity half
        (args.out / "partial.json").write_text(json.dumps(results))
        run_needles(model, tokenizer, settings, methods, results, bar)
    rows = summarise(results, settings, methods)
    table = format_table(rows, settings)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"settings": dataclasses.asdict(settings), "dtype": args.dtype, "methods": METHODS,
              "seconds": time.perf_counter() - start, "rows": rows, "table": table,
              "per_layer_errors": {m: {str(r): torch.tensor(results[m][str(r)]["layer_errors"]).mean(0).tolist()
                                       for r in settings.ratios} for m in methods}}
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    plot(rows, methods, args.out / "lossy.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'lossy.png'} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
