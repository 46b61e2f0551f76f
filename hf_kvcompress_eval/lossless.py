"""Lossless measurements: bits per scalar of every predictor (K, V, per layer) through a real save/load round
trip, general-purpose baselines on the same K/V, the window scheduler's choices, and generation speed and
memory against `DynamicCache`.

Every number comes from files really written with `CompressedCache.save` and read back with
`CompressedCache.load`, checked bit for bit against the original K/V. ``hf-kvcompress eval --suite full --only lossless,generation`` is a thin
command line over these functions.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.persist import read_header, stream_bytes
from hf_kvcompress.codec import CodecConfig, encode_with_stats
from hf_kvcompress.generation import greedy_generate
from hf_kvcompress.predictors import make_predictor
from hf_kvcompress.predictors.registry import settings_for

from .baselines import baseline_bits, timed
from .env import PeakMemory


def parse_predictor(spec: str) -> tuple[str, str, int | None]:
    """``"probe:8"`` -> (label ``"probe k=8"``, predictor ``"probe"``, k 8); ``"generic"`` is the context
    predictor without a calibration (per-block channel statistics sent as side data)."""
    name, _, k = spec.partition(":")
    return (f"{name} k={k}" if k else name), name, (int(k) if k else None)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def prefilled_cache(model, ids: torch.Tensor, calibration, block_tokens: int) -> CompressedCache:
    """A mode-``none`` cache holding the K/V of ``ids`` in ``block_tokens`` blocks (nothing in the residual):
    the state every predictor's file is written from."""
    config = CompressionConfig(mode="none", block_tokens=block_tokens, residual_tokens=0)
    cache = CompressedCache(config, model=model, calibration=calibration)
    with torch.inference_mode():
        model(ids, cache=cache, logits_to_keep=1)
    return cache


def layer_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) ``[batch, kv_heads, tokens, head_dim]`` of every K/V layer of a cache."""
    layers = cache.kv_layers() if hasattr(cache, "kv_layers") else cache.layers
    return [(layer.keys, layer.values) for layer in layers]


def prefill_seconds(model, ids: torch.Tensor, repeats: int = 2) -> float:
    """Best wall time of a plain `DynamicCache` prefill of ``ids``."""
    with torch.inference_mode():
        return timed(lambda: model(ids, cache=DynamicCache(), logits_to_keep=1), repeats)[1]


def predictor_row(model, cache: CompressedCache, ids: torch.Tensor, spec: str, folder: Path, *,
                  prefill_s: float, block_tokens: int) -> dict[str, Any]:
    """Save ``cache`` with predictor ``spec``, load it back, and measure: K/V bits per scalar (mean and per
    layer), whole-file bits with headers, ratio, encode/decode throughput, model-rerun cost, bit exactness."""
    label, name, k = parse_predictor(spec)
    pred_name = "context" if name == "generic" else name
    path = folder / f"{spec.replace(':', '')}.kvc"
    predictor = make_predictor(pred_name, calibration=cache.calibration, model=model,
                               settings=settings_for(pred_name, {"probe_layer": k} if k else {}))
    rerun_s = 0.0
    if not predictor.practical_in_generation:
        with torch.inference_mode():
            rerun_s = timed(lambda: predictor.model_extras(ids), 2)[1]
    _, save_s, save_cpu = timed(lambda: cache.save(path, predictor=pred_name, probe_layer=k))
    config = CompressionConfig(mode="none", block_tokens=block_tokens, residual_tokens=0)
    loaded, load_s, load_cpu = timed(
        lambda: CompressedCache.load(path, model=model, calibration=cache.calibration, config=config)
    )
    originals = layer_kv(cache)
    exact = all(same_bits(a, c) and same_bits(b, d) for (a, b), (c, d) in zip(originals, layer_kv(loaded)))
    per_layer = stream_bytes(read_header(path))
    scalars = originals[0][0].numel()  # per layer and kind
    file_bytes = path.stat().st_size
    path.unlink()
    k_bits = [8 * layer["k"] / scalars for layer in per_layer]
    v_bits = [8 * layer["v"] / scalars for layer in per_layer]
    side_bits = [8 * layer["side"] / (2 * scalars) for layer in per_layer]
    total_scalars = 2 * scalars * len(per_layer)
    all_bits = 8 * file_bytes / total_scalars
    dtype_bits = 8 * originals[0][0].element_size()
    return {
        "method": label,
        "kind": "predictor",
        "k_bits": sum(k_bits) / len(k_bits),
        "v_bits": sum(v_bits) / len(v_bits),
        "side_bits": sum(side_bits) / len(side_bits),
        "bits_per_scalar": all_bits,
        "ratio": dtype_bits / all_bits,
        "enc_mps": total_scalars / save_s / 1e6,
        "dec_mps": total_scalars / load_s / 1e6,
        "enc_cpu_mps": total_scalars / max(save_cpu, 1e-9) / 1e6,
        "dec_cpu_mps": total_scalars / max(load_cpu, 1e-9) / 1e6,
        "save_s": save_s,
        "load_s": load_s,
        "rerun_s": rerun_s,
        "rerun_fraction_of_prefill": rerun_s / prefill_s if prefill_s else None,
        "bit_exact": exact,
        "file_bytes": file_bytes,
        "per_layer_k": k_bits,
        "per_layer_v": v_bits,
    }


def baseline_rows(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """Each baseline on every layer's K and V separately (one tensor each), with per-layer K/V bits."""
    tensors = [t for pair in kv for t in pair]  # k0, v0, k1, v1, ...
    per_tensor = tensors[0].numel()
    dtype_bits = 8 * tensors[0].element_size()
    rows: list[dict[str, Any]] = [{
        "method": f"raw {str(tensors[0].dtype).replace('torch.', '')}", "kind": "baseline", "available": True,
        "k_bits": float(dtype_bits), "v_bits": float(dtype_bits), "bits_per_scalar": float(dtype_bits),
        "ratio": 1.0, "per_layer_k": [float(dtype_bits)] * len(kv), "per_layer_v": [float(dtype_bits)] * len(kv),
    }]
    for method in methods:
        row = baseline_bits(tensors, method)
        row["kind"] = "baseline"
        if row["available"]:
            bits = row.pop("bits")
            row["per_layer_k"] = [b / per_tensor for b in bits[0::2]]
            row["per_layer_v"] = [b / per_tensor for b in bits[1::2]]
            row["k_bits"] = float(np.mean(row["per_layer_k"]))
            row["v_bits"] = float(np.mean(row["per_layer_v"]))
            row["ratio"] = dtype_bits / row["bits_per_scalar"]
        rows.append(row)
    return rows


