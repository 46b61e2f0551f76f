"""Benchmark the lossless codec on a real SmolLM2-135M bf16 KV cache (one codec benchmark: what were
eval/bench_codec.py and eval/bench_lanes.py).

Prefills >= 2048 tokens of held-out Shakespeare, takes the DynamicCache (30 layers x K/V x 3 heads x T x 64,
bf16) and codes it as two tensors (all K, all V). Sections (``--sections``, comma-separated, default all):

1. ``rate``: rate and speed of raw, zstd -3 / -19, zipnn, the ideal exponent-Huffman bound (DFloat11 style), this
   codec with ``mean=None`` and with a per-channel mean/std (per layer, K/V, head, channel, fitted on
   calibration text that does not overlap the coded text), with the ideal ``-sum log2 q`` beside the real
   stream size;
2. ``windows``: adaptive windows (metadata / predicted / causal) against fixed 64 / 256 / 1024 / 4096: rate,
   decode throughput with 1 and 2 workers, window histogram, per-window bitrate spread, decode time per window
   size, locality-prediction accuracy;
3. ``realistic``: what the lossless cache really codes, i.e. one stream per (batch row, K/V, head,
   ``--block-tokens`` block), channel-major ``[64, 256]``, with per-element mean and std from the calibrated
   ``context`` predictor (captured from ``CompressedCache.save(..., predictor="context")``): rate (real and
   ideal), header bytes per stream, encode / decode M scalars/s on one thread for several codec settings;
4. ``lanes``: throughput and rate of the lanes codec (`CodecConfig(coder="lanes")`) against ``ans`` streams on
   one cache block: 2 (K/V) x 3 heads x 256 tokens x 64 dims, bf16, coded as N = 6 streams of [256, 64]
   (``--batch`` multiplies N), KV-like synthetic values (``--real``: a SmolLM2 layer's K/V, ``--layer``), with
   per-channel (``channel``) and per-element (``element``) statistics: bits/scalar of both, encode and decode
   M scalars/s on 1 and 2 threads (best of ``--lanes-repeats``), the 1-thread decode also in thread CPU time;
5. ``fast``: the decode step's coders side by side on every layer's blocks as generation holds them (``--tokens``
   of text in ``--block-tokens`` blocks, channel-major streams with per-channel bf16 mean / std): ``huff``
   (docs/codec.md "The huff coder"), ``lanes`` and ``zipnn`` (one call per stream): bits/scalar with headers and
   tables, and one-thread decode M scalars/s (a layer per call, into ``out=``; best of ``--lanes-repeats``), in
   wall time and in the thread's CPU time (which other processes on a shared machine do not inflate).

Writes bench_codec.json, bench_codec.txt (the tables) and, with sections 1 and 2, bench_codec.png.

    hf-kvcompress bench codec [--out DIR] [--tokens 2048] [--sections rate,windows,realistic,lanes,fast]

Takes ~10 minutes on 2 cores (``--sections realistic``: ~2 minutes; ``lanes``: seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, blockcoder, codec
from hf_kvcompress.codec import CodecConfig

from ..baselines import baselines, timed
from .common import Workload, out_folder, workload
from .options import SECTIONS

FIXED_SIZES = (64, 256, 1024, 4096)
ADAPTIVE_MODES = ("metadata", "predicted", "causal")


# ------------------------------------------------------------------ model, text, KV


@torch.no_grad()
def prefill_kv(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer, stacked: [layers, 1, kv_heads, T, head_dim] bf16."""
    cache = DynamicCache()
    try:  # transformers 5 names it `cache` (past_key_values is deprecated)
        model(ids, cache=cache, use_cache=True)
    except TypeError:
        model(ids, past_key_values=cache, use_cache=True)
    keys = torch.stack([layer.keys for layer in cache.layers])
    values = torch.stack([layer.values for layer in cache.layers])
    return keys.contiguous(), values.contiguous()


