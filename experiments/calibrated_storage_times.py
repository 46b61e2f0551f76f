"""Question (issue 48): what do calibrated storage's save and load cost against `generic`'s, for the cache a user
holds (generation with the default `generic` predictor, a calibration with `below` heads present)?

SmolLM2-135M-Instruct bf16, a ``--tokens``-token held-out prompt prefilled once with `DynamicCache` and filled into a
default lossless cache (`generic`, `huff`) with the calibration ``--calibration`` (a first-use fit's folder). Per
route, interleaved, ``--repeats`` times: ``save`` (the default, `grid` with `mhuff`; and ``predictor="generic"``, whose
blocks are taken as they are), then ``load`` of that file with the model (blocks decoded once, checked and, for a
`grid` file, sealed as generation codes them) plus one teacher-forced decode step; every loaded cache checked bit for
bit against the saved one and its step's logits against `DynamicCache`'s (int views). Prints medians, ratios to
`generic`'s and the file bits per scalar.

    python experiments/calibrated_storage_times.py --calibration DIR [--tokens 2048] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.persist import read_header
from hf_kvcompress.calibration import Calibration
from hf_kvcompress_eval.bench.common import workload
from hf_kvcompress_eval.bench.generate import fill, run_steps
from hf_kvcompress_eval.bench.predictors import prefilled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = workload(False)
    model = work.model
    calibration = Calibration.load(args.calibration, model)
    ids = work.ids(args.tokens + 1, split="evaluation")
    prefix, reference = prefilled(model, ids[:, : args.tokens])
    _, _, expected = run_steps(model, reference, ids[:, args.tokens :])
    cache = CompressedCache(CompressionConfig(mode="lossless"), model=model, calibration=calibration)
    fill(cache, prefix)
    scalars = sum(2 * k.numel() for k, _ in prefix)
    times: dict[str, dict[str, list[float]]] = {"generic": {"save": [], "load": []}, "auto": {"save": [], "load": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for route in times:
                path = Path(tmp) / f"{route}.kvc"
                started = time.perf_counter()
                cache.save(path, predictor=None if route == "auto" else route)
                times[route]["save"].append(time.perf_counter() - started)
                started = time.perf_counter()
                loaded = CompressedCache.load(path, model=model, calibration=calibration)
                _, _, logits = run_steps(model, loaded, ids[:, args.tokens :])
                times[route]["load"].append(time.perf_counter() - started)
                assert torch.equal(logits[0].view(torch.int32), expected[0].view(torch.int32)), route
                times[route]["bits"] = [8.0 * path.stat().st_size / scalars]
                times[route]["name"] = read_header(path)["predictor"]["name"]
    base = {key: statistics.median(times["generic"][key]) for key in ("save", "load")}
    print(f"SmolLM2 bf16, {args.tokens} tokens, {args.threads} torch thread(s), medians of {args.repeats}")
    print("| route | predictor | file bits | save s | save x | load + step s | load x |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for route, got in times.items():
        save, load = statistics.median(got["save"]), statistics.median(got["load"])
        print(f"| {route} | {got['name']} | {got['bits'][0]:.3f} | {save:.3f} | {save / base['save']:.2f} | "
              f"{load:.3f} | {load / base['load']:.2f} |")


if __name__ == "__main__":
    main()
