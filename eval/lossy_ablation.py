"""Which parts of the improved summary matter: held-out attention error and perplexity of summary variants on
the *calibration* split (where its settings were chosen), one 2,048 + 512 token segment.

    python eval/lossy_ablation.py [--ratios 0.3] [--variants summary topk ...] [--out results/lossy]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from lossy_experiment import FULL
from tqdm.auto import tqdm

from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress_eval.capture import capture, replay
from hf_kvcompress_eval.lossy import attention_errors, continuation_nll, lossy_setting

VARIANTS: dict[str, dict] = {
    "topk": {"method": "topk"},
    "topk (raw queries)": {"method": "topk", "query_horizon": 0},
    "summary": {"method": "summary"},
    "summary, raw queries": {"method": "summary", "query_horizon": 0},
    "summary, 512 queries": {"method": "summary", "reference_queries": 512},
    "summary, no bias": {"method": "summary", "fit_bias": False},
    "summary, ridge 1e-2": {"method": "summary", "ridge": 1e-2},
    "summary, entropy selection": {"method": "summary", "selection": "entropy"},
    "summary, plain OLS (gelsd)": {"method": "summary", "ridge": 0.0},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("results/lossy"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = FULL
    model, tokenizer = load_model(dtype=torch.float32, attn_implementation="sdpa")
    ids = token_ids(tokenizer, settings.context + settings.continuation, split="calibration", offset=20_000)
    full = capture(model, ids, logits_to_keep=settings.continuation + 1)
    full_nll = torch.nn.functional.cross_entropy(full.logits[0, :-1].float(), ids[0, settings.context :])
    context = full.slice(0, settings.context)
    rows = [{"variant": "full", "ratio": 1.0, "attn_err": 0.0, "ppl": math.exp(full_nll.item())}]
    for ratio in args.ratios:
        for name in tqdm(args.variants, desc=f"ratio {ratio}"):
            setting = lossy_setting(model, name, VARIANTS[name], ratio, window=settings.window,
                                    interval=settings.interval, sinks=settings.sinks)
            cache = replay(setting.make(), context)
            errors = attention_errors(cache, full, settings.context, settings.heldout_stride)
            nll = continuation_nll(model, cache, ids, settings.context, settings.interval, full.logits[:, 0])
            rows.append({"variant": name, "ratio": ratio, "attn_err": sum(errors) / len(errors),
                         "ppl": math.exp(nll.mean().item())})
    lines = [f"{'variant':<28} {'ratio':>5} {'attn err':>9} {'ppl':>8}"]
    lines += [f"{r['variant']:<28} {r['ratio']:>5.2f} {r['attn_err']:>9.4f} {r['ppl']:>8.3f}" for r in rows]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ablation.json").write_text(json.dumps({"rows": rows, "table": "\n".join(lines)}, indent=2))


if __name__ == "__main__":
    main()
