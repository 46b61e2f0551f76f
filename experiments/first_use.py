"""What a new user gets from the defaults, measured: lossless mode with a model attached and no calibration
argument, on a fresh calibrations folder (issue 11's acceptance).

    python experiments/first_use.py [--prompt-tokens 400] [--new-tokens 32]

Builds ``CompressedCache(CompressionConfig(mode="lossless"), model=model)`` twice and asks each for the model's
default calibration (``resolve_calibration()``, what the first ``save(predictor="context")`` does: the first fits
and saves it, the second finds it; the defaults themselves never look one up), generates next to `DynamicCache`
(token ids and logits compared bit for bit), saves the prompt's cache with the defaults (``generic``) and with
``predictor="context"``, loads each with ``model=`` only and compares every key and value bit for bit. The model and text are taken from the usual cache folder; calibrations go to a
temporary one. Prints one JSON object and writes it to ``results/first_use/first_use.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import calibration_dir
from hf_kvcompress.data import token_ids
from hf_kvcompress.downloads import cache_dir
from hf_kvcompress.generation import greedy_generate
from hf_kvcompress.models import load_model
from hf_kvcompress_eval.env import machine, versions
from hf_kvcompress_eval.lossless import same_bits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--offset", type=int, default=3000, help="where the held-out prompt starts")
    parser.add_argument("--out", default="results/first_use")
    args = parser.parse_args()

    shared = cache_dir()
    fresh = Path(tempfile.mkdtemp(prefix="hf_kvcompress-first-use-"))
    for name in ("models", "downloads", "datasets"):  # assets as usual; calibrations start empty
        if (shared / name).exists():
            (fresh / name).symlink_to(shared / name)
    os.environ["HF_KVCOMPRESS_CACHE"] = str(fresh)

    model, tokenizer = load_model()
    ids = token_ids(tokenizer, args.prompt_tokens, split="evaluation", offset=args.offset)
    config = CompressionConfig(mode="lossless")

    cpu, wall = time.process_time(), time.perf_counter()
    first = CompressedCache(config, model=model)
    first.resolve_calibration()
    first_use = {"cpu_s": round(time.process_time() - cpu, 1), "wall_s": round(time.perf_counter() - wall, 1),
                 "note": first.stats()["calibration"]}
    folder = calibration_dir(model)
    cpu, wall = time.process_time(), time.perf_counter()
    cache = CompressedCache(config, model=model)
    cache.resolve_calibration()
    lookup = {"cpu_s": round(time.process_time() - cpu, 2), "wall_s": round(time.perf_counter() - wall, 2),
              "note": cache.stats()["calibration"]}

    want = greedy_generate(model, ids, DynamicCache(), args.new_tokens, output_logits=True, return_dict_in_generate=True)
    got = greedy_generate(model, ids, cache, args.new_tokens, output_logits=True, return_dict_in_generate=True)
    identical = torch.equal(want.sequences, got.sequences) and all(
        torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want.logits, got.logits))
    in_generation = {k: v for k, v in cache.stats().items() if k != "per_layer"}

    prompt_cache = CompressedCache(config, model=model)
    with torch.inference_mode():
        model(ids, cache=prompt_cache)
    with tempfile.TemporaryDirectory() as tmp:
        files, exact = {}, True
        for predictor in ("generic", "context"):  # the default, and the calibrated one
            path = prompt_cache.save(Path(tmp) / f"{predictor}.kvc", predictor=predictor)
            files[predictor] = path.stat().st_size
            loaded = CompressedCache.load(path, model=model)
            exact = exact and all(same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
                                  for a, b in zip(prompt_cache.kv_layers(), loaded.kv_layers()))
    scalars = prompt_cache.stats()["raw_bytes"] // 2
    on_disk = sum(f.stat().st_size for f in folder.iterdir())
    result = {
        "prompt_tokens": args.prompt_tokens,
        "first_use_calibration": first_use,
        "calibration_folder_bytes": on_disk,
        "later_lookup": lookup,
        "generation_identical_to_DynamicCache": identical,
        "in_generation_stats": in_generation,
        "saved_file_bytes": files,
        "saved_bits_per_scalar": {name: round(8 * size / scalars, 4) for name, size in files.items()},
        "load_without_calibration_argument_bit_exact": exact,
        "machine": machine(),
        "versions": versions(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "first_use.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
