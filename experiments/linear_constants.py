"""Where the linear predictors' constants come from, measured: `SURPRISE_RANGE` (predictors/linear.py), the
surprise exponents `ALPHAS` and `SIGMA_FLOOR` (calibration.py).

    python experiments/linear_constants.py [--fit-tokens 4096] [--prompt-tokens 1024]

Fits the ``context`` heads of the embedded SmolLM2-135M on the calibration split once per variant (the constants
as they are; a wider and a narrower surprise range; no surprise at all; a finer exponent grid) and codes the
same held-out prompt (evaluation split) with each, in lossless mode with ``predictor="context"``. Reports the
held-out bits per scalar, how often the fit's surprise hit either end of the range, which exponents the fit
chose and how many sigmas sit at the floor. Prints one JSON object and writes it to
``results/linear_constants/linear_constants.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress import calibration as calibration_module
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors import linear

VARIANTS = {
    "as is": {},
    "range (1/16, 16)": {"range": (1 / 16, 16.0)},
    "range (0.5, 2)": {"range": (0.5, 2.0)},
    "no surprise (alpha 0)": {"alphas": (0.0,)},
    "alphas 0..2 by 1/8": {"alphas": tuple(i / 8 for i in range(17))},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit-tokens", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--out", default="results/linear_constants")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    fit_ids = token_ids(tokenizer, args.fit_tokens, split="calibration")
    prompt = token_ids(tokenizer, args.prompt_tokens, split="evaluation", offset=3000)
    clamped = collections.Counter()
    original = linear.Surprise.current

    def counting(self, shape):  # the fit's and the coder's surprise before clamping
        if self.count:
            raw = (self.z2_sum / self.count).sqrt()
            clamped["low"] += int((raw < linear.SURPRISE_RANGE[0]).sum())
            clamped["high"] += int((raw > linear.SURPRISE_RANGE[1]).sum())
            clamped["all"] += raw.numel()
        return original(self, shape)

    linear.Surprise.current = counting
    rows = {}
    for label, variant in VARIANTS.items():
        linear.SURPRISE_RANGE = variant.get("range", (0.25, 8.0))
        calibration_module.ALPHAS = variant.get("alphas", (0.0, 0.25, 0.5, 0.75, 1.0, 1.25))
        clamped.clear()
        started = time.process_time()
        cal = Calibration.fit(model, tokenizer, ids=fit_ids, tokens=args.fit_tokens, chunk=1024,
                              predictors=("context",), progress=False)
        fit_s = time.process_time() - started
        fit_clamped = dict(clamped)
        alphas = collections.Counter(float(cal.tensors[n]) for n in cal.tensors if n.endswith("/alpha"))
        sigmas = torch.cat([cal.tensors[n].reshape(-1) for n in cal.tensors if n.endswith("/sigma")])
        cache = CompressedCache(
            CompressionConfig(mode="lossless", block_tokens=128, residual_tokens=0,
                              lossless=LosslessConfig(predictor="context", decoded_budget=1.0)),
            model=model, calibration=cal)
        with torch.no_grad():
            model(prompt, cache=cache, use_cache=True)
        rows[label] = {
            "held_out_bits_per_scalar": round(cache.stats()["bits_per_scalar"], 4),
            "fit_cpu_s": round(fit_s, 1),
            "fit_surprise_below_range": fit_clamped.get("low", 0) / max(fit_clamped.get("all", 1), 1),
            "fit_surprise_above_range": fit_clamped.get("high", 0) / max(fit_clamped.get("all", 1), 1),
            "alphas_chosen": {str(a): n for a, n in sorted(alphas.items())},
            "sigmas_at_floor": int((sigmas <= calibration_module.SIGMA_FLOOR * (1 + 1e-6)).sum()),
            "sigmas": sigmas.numel(),
            "smallest_sigma": float(sigmas.min()),
        }
        print(label, json.dumps(rows[label]), flush=True)
    result = {"fit_tokens": args.fit_tokens, "prompt_tokens": args.prompt_tokens, "variants": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_constants.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