def channel_stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, head, channel) mean and std over tokens: shape [L, 1, H, 1, D]."""
    f = t.float()
    return f.mean(dim=3, keepdim=True), f.std(dim=3, keepdim=True)


# ------------------------------------------------------------------ baselines


def run_codec(name: str, tensors, stats_args, cfg: CodecConfig, *, exact: bool, workers=(1, 2),
              threads: bool = False) -> dict:
    """Encode each tensor (with stats), then time plain encode and decode with 1 and 2 workers."""
    n = sum(t.numel() for t in tensors)
    blobs, stats = [], []
    for t, (m, s) in zip(tensors, stats_args):
        blob, st = codec.encode_with_stats(t, m, s, cfg, decode=True, exact=exact)
        blobs.append(blob)
        stats.append(st)
    _, te, tec = timed(lambda: [codec.encode(t, m, s, cfg) for t, (m, s) in zip(tensors, stats_args)])
    dec, dec_cpu = {}, {}
    for w in workers:
        if cfg.window == "causal" and w > 1:
            dec[w] = dec_cpu[w] = None  # serial boundary discovery: nothing to spread over workers
            continue
        best_wall = best_cpu = math.inf
        for _ in range(2 if w > 1 else 1):
            wall, cpu = decode_times(blobs, tensors, stats_args, w)
            best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
        dec[w], dec_cpu[w] = n / best_wall / 1e6, n / best_cpu / 1e6
    dec_threads = None
    if threads:  # constriction holds the GIL: threads only overlap the numpy work
        _, tw, _ = timed(lambda: [codec.decode(b, m, s, threads=2) for b, (m, s) in zip(blobs, stats_args)], 2)
        dec_threads = n / tw / 1e6
    real_bits = 8 * sum(map(len, blobs))
    model_bits = sum(st.model_bits for st in stats)
    side_bits = 8 * sum(st.header_bytes + st.table_bytes for st in stats)
    hist: dict[int, int] = {}
    for st in stats:
        for k, v in st.window_hist.items():
            hist[k] = hist.get(k, 0) + v
    lengths = np.repeat(np.array(list(hist)), np.array(list(hist.values()))) if hist else np.zeros(0)
    per_size: dict[str, float] = {}
    for st in stats:
        for k, v in st.decode_seconds_by_window.items():
            per_size[k] = per_size.get(k, 0.0) + v
    tier_names = {0: "<=256", 1: "<=1024", 2: ">1024"}
    tiers: dict[str, int] = {}
    for st in stats:
        for k, v in st.tier_hist.items():
            tiers[tier_names[k]] = tiers.get(tier_names[k], 0) + v
    us_by_size = {}
    for size_bucket in sorted({_bucket(k) for k in per_size}):
        secs = sum(v for k, v in per_size.items() if _bucket(k) == size_bucket)
        elems = sum(k * hist[k] for k in per_size if _bucket(k) == size_bucket)
        us_by_size[size_bucket] = 1e6 * secs / max(1, elems)
    row = {
        "method": name,
        "window": cfg.window if cfg.window != "fixed" else f"fixed {cfg.fixed_window}",
        "bits_per_scalar": real_bits / n,
        "ideal_model_bits_per_scalar": model_bits / n,
        "side_info_bits_per_scalar": side_bits / n,
        "real_over_ideal_plus_headers": real_bits / (model_bits + side_bits) - 1.0,
        "within_1pct": real_bits <= 1.01 * model_bits + side_bits,
        "escape_rate": sum(st.escapes for st in stats) / n,
        "enc_mps": n / te / 1e6,
        "enc_cpu_mps": n / tec / 1e6,
        "dec_mps_1_worker": dec.get(1),
        "dec_mps_2_workers": dec.get(2),
        "dec_mps_2_threads": dec_threads,
        "dec_cpu_mps_1_worker": dec_cpu.get(1),
        "dec_cpu_mps_2_workers": dec_cpu.get(2),
        "windows": int(lengths.size),
        "mean_window": float(lengths.mean()) if lengths.size else 0.0,
        "tier_hist": tiers,
        "window_hist_top": dict(sorted(hist.items(), key=lambda kv: -kv[1])[:6]),
        "window_bits_mean": float(np.mean([st.window_bits_mean for st in stats])),
        "window_bits_var": float(np.mean([st.window_bits_var for st in stats])),
        "decode_us_per_element_by_window": us_by_size,
        "locality": [st.locality for st in stats],
    }
    if exact:
        row["ideal_exact_mixture_bits_per_scalar"] = sum(st.exact_bits for st in stats) / n
        row["ideal_exact_codec_weights_bits_per_scalar"] = sum(st.exact_codec_bits for st in stats) / n
        row["table_approximation_cost_bits"] = row["ideal_model_bits_per_scalar"] - row[
            "ideal_exact_codec_weights_bits_per_scalar"]
    return row


def decode_times(blobs, tensors, stats_args, workers: int) -> tuple[float, float]:
    """(wall seconds, critical-path CPU seconds) of decoding every blob. The machine is shared, so wall
    time under load understates what a free core does; CPU time of the busiest process (this one, or the
    forked worker) is what a dedicated core per worker would take."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    outs = [codec.decode(b, m, s, workers=workers) for b, (m, s) in zip(blobs, stats_args)]
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    kids = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    for o, t in zip(outs, tensors):
        assert torch.equal(o.view(torch.int16), t.view(torch.int16))
    # with w workers this process does 1/w of the windows and each child one share: the busiest of them
    return wall, max(cpu, kids / max(1, workers - 1))


