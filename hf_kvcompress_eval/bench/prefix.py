"""Prefix reuse side by side: `PrefixStore` and saved files against recomputing the prompt (docs/prefix_store.md).

SmolLM2-135M-Instruct in bf16 (the embedded default), held-out Shakespeare (evaluation split), torch on
``--threads`` threads. For each prefix length P (default 512, 2,048, 8,192) and a 64-token new suffix:

- ``recompute``: `generate(prompt, max_new_tokens=1)` with a fresh `DynamicCache`: the time to the first token
  of the whole P + 64 prompt;
- ``store`` / ``store (NAME)``: a warm `PrefixStore` (``predictor="generic"``, and each of ``--calibrated``,
  default ``context`` and ``below``, with the model's calibration) filled by prefilling exactly the prefix, then
  per repetition a new `PrefixStore` object (nothing kept in memory between repetitions), ``cache_for(prompt)``
  and `generate(max_new_tokens=1)`;
- ``load (generic)`` / ``load (NAME)``: `CompressedCache.load` of a saved prefix file, then the same
  generate; and ``load`` alone against a `DynamicCache` prefill of the P prefix tokens (the "load of a
  generation-format file <= 0.1x prefill" goal).

Medians of ``--repeats`` (>= 5) runs, interleaved, as ratios to ``recompute`` of the same run; store and file
bytes against the raw bf16 K/V. Exactness: the tokens and every logit of a 16-token greedy continuation from each
route equal (bitwise) those of DynamicCache reusing the same prefix (prefill the prefix into a DynamicCache, then
generate the whole prompt from a `copy.deepcopy` of it: transformers' prompt-reuse pattern). Writes
``results.json`` first, then ``prefix_store.png``.

With ``--sliding-window W`` the model runs as a sliding-window architecture (`common.sliding_window_model`: its
weights in a Mistral config, every layer attending to its last W tokens; the store's chunks then hold each layer's
window, and only the generic routes run: calibrations cover full-attention models); ``differs_from_full_attention``
records that its last logits differ from the full model's on the prompt, ``bytes_x_raw_prefix`` each route's bytes
over the raw K/V of all P prefix tokens (``bytes x raw`` is over what the window cache holds).

    hf-kvcompress bench prefix [--prefixes 512,2048,8192] [--repeats 5] [--threads 2] [--calibrated context,below]
        [--sliding-window W] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, PrefixStore
from hf_kvcompress.identity import kv_shape

from .common import Workload, out_folder, sliding_window_model, workload

SUFFIX = 64
CHECK_TOKENS = 16


def run(args: argparse.Namespace) -> int:
    from hf_kvcompress.errors import CliError

    if args.repeats < 5:
        raise CliError("--repeats must be >= 5 (medians of at least five runs)")
    if args.sliding_window == 1:
        raise CliError("--sliding-window must be 0 (off) or >= 2 tokens")
    out = out_folder(args, "prefix")
    work = workload(args.smoke)
    full = work.model
    name = f"{work.name} bf16"
    calibrated = [] if args.no_context else [name for name in args.calibrated.split(",") if name]
    if args.sliding_window:  # a store of a window model takes the generic predictor only (`PrefixStore`)
        work.model = sliding_window_model(full, args.sliding_window)
        name = f"{work.name} bf16 as a sliding-window model (Mistral config, window {args.sliding_window})"
        calibrated = []
    calibration = work.default_calibration(tuple(calibrated)) if calibrated else None
    prefixes = [int(p) for p in args.prefixes.split(",")]
    result = {"model": name, "threads": torch.get_num_threads(), "repeats": args.repeats,
              "suffix": SUFFIX, "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "sliding_window": args.sliding_window or None, "prefixes": {}}
    for prefix in prefixes:
        result["prefixes"][str(prefix)] = run_prefix(work, prefix, args, calibration, calibrated)
        if args.sliding_window:
            entry = result["prefixes"][str(prefix)]
            entry["differs_from_full_attention"] = differs(
                full, work.model, work.ids(prefix + SUFFIX, split="evaluation", offset=args.offset))
            # ``raw_bytes`` is what the window cache holds (its last W - 1 tokens); beside it, every prefix token's
            entry["raw_prefix_bytes"] = prefix_raw_bytes(work.model, prefix)
            entry["bytes_x_raw_prefix"] = {route: row["bytes"] / entry["raw_prefix_bytes"]
                                           for route, row in entry["routes"].items()}
        (out / "results.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    for prefix, entry in result["prefixes"].items():
        if "bytes_x_raw_prefix" in entry:
            print(f"{prefix:>7} bytes x raw K/V of all {prefix} prefix tokens: "
                  + ", ".join(f"{route} {ratio:.3f}" for route, ratio in entry["bytes_x_raw_prefix"].items()))
    plot(result, out / "prefix_store.png")
    print(f"\nwrote {out / 'results.json'} and {out / 'prefix_store.png'}")
    return 0


def run_prefix(work: Workload, prefix: int, args, calibration, calibrated: list[str]) -> dict:
    model = work.model
    ids = work.ids(prefix + SUFFIX, split="evaluation", offset=args.offset)
    head = ids[:, :prefix]
    mask = torch.ones_like(ids)
    raw_bytes = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        routes: dict[str, dict] = {}
        # fill: prefill exactly the prefix (the KV the reference reuses), then store / save it
        filled = CompressedCache(CompressionConfig(mode="lossless"), model=model, calibration=calibration)
        with torch.no_grad():
            model(input_ids=head, cache=filled, use_cache=True)
        raw_bytes = filled.stats()["raw_bytes"]
        stores = {"store": {"predictor": "generic"}}
        stores.update({f"store ({name})": {"predictor": name, "calibration": calibration} for name in calibrated})
        for name, kwargs in stores.items():
            folder = tmp / name.replace(" ", "_")
            PrefixStore(model, path=folder, **kwargs).put(head, filled)
            routes[name] = {"bytes": PrefixStore(model, path=folder, **kwargs).stats()["bytes"],
                            "make": lambda folder=folder, kwargs=kwargs: PrefixStore(model, path=folder, **kwargs)
                            .cache_for(ids)}
        for predictor in ("generic", *calibrated):
            path = filled.save(tmp / f"{predictor}.kvc", predictor=predictor)
            routes[f"load ({predictor})"] = {
                "bytes": path.stat().st_size,
                "make": lambda path=path: CompressedCache.load(path, model=model, calibration=calibration)}

        def recompute():
            return generate(model, ids, mask, DynamicCache(config=model.config), 1)

        def prefill_prefix():
            with torch.no_grad():
                model(input_ids=head, cache=DynamicCache(config=model.config), use_cache=True)

        times: dict[str, list[float]] = {"recompute": [], "prefill prefix": []}
        for name in routes:
            times[name] = []
            times[f"{name}: lookup"] = []
        for _ in tqdm(range(args.repeats), desc=f"prefix {prefix}"):
            times["recompute"].append(timed(recompute))
            times["prefill prefix"].append(timed(prefill_prefix))
            for name, route in routes.items():
                start = time.perf_counter()
                cache = route["make"]()
                looked = time.perf_counter()
                generate(model, ids, mask, cache, 1)
                done = time.perf_counter()
                times[name].append(done - start)
                times[f"{name}: lookup"].append(looked - start)

        reference = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=head, cache=reference, use_cache=True)
        ref = generate(model, ids, mask, copy.deepcopy(reference), CHECK_TOKENS)
        exact = {name: same(ref, generate(model, ids, mask, route["make"](), CHECK_TOKENS))
                 for name, route in routes.items()}
    median = {name: statistics.median(values) for name, values in times.items()}
    base = median["recompute"]
    rows = {}
    for name, route in routes.items():
        rows[name] = {"ttft_s": median[name], "ttft_ratio": median[name] / base,
                      "lookup_s": median[f"{name}: lookup"],
                      "lookup_to_prefill_prefix": median[f"{name}: lookup"] / median["prefill prefix"],
                      "bytes": route["bytes"], "bytes_ratio": route["bytes"] / raw_bytes,
                      "exact_tokens_and_logits": exact[name], "runs_s": times[name]}
    return {"recompute_s": base, "prefill_prefix_s": median["prefill prefix"], "raw_bytes": raw_bytes,
            "runs_recompute_s": times["recompute"], "runs_prefill_prefix_s": times["prefill prefix"], "routes": rows}


def generate(model, ids, mask, cache, new_tokens: int):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)


def differs(full: torch.nn.Module, sliding: torch.nn.Module, ids: torch.Tensor) -> bool:
    """Whether the window model's last logits differ from the full-attention model's on ``ids``: a prompt longer
    than the window is then really read through a window (transformers' Llama ignores a ``sliding_window``)."""
    with torch.no_grad():
        return not torch.equal(full(ids).logits[:, -1], sliding(ids).logits[:, -1])


def prefix_raw_bytes(model: torch.nn.Module, tokens: int) -> int:
    """The raw K/V bytes of ``tokens`` tokens in every layer (what a full-attention cache holds)."""
    heads, dim = kv_shape(model.config)
    return 2 * tokens * model.config.num_hidden_layers * heads * dim * model.dtype.itemsize


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def same(a, b) -> bool:
    """Same tokens and bit-identical logits (int views: NaN payloads, -0.0 included)."""
    if not torch.equal(a.sequences, b.sequences) or len(a.logits) != len(b.logits):
        return False
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.logits, b.logits))


