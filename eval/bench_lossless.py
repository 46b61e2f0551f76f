"""Lossless benchmark: bits per scalar of every predictor on held-out text, their cost against a bf16
prefill, and lossless generation speed against DynamicCache (a command line over
hf_kvcompress_eval.lossless; `hf-kvcompress eval` runs the same code).

    python eval/bench_lossless.py [--calibration DIR] [--tokens 2048] [--out results/lossless]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_kvcompress.calibration import Calibration, calibration_dir
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress_eval.env import machine, versions
from hf_kvcompress_eval.lossless import generation_rows, run_lossless
from hf_kvcompress_eval.report import (
    generation_table,
    lossless_table,
    per_layer_table,
    plot_bits_per_layer,
)

PREDICTORS = "generic,none,context,probe:8,probe:15,probe:22,twin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", default=None, help="calibration folder (default: the model's)")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens to code")
    parser.add_argument("--offset", type=int, default=4096, help="where in the evaluation text they start")
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--gen-prompt", type=int, default=300)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--predictors", default=PREDICTORS, help="comma-separated (probe:K for probe at layer K)")
    parser.add_argument("--out", default="results/lossless")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model()
    calibration = Calibration.load(Path(args.calibration) if args.calibration else calibration_dir(model), model)
    ids = token_ids(tokenizer, args.tokens, split="evaluation", offset=args.offset)
    result = run_lossless(model, ids, calibration, predictors=args.predictors.split(","),
                          baselines=["zstd-3", "zstd-19", "zipnn", "exponent-bound"], windows=[], window_tokens=1,
                          block_tokens=args.block_tokens, work_dir=out)
    print(lossless_table(result), per_layer_table(result), sep="\n\n")
    if not args.skip_generation:
        prompt = token_ids(tokenizer, args.gen_prompt, split="evaluation", offset=args.offset)
        result["generation"] = generation_rows(model, prompt, calibration, caches=["dynamic", "lossless"],
                                               new_tokens=args.gen_tokens, block_tokens=128, residual_tokens=64)
        print("\n" + generation_table(result["generation"]))
    result.update(calibration=calibration.meta["text"], versions=versions(), machine=machine())
    (out / "lossless.json").write_text(json.dumps(result, indent=1))
    plot_bits_per_layer(result, out / "lossless_bits_per_layer.png")
    print(f"\nwrote {out / 'lossless.json'} and {out / 'lossless_bits_per_layer.png'}")


if __name__ == "__main__":
    main()