def _bucket(length: int) -> str:
    for edge in (64, 128, 256, 512, 1024, 2048, 4096):
        if length <= edge:
            return f"<={edge}"
    return ">4096"


# ------------------------------------------------------------------ realistic streams (context predictor)

REALISTIC_CONFIGS = (
    ("4096 windows, full header (old cache default)", dict(fixed_window=4096)),
    ("one window, full header", dict(fixed_window=65536)),
    ("one window, compact header", dict(fixed_window=65536, header="compact")),
    ("one window, compact, mean_steps=4 (cache)", dict(fixed_window=65536, header="compact", mean_steps=4)),
    ("one window, compact, mean_steps=2", dict(fixed_window=65536, header="compact", mean_steps=2)),
    ("4096 windows, compact, mean_steps=4", dict(fixed_window=4096, header="compact", mean_steps=4)),
)


def capture_streams(work: Workload, tokens: int, block_tokens: int = 256,
                    offset: int = 4096) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every (x, mean, std) the lossless cache hands the codec when it stores ``tokens`` tokens of held-out
    text with the calibrated context predictor (``block_tokens`` blocks; x channel-major [64, 256] bf16).
    The streams are caught on their way into the codec: `blockcoder` calls `encode_streams` (every coder), which
    is wrapped for the save."""
    model = work.model
    cal = work.default_calibration(("context",))
    ids = work.ids(tokens, split="evaluation", offset=offset)
    cache = CompressedCache(CompressionConfig(mode="none", block_tokens=block_tokens, residual_tokens=0),
                            model=model, calibration=cal)
    with torch.inference_mode():
        model(ids, cache=cache)
    captured = []
    encode_streams = blockcoder.encode_streams

    def spy(x, mean, std, config, **kwargs):
        for i in range(x.shape[0]):
            captured.append((x[i].clone(), mean[i].float().expand(x[i].shape).clone(),
                             std[i].float().expand(x[i].shape).clone()))
        return encode_streams(x, mean, std, config, **kwargs)

    blockcoder.encode_streams = spy
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cache.save(Path(tmp) / "cache", predictor="context")
    finally:
        blockcoder.encode_streams = encode_streams
    return captured


def realistic_rates(streams, name: str, cfg: CodecConfig) -> dict:
    """Rate of one setting: real stream bytes and the ideal -sum log2 q under the codec's integer model."""
    n = sum(x.numel() for x, _, _ in streams)
    stats = [codec.encode_with_stats(x, m, s, cfg)[1] for x, m, s in streams]
    return {"method": name, "bits_per_scalar": 8 * sum(st.total_bytes for st in stats) / n,
            "ideal_model_bits_per_scalar": sum(st.model_bits for st in stats) / n,
            "header_bytes": stats[0].header_bytes, "table_bytes": stats[0].table_bytes, "streams": len(streams)}


def realistic_speeds(streams, configs: list[CodecConfig], repeats: int) -> list[tuple[float, float]]:
    """Best-of-``repeats`` one-thread CPU seconds (encode, decode) per setting, the settings interleaved in
    every round so that load from other jobs on the shared machine hits them alike."""
    best = [[float("inf"), float("inf")] for _ in configs]
    for _ in range(repeats):
        for i, cfg in enumerate(configs):
            blobs, _, enc = timed(lambda cfg=cfg: [codec.encode(x, m, s, cfg) for x, m, s in streams])
            outs, _, dec = timed(lambda cfg=cfg, blobs=blobs: [codec.decode(b, m, s, config=cfg)
                                                               for b, (_, m, s) in zip(blobs, streams)])
            assert all(torch.equal(o.view(torch.int16), x.view(torch.int16)) for o, (x, _, _) in zip(outs, streams))
            best[i] = [min(best[i][0], enc), min(best[i][1], dec)]
    return [(a, b) for a, b in best]