def parse_window(spec: str):
    if spec.startswith("fixed-"):
        return CodecConfig(coder="ans", window="fixed", fixed_window=int(spec.split("-")[1]))
    return CodecConfig(coder="ans", window=spec)  # the adaptive window schedulers are the ``ans`` coder's


def window_rows(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], schedulers: Sequence[str],
                tokens: int) -> list[dict[str, Any]]:
    """The codec's window scheduler on real K/V: all layers' keys as one tensor, values as another (the first
    ``tokens`` tokens), per-(layer, head, channel) mean/std of those tokens as the prediction; per scheduler the
    rate and the histogram of window lengths (`codec.encode_with_stats`)."""
    keys = torch.stack([k[..., :tokens, :] for k, _ in kv]).contiguous()
    values = torch.stack([v[..., :tokens, :] for _, v in kv]).contiguous()
    rows = []
    for spec in schedulers:
        config = parse_window(spec)
        hist: dict[int, int] = {}
        tiers: dict[int, int] = {}
        total_bytes = 0
        model_bits = 0.0
        n = 0
        start = time.perf_counter()
        for t in (keys, values):
            f = t.float()
            mean, std = f.mean(dim=3, keepdim=True), f.std(dim=3, keepdim=True).clamp_min(1e-6)
            _, st = encode_with_stats(t, mean, std, config, decode=False, exact=False)
            for length, count in st.window_hist.items():
                hist[int(length)] = hist.get(int(length), 0) + count
            for tier, count in st.tier_hist.items():
                tiers[int(tier)] = tiers.get(int(tier), 0) + count
            total_bytes += st.total_bytes
            model_bits += st.model_bits
            n += st.n_elements
        seconds = time.perf_counter() - start
        windows = sum(hist.values())
        rows.append({
            "scheduler": spec,
            "bits_per_scalar": 8 * total_bytes / n,
            "ideal_bits_per_scalar": model_bits / n,
            "windows": windows,
            "mean_window": n / max(1, windows),
            "window_hist": {str(k): v for k, v in sorted(hist.items())},
            "tier_hist": {str(k): v for k, v in sorted(tiers.items())},
            "encode_mps": n / seconds / 1e6,
            "scalars": n,
        })
    return rows