def print_table(result: dict) -> None:
    """One line per route; ``lookup x generic``: its lookup (or load) over the generic route's of its kind."""
    print(f"{'prefix':>7} {'route':<18} {'TTFT s':>8} {'x recompute':>12} {'lookup/prefill':>15} "
          f"{'lookup x generic':>17} {'bytes x raw':>12} exact")
    for prefix, entry in result["prefixes"].items():
        print(f"{prefix:>7} {'recompute':<18} {entry['recompute_s']:8.3f} {1.0:12.3f}")
        routes = entry["routes"]
        for name, row in routes.items():
            base = routes["load (generic)" if name.startswith("load") else "store"]["lookup_s"]
            print(f"{prefix:>7} {name:<18} {row['ttft_s']:8.3f} {row['ttft_ratio']:12.3f} "
                  f"{row['lookup_to_prefill_prefix']:15.3f} {row['lookup_s'] / base:17.3f} {row['bytes_ratio']:12.3f} "
                  f"{row['exact_tokens_and_logits']}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = list(result["prefixes"])
    names = list(next(iter(result["prefixes"].values()))["routes"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(prefixes))]
        left.bar(xs, [result["prefixes"][p]["routes"][name]["ttft_ratio"] for p in prefixes], width, label=name)
        right.bar(xs, [result["prefixes"][p]["routes"][name]["bytes_ratio"] for p in prefixes], width, label=name)
    for axis, title, goal in ((left, "time to first token / recompute", 0.5), (right, "bytes / raw bf16 K/V", 0.66)):
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(prefixes))], [f"{p} + {SUFFIX}" for p in prefixes])
        axis.axhline(goal, color="grey", linestyle="--", linewidth=1)
        axis.set_title(title)
        axis.set_xlabel("prefix + new tokens")
    left.set_yscale("log")
    left.legend(fontsize=8)
    fig.suptitle(f"Prefix reuse, {result['model']}, {result['threads']} threads, medians of {result['repeats']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)