def realistic_section(work: Workload, tokens: int, block_tokens: int, offset: int, streams_file: str | None = None,
                      repeats: int = 3) -> tuple[list[dict], str]:
    """Section 3. ``streams_file``: load captured streams from there if it exists, else capture and save."""
    if streams_file and Path(streams_file).exists():
        streams = torch.load(streams_file)
    else:
        streams = capture_streams(work, tokens, block_tokens, offset)
        if streams_file:
            torch.save(streams, streams_file)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        configs = [CodecConfig(coder="ans", **kw) for _, kw in REALISTIC_CONFIGS]
        codec.encode(*streams[0], configs[0])  # build the tables outside the timings
        rows = [realistic_rates(streams, name, cfg) for (name, _), cfg in zip(REALISTIC_CONFIGS, configs)]
        n = sum(x.numel() for x, _, _ in streams)
        for r, (enc, dec) in zip(rows, realistic_speeds(streams, configs, repeats)):
            r["enc_cpu_mps"], r["dec_cpu_mps"] = n / enc / 1e6, n / dec / 1e6
    finally:
        torch.set_num_threads(threads)
    n = sum(x.numel() for x, _, _ in streams)
    cols = [("setting", "method", 46), ("bits/scalar", "bits_per_scalar", 11),
            ("ideal -log2q", "ideal_model_bits_per_scalar", 12), ("header B", "header_bytes", 8),
            ("table B", "table_bytes", 7), ("enc cpu M/s", "enc_cpu_mps", 11), ("dec cpu M/s", "dec_cpu_mps", 11)]
    title = (f"\n== realistic streams: context predictor, {len(streams)} streams of {streams[0][0].shape[0]}x"
             f"{streams[0][0].shape[1]} bf16 ({n / 1e6:.2f} M scalars), one thread, CPU time, best of {repeats} "
             f"(load average {os.getloadavg()[0]:.1f}) ==")
    return rows, print_table(title, rows, cols)