def cache_held_bytes(cache) -> int:
    """Bytes a cache holds now: `CompressedCache.stats` where it has one, else its layers' K/V tensors."""
    if isinstance(cache, CompressedCache):
        return int(cache.stats()["stored_bytes"])
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4)


def generation_rows(model, prompt: torch.Tensor, calibration, *, caches: Sequence[str], new_tokens: int,
                    block_tokens: int, residual_tokens: int, progress: bool = True, step=None) -> list[dict[str, Any]]:
    """Greedy generation of ``new_tokens`` after ``prompt`` with each cache kind (``dynamic``, ``none``,
    ``lossless``): tokens/s, peak memory growth, bytes held at the end, identity with DynamicCache."""
    rows = []
    reference = None
    order = ["dynamic"] + [c for c in caches if c != "dynamic"]
    greedy_generate(model, prompt[:, :8], DynamicCache(), 2)  # warm-up: first-call allocations and kernels
    for kind in order:
        if step is not None:
            step(f"generation: {kind}")
        if kind == "dynamic":
            cache = DynamicCache()
        else:
            config = CompressionConfig(mode=kind, block_tokens=block_tokens, residual_tokens=residual_tokens)
            cache = CompressedCache(config, model=model, calibration=calibration if kind == "lossless" else None)
        with PeakMemory() as mem:
            run = greedy_generate(model, prompt, cache, new_tokens, progress=f"generating ({kind})" if progress else None)
        if reference is None:
            reference = run
        row = {
            "cache": {"dynamic": "DynamicCache", "none": "CompressedCache none",
                      "lossless": "CompressedCache lossless (context)"}[kind],
            "kind": kind,
            "prompt_tokens": prompt.shape[1],
            "new_tokens": new_tokens,
            "seconds": run.seconds,
            "tokens_per_s": run.tokens_per_second,
            "peak_rss_growth_bytes": mem.peak_bytes,
            "held_bytes": cache_held_bytes(cache),
            "identical_to_dynamic": bool(torch.equal(run.sequences, reference.sequences)),
        }
        if isinstance(cache, CompressedCache):
            stats = cache.stats()
            row["bits_per_scalar"] = stats["bits_per_scalar"]
            row["compression_ratio"] = stats["compression_ratio"]
        if kind in caches:
            rows.append(row)
        del cache, run
    base = next((r for r in rows if r["kind"] == "dynamic"), None)
    for row in rows:
        if base is not None:
            row["speed_vs_dynamic"] = row["tokens_per_s"] / base["tokens_per_s"]
    return rows


def run_lossless(model, ids: torch.Tensor, calibration, *, predictors: Sequence[str], baselines: Sequence[str],
                 windows: Sequence[str], window_tokens: int, block_tokens: int, work_dir: str | Path | None = None,
                 step=None) -> dict[str, Any]:
    """The lossless table for the K/V of ``ids``: predictor rows, baseline rows and window-scheduler rows.
    ``step(name)`` is called before each unit of work (progress reporting)."""
    step = step or (lambda name: None)
    step("lossless: prefill")
    prefill_s = prefill_seconds(model, ids)
    caches: dict[bool, CompressedCache] = {}
    needs_generic = "generic" in predictors
    needs_calibrated = any(p != "generic" for p in predictors)
    if needs_generic:
        caches[False] = prefilled_cache(model, ids, None, block_tokens)
    if needs_calibrated:
        caches[True] = prefilled_cache(model, ids, calibration, block_tokens)
    any_cache = caches.get(True) or caches.get(False)
    kv = layer_kv(any_cache) if any_cache is not None else layer_kv(prefilled_cache(model, ids, None, block_tokens))
    rows = []
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        for spec in predictors:
            step(f"lossless: predictor {spec}")
            cache = caches[spec != "generic"]
            rows.append(predictor_row(model, cache, ids, spec, Path(tmp), prefill_s=prefill_s,
                                      block_tokens=block_tokens))
    step("lossless: baselines")
    base = baseline_rows(kv, baselines)
    step("lossless: window schedulers")
    win = window_rows(kv, windows, window_tokens) if windows else []
    layers = len(kv)
    _batch, heads, tokens, dim = kv[0][0].shape
    return {
        "tokens": tokens,
        "layers": layers,
        "kv_heads": heads,
        "head_dim": dim,
        "dtype": str(kv[0][0].dtype).replace("torch.", ""),
        "prefill_s": prefill_s,
        "predictors": rows,
        "baselines": base,
        "windows": win,
    }