# ------------------------------------------------------------------ printing


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def print_table(title: str, rows: list[dict], cols: list[tuple]) -> str:
    """Columns are (header, key, width[, format]); floats default to 4 decimals for bits, else 2."""
    lines = [title, "  ".join(f"{c[0]:>{c[2]}}" if i else f"{c[0]:<{c[2]}}" for i, c in enumerate(cols))]
    for r in rows:
        cells = []
        for i, c in enumerate(cols):
            key, w = c[1], c[2]
            v = r.get(key)
            if isinstance(v, bool):
                s = "yes" if v else "NO"
            elif isinstance(v, float):
                s = format(v, c[3] if len(c) > 3 else (".4f" if "bits" in key else ".2f"))
            else:
                s = "-" if v is None else str(v)
            cells.append(f"{s:<{w}}" if i == 0 else f"{s:>{w}}")
        lines.append("  ".join(cells))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(path: Path, base_rows: list[dict], codec_rows: list[dict], window_rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    rows = [r for r in base_rows + codec_rows if r.get("bits_per_scalar") is not None]
    a.barh([r["method"] for r in rows], [r["bits_per_scalar"] for r in rows], color="tab:blue")
    for r in codec_rows:
        a.plot(r["ideal_model_bits_per_scalar"], r["method"], "k|", ms=14)
    a.set_xlabel("bits / scalar (| = ideal -sum log2 q)")
    a.set_title("SmolLM2-135M bf16 KV cache")
    a.invert_yaxis()
    for r in window_rows:  # CPU-bound throughput: wall clock on the shared machine is mostly other jobs' load
        for w, key, mk in ((1, "dec_cpu_mps_1_worker", "o"), (2, "dec_cpu_mps_2_workers", "s")):
            if r.get(key):
                b.scatter(r["bits_per_scalar"], r[key], marker=mk, color="tab:red" if "fixed" in r["window"] else "tab:green")
                b.annotate(f"{r['window']} ({w}w)", (r["bits_per_scalar"], r[key]), fontsize=7)
    b.set_xlabel("bits / scalar")
    b.set_ylabel("decode M scalars / s (busiest process's CPU time)")
    b.set_title("windows: fixed (red) vs adaptive (green); o 1 worker, s 2 workers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


LANES = CodecConfig(coder="lanes")
ANS = CodecConfig(coder="ans", header="compact", fixed_window=65536)


def synthetic_block(batch: int, seed: int = 0):
    """x [N, 256, 64] bf16 and its generating per-element mean / std (KV-like spreads)."""
    g = torch.Generator().manual_seed(seed)
    n = 6 * batch
    scale = torch.rand(n, 1, 64, generator=g) * 2 + 0.05
    scale[..., :3] *= 20  # outlier channels, as in real K
    offset = torch.randn(n, 1, 64, generator=g) * 2
    drift = torch.randn(n, 256, 64, generator=g).cumsum(1) * 0.05 * scale  # slow per-token drift
    mean = offset + drift
    spread = scale * (0.3 + 0.2 * torch.rand(n, 256, 64, generator=g))
    x = (mean + spread * torch.randn(n, 256, 64, generator=g)).to(torch.bfloat16)
    return x, mean, spread


def real_block(work: Workload, batch: int, layer: int):
    model = work.model
    ids = work.ids(256 * batch, split="evaluation")
    with torch.no_grad():
        out = model(ids.reshape(batch, 256), use_cache=True)
    kv = out.past_key_values
    k, v = kv.layers[layer].keys, kv.layers[layer].values  # [B, H, T, D]
    x = torch.stack([k, v], 1).reshape(-1, k.shape[2], k.shape[3]).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    xf = x.float()
    spread = xf.std(1, keepdim=True) * 0.25 + 1e-3
    mean = xf + torch.randn(x.shape, generator=g) * spread
    return x, mean, spread.expand_as(xf).contiguous()


def best(fn, repeats: int, clock=time.perf_counter) -> float:
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return min(out)


def lanes_row(x: torch.Tensor, mean, std, repeats: int) -> dict:
    n = x.numel()
    blobs = codec.encode_batch(x, mean, std, LANES)
    y = codec.decode_batch(blobs, mean, std, LANES)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    row: dict = {"lanes_bits": 8 * sum(map(len, blobs)) / n}

    def pick(s, i: int):
        return s[i] if isinstance(s, torch.Tensor) and s.shape[0] == x.shape[0] else s

    ans = [codec.encode(x[i], pick(mean, i), pick(std, i), ANS) for i in range(x.shape[0])]
    row["ans_bits"] = 8 * sum(map(len, ans)) / n
    out = torch.empty_like(x)
    for th in (1, 2):
        row[f"enc_{th}"] = n / best(lambda th=th: codec.encode_batch(x, mean, std, LANES, threads=th), repeats) / 1e6
        row[f"dec_{th}"] = n / best(lambda th=th: codec.decode_batch(blobs, mean, std, LANES, out=out, threads=th),
                                    repeats) / 1e6
    row["dec_1_cpu"] = n / best(lambda: codec.decode_batch(blobs, mean, std, LANES, out=out), repeats,
                                time.thread_time) / 1e6
    row["ans_dec_1"] = n / best(
        lambda: [codec.decode(b, pick(mean, i), pick(std, i), config=ANS) for i, b in enumerate(ans)],
        max(1, repeats // 2)) / 1e6
    return row


def lanes_section(work: Workload | None, batch: int, layer: int, repeats: int) -> tuple[dict, str]:
    """Section 4: the lanes coder against ``ans`` on one cache block (``work``: real K/V, else synthetic)."""
    x, mean_e, std_e = real_block(work, batch, layer) if work is not None else synthetic_block(batch)
    xf = x.float()
    mean_c, std_c = xf.mean(1, keepdim=True), xf.std(1, keepdim=True)
    src = f"{work.name} layer {layer}" if work is not None else "synthetic KV-like"
    lines = [f"\n== lanes against ans: block {tuple(x.shape)} bf16 ({src}), {x.numel()} scalars; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f} ==",
             f"{'stats':8} {'lanes b/s':>9} {'ans b/s':>8} {'delta':>7} | {'enc 1t':>7} {'enc 2t':>7} | "
             f"{'dec 1t':>7} {'dec 2t':>7} {'dec 1t cpu':>10} | {'ans dec 1t':>10}   (M scalars/s)"]
    codec.decode_batch(codec.encode_batch(x[:1], 0.0, 1.0, LANES), 0.0, 1.0, LANES)  # compile / load the cache
    rows = {}
    with np.errstate(all="ignore"):
        for name, m, s in (("channel", mean_c, std_c), ("element", mean_e, std_e)):
            r = rows[name] = lanes_row(x, m, s, repeats)
            lines.append(f"{name:8} {r['lanes_bits']:9.4f} {r['ans_bits']:8.4f} {r['lanes_bits'] - r['ans_bits']:+7.4f} | "
                         f"{r['enc_1']:7.1f} {r['enc_2']:7.1f} | {r['dec_1']:7.1f} {r['dec_2']:7.1f} "
                         f"{r['dec_1_cpu']:10.1f} | {r['ans_dec_1']:10.2f}")
    text = "\n".join(lines)
    print(text, flush=True)
    return {"source": src, "shape": list(x.shape), "rows": rows}, text


# ------------------------------------------------------------------ fast: the decode step's coder

HUFF = CodecConfig(coder="huff")


def fast_streams(work: Workload, tokens: int, block_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer, its blocks as generation codes them: streams ``[blocks * 2 * heads, head_dim, block_tokens]``
    (channel-major) with ``generic``'s per-channel mean and std (bf16 side data, as floats)."""
    k, v = prefill_kv(work.model, work.ids(tokens))  # [L, 1, H, T, D]
    n = tokens // block_tokens * block_tokens
    out = []
    for layer in range(k.shape[0]):
        kv = torch.stack([k[layer, 0, :, :n], v[layer, 0, :, :n]])  # [2, H, n, D]
        _, h, _, d = kv.shape
        x = kv.reshape(2, h, n // block_tokens, block_tokens, d).permute(2, 0, 1, 4, 3).reshape(-1, d, block_tokens)
        xf = x.float()
        mean = xf.mean(-1, keepdim=True).bfloat16().float()
        std = xf.std(-1, keepdim=True, correction=0).clamp_min(1e-6).bfloat16().float()
        out.append((x.contiguous(), mean, std))
    return out


def fast_row(name: str, layers, repeats: int) -> dict:
    """Rate (stream bytes, headers and tables included) and one-thread decode speed of one coder over every
    layer's blocks, a layer per call as a decode step makes them (``zipnn``: one call per stream)."""
    n = sum(x.numel() for x, _, _ in layers)
    if name == "zipnn":
        try:
            import zipnn
        except ImportError:
            return {"coder": name, "missing": "pip install zipnn (the eval extra)"}
        zn = zipnn.ZipNN(input_format="torch", bytearray_dtype="bfloat16", threads=1)
        coded = [[zn.compress(s.clone()) for s in x] for x, _, _ in layers]  # it reorders its input in place
        for (x, _, _), blobs in zip(layers, coded):
            assert torch.equal(torch.stack([zn.decompress(b) for b in blobs]).view(torch.int16), x.view(torch.int16))
        run = lambda: [zn.decompress(b) for blobs in coded for b in blobs]  # noqa: E731
        return {"coder": name, "bits_per_scalar": 8 * sum(len(b) for c in coded for b in c) / n,
                "decode_mps": n / best(run, repeats) / 1e6, "decode_cpu_mps": n / best(run, repeats, time.thread_time) / 1e6}
    cfg = HUFF if name == "huff" else LANES
    coded = [codec.encode_batch(x, m, s, cfg) for x, m, s in layers]
    outs = [torch.empty_like(x) for x, _, _ in layers]
    for (x, m, s), blobs, out in zip(layers, coded, outs):
        codec.decode_batch(blobs, m, s, cfg, out=out)
        assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    def run():
        for (_, m, s), b, o in zip(layers, coded, outs):
            codec.decode_batch(b, m, s, cfg, out=o, threads=1, verify=False)

    return {"coder": name, "bits_per_scalar": 8 * sum(len(b) for c in coded for b in c) / n,
            "decode_mps": n / best(run, repeats) / 1e6, "decode_cpu_mps": n / best(run, repeats, time.thread_time) / 1e6}


def fast_section(work: Workload, tokens: int, block_tokens: int, repeats: int) -> tuple[dict, str]:
    """Section 5: the decode step's candidates side by side (huff, lanes, zipnn) on the blocks generation holds."""
    torch.set_num_threads(1)
    layers = fast_streams(work, tokens, block_tokens)
    x0 = layers[0][0]
    rows = [fast_row(name, layers, repeats) for name in ("huff", "lanes", "zipnn")]
    lanes_bits = rows[1]["bits_per_scalar"]
    lines = [f"\n== fast coders: {len(layers)} layers x {x0.shape[0]} streams of {tuple(x0.shape[1:])} bf16 "
             f"({work.name}, {tokens} tokens, {block_tokens}-token blocks, per-channel stats), one thread; "
             f"load {os.getloadavg()[0]:.1f} ==",
             f"{'coder':8} {'bits/scalar':>11} {'vs lanes':>9} {'decode M/s':>10} {'(thread CPU)':>12}"]
    for r in rows:
        if "missing" in r:
            lines.append(f"{r['coder']:8} missing: {r['missing']}")
            continue
        r["vs_lanes"] = r["bits_per_scalar"] - lanes_bits
        lines.append(f"{r['coder']:8} {r['bits_per_scalar']:11.4f} {r['vs_lanes']:+9.4f} {r['decode_mps']:10.1f} "
                     f"{r['decode_cpu_mps']:12.1f}")
    text = "\n".join(lines)
    print(text, flush=True)
    return {"tokens": tokens, "block_tokens": block_tokens, "rows": rows}, text


# ------------------------------------------------------------------ main

#: smoke: where in the random token ids the realistic section's text starts (4096 with text)
SMOKE_OFFSET = 0


def run(args: argparse.Namespace) -> int:
    from hf_kvcompress.errors import CliError

    out = out_folder(args, "codec")
    sections = SECTIONS if args.sections == "all" else tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise CliError(f"--sections takes all or names among {list(SECTIONS)}, got {args.sections!r}")
    if args.replot:
        saved = json.loads((out / "bench_codec.json").read_text())
        plot(out / "bench_codec.png", saved["baselines"], saved["codec"], saved["windows"])
        return 0
    torch.set_num_threads(2)
    report: dict = {"sections": list(sections),
                    "env": {"python": platform.python_version(), "torch": torch.__version__,
                            "numpy": np.__version__, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}}
    work = workload(args.smoke) if {"rate", "windows", "realistic", "fast"} & set(sections) or args.real else None
    if work is not None:
        report["model"] = work.name
    text: list[str] = []
    if {"rate", "windows"} & set(sections):
        whole_cache_sections(work, args, sections, report, text)
    if "realistic" in sections:
        report["realistic"], realistic_text = realistic_section(work, args.realistic_tokens, args.block_tokens,
                                                                SMOKE_OFFSET if args.smoke else 4096,
                                                                args.streams, args.repeats)
        text.append(realistic_text)
    if "lanes" in sections:
        report["lanes"], lanes_text = lanes_section(work if args.real else None, args.batch, args.layer,
                                                    args.lanes_repeats)
        text.append(lanes_text)
    if "fast" in sections:
        report["fast"], fast_text = fast_section(work, args.tokens, args.block_tokens, args.lanes_repeats)
        text.append(fast_text)
    report["env"]["loadavg_end"] = os.getloadavg()
    (out / "bench_codec.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "bench_codec.txt").write_text("\n".join(text) + "\n")
    written = ["bench_codec.json", "bench_codec.txt"]
    if {"rate", "windows"} <= set(sections):
        plot(out / "bench_codec.png", report["baselines"], report["codec"], report["windows"])
        written.append("bench_codec.png")
    print(f"\nsaved {', '.join(written)} in {out}")
    return 0


def whole_cache_sections(work: Workload, args, sections, report: dict, text: list[str]) -> None:
    """Sections 1 and 2: the whole cache as two tensors (all K, all V)."""
    t0 = time.perf_counter()
    model, ids, calib_ids = work.model, work.ids(args.tokens), work.ids(args.calib_tokens, split="calibration")
    with tqdm(total=2, desc="prefill (coded text, calibration text)") as bar:
        k, v = prefill_kv(model, ids)
        bar.update()
        kc, vc = prefill_kv(model, calib_ids)
        bar.update()
    n = k.numel() + v.numel()
    print(f"KV cache: K {tuple(k.shape)} + V {tuple(v.shape)} {k.dtype} = {n / 1e6:.2f} M scalars "
          f"({time.perf_counter() - t0:.0f} s to load and prefill)")
    report["cache"] = {"k_shape": list(k.shape), "v_shape": list(v.shape), "scalars": n, "tokens": args.tokens}
    km, ks = channel_stats(kc)
    vm, vs = channel_stats(vc)
    tensors = [k, v]
    per_channel = [(km, ks), (vm, vs)]
    no_stats = [(None, None), (None, None)]
    if "rate" in sections:
        rate_section(tensors, per_channel, no_stats, report, text)
    if "windows" in sections:
        windows_section(tensors, per_channel, report, text)


def rate_section(tensors, per_channel, no_stats, report: dict, text: list[str]) -> None:
    with tqdm(total=1, desc="baselines (zstd -19 is slow)") as bar:
        base_rows = baselines(tensors)
        bar.update()
    default = CodecConfig(coder="ans", window="fixed", fixed_window=4096)
    codec_rows = []
    for name, args_ in tqdm([("codec, mean=None", no_stats), ("codec, per-channel mean/std", per_channel)],
                            desc="codec (with exact-mixture ideal)"):
        codec_rows.append(run_codec(name, tensors, args_, default, exact=True, threads=True))

    cols = [("method", "method", 36), ("bits/scalar", "bits_per_scalar", 11),
            ("ideal -log2q", "ideal_model_bits_per_scalar", 12), ("enc M/s", "enc_mps", 8),
            ("enc cpu M/s", "enc_cpu_mps", 11),
            ("dec M/s", "dec_mps", 8), ("dec cpu M/s", "dec_cpu_mps", 11)]
    cols_par = [("method", "method", 30), ("dec 1 worker", "dec_mps_1_worker", 12),
                ("dec 2 threads", "dec_mps_2_threads", 13), ("dec 2 workers", "dec_mps_2_workers", 13),
                ("cpu-bound 1w", "dec_cpu_mps_1_worker", 12), ("cpu-bound 2w", "dec_cpu_mps_2_workers", 12)]
    main_rows = base_rows + [dict(r, dec_mps=r["dec_mps_1_worker"], dec_cpu_mps=r["dec_cpu_mps_1_worker"])
                             for r in codec_rows]
    text.append(print_table("\n== rate and speed (1 core; whole cache) ==", main_rows, cols))
    cols2 = [("method", "method", 30), ("real b/s", "bits_per_scalar", 9),
             ("ideal model", "ideal_model_bits_per_scalar", 11), ("headers", "side_info_bits_per_scalar", 8),
             ("real/(ideal+hdr)-1", "real_over_ideal_plus_headers", 18, ".4%"), ("<=1%", "within_1pct", 5),
             ("exact mix", "ideal_exact_mixture_bits_per_scalar", 10),
             ("exact, codec w", "ideal_exact_codec_weights_bits_per_scalar", 14),
             ("tables cost", "table_approximation_cost_bits", 11), ("escapes", "escape_rate", 8, ".5f")]
    text.append(print_table("\n== codec: real stream vs ideal -sum log2 q (bits/scalar) ==", codec_rows, cols2))
    text.append(print_table("\n== codec decode scaling (M scalars/s; wall clock on a shared machine, and the "
                            "busiest process's CPU time) ==", codec_rows, cols_par))
    report.update(baselines=base_rows, codec=codec_rows)


def windows_section(tensors, per_channel, report: dict, text: list[str]) -> None:
    window_rows = []
    configs = [CodecConfig(coder="ans", window="fixed", fixed_window=s) for s in FIXED_SIZES]
    configs += [CodecConfig(coder="ans", window=m) for m in ADAPTIVE_MODES]
    for cfg in tqdm(configs, desc="window schedulers (per-channel stats)"):
        window_rows.append(run_codec("per-channel", tensors, per_channel, cfg, exact=False))
    cols3 = [("window", "window", 12), ("bits/scalar", "bits_per_scalar", 11),
             ("enc M/s", "enc_mps", 8), ("dec 1w", "dec_mps_1_worker", 7), ("dec 2w", "dec_mps_2_workers", 7),
             ("cpu 1w", "dec_cpu_mps_1_worker", 7), ("cpu 2w", "dec_cpu_mps_2_workers", 7),
             ("windows", "windows", 8), ("mean len", "mean_window", 9), ("bits/win var", "window_bits_var", 12)]
    text.append(print_table("\n== adaptive vs fixed windows (per-channel mean/std) ==", window_rows, cols3))
    lines = ["\n== window histograms, decode time per window size, locality =="]
    for r in window_rows:
        loc = r["locality"][0] or {}
        lines.append(
            f"{r['window']:>12}: tiers {r['tier_hist']}  top lengths {r['window_hist_top']}\n"
            f"{'':>14}decode us/element by size {{{', '.join(f'{k}: {v:.3f}' for k, v in r['decode_us_per_element_by_window'].items())}}}\n"
            f"{'':>14}locality (K): predicted from {loc.get('predictor')}, |error| {fmt(loc.get('mean_abs_error_octaves'))} "
            f"octaves, corr {fmt(loc.get('correlation'))}, tier agreement {fmt(loc.get('tier_agreement'))}, "
            f"actual tier fractions (low/med/high locality) {[round(f, 3) for f in loc.get('actual_tier_fractions', [])]}"
        )
    print("\n".join(lines), flush=True)
    text.append("\n".join(lines))

    best_fixed = min((r for r in window_rows if r["window"].startswith("fixed")), key=lambda r: r["bits_per_scalar"])
    best_adapt = min((r for r in window_rows if not r["window"].startswith("fixed")), key=lambda r: r["bits_per_scalar"])
    verdict = (
        f"\nadaptive best: {best_adapt['window']} {best_adapt['bits_per_scalar']:.4f} b/s, "
        f"{fmt(best_adapt['dec_mps_1_worker'], '.2f')} M/s; fixed best: {best_fixed['window']} "
        f"{best_fixed['bits_per_scalar']:.4f} b/s, {fmt(best_fixed['dec_mps_1_worker'], '.2f')} M/s -> adaptive "
        f"{'WINS' if best_adapt['bits_per_scalar'] < best_fixed['bits_per_scalar'] else 'does not win'} on rate"
    )
    print(verdict, flush=True)
    text.append(verdict)
    report.update(windows=window_rows, verdict=verdict)
