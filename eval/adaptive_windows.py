"""Issue 10, adaptive windows with side information: does a per-window std (or mean) correction pay on top of
the `generic` predictor's per-block channel statistics? (docs/codec.md section 10)

Data: SmolLM2-135M bf16 K/V of held-out text (``token_ids(tok, --tokens, split="evaluation")``, one forward
pass, keys post-RoPE as cached), every layer, blocks of 128 tokens as the cache seals them. Each block goes
through the `generic` predictor exactly as `LosslessContext._encode_block` does (``block_side_data``,
``session.predict``, `choose_scale` / `scale_factor`, channel-major streams ``x.T`` of ``[head_dim, 128]``):
one lanes stream per (kind, head) of a block, 8,192 elements, element ``c * 128 + t`` = channel c, token t.

A window of W elements of such a stream covers, for W < 128, W consecutive tokens of one channel, and for
W >= 128, W / 128 whole channels (all 128 tokens of each).

Variants (rate = bits per scalar, counting the streams' bytes, generic's bf16 side data, the per-stream scale
byte and every bit of per-window side information):

(a) fixed: today's cache (one window per stream, the per-stream scale byte as `choose_scale` picks it).
(b) std correction: each window of W elements picks a code r from a grid, std *= 2^(r / 8) (eighth octaves)
    on top of the stream's scale; the encoder picks the r that minimises the window's code length.
(c) mean correction: each window picks j, mean += j / 4 * std (std as the cache has it).
(d) adaptive boundaries: windows of 16 elements, each with a code from (b)'s or (c)'s grid, coded as a run:
    a "same code as before" flag (static binary model with P(change) = p, a header constant) and, on a change,
    the new code (3 bits); a dynamic programme picks the codes that minimise payload + side bits.

Code lengths: for every candidate correction one pass computes every element's ideal code length under the
codec's own integer tables (`codec.coder.symbols`, the tables' ``cost_bits``, the escape flag of the stream's
tier: what the lanes coder emits, less its final states and header), summed per 16-element segment; window
choices are made from those sums. The chosen variants are then encoded for real with ``codec.encode_batch``
(per-window statistics passed as compact ``[N, 64, 128 / W, 1]`` tensors against the stream viewed as
``[N, 64, 128 / W, W]``: same elements, same order), decoded back bit for bit, and their bytes counted;
decode throughput is timed side by side (one thread; one ``decode_batch`` per layer, as the cache reads a
layer's blocks; medians of ``--repeats`` interleaved passes over every layer, after a warm-up pass).

    python eval/adaptive_windows.py [--tokens 2048] [--layers all|0,5,10] [--repeats 7]
        [--out results/adaptive_windows]

Writes ``results.json`` and ``adaptive_windows.png`` under ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from hf_kvcompress import codec
from hf_kvcompress.blockcoder import choose_scale, compact, scale_factor
from hf_kvcompress.codec.coder import models_for, symbols
from hf_kvcompress.codec.params import ParamSource
from hf_kvcompress.codec.symbols import format_of, split_bits, tensor_bits
from hf_kvcompress.codec.tables import PRECISION, TOTAL
from hf_kvcompress.config import LosslessConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors.base import BlockInputs, stream_order
from hf_kvcompress.predictors.generic import GenericPredictor
from hf_kvcompress.predictors.runner import run_decoder

BLOCK = 128  # tokens per sealed block (the cache's block size)
SEG = 16  # finest window measured (elements); every window is a whole number of these
WINDOWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
STD_R = tuple(range(-10, 7))  # std *= 2^(r / 8): every candidate evaluated
MEAN_J = tuple(range(-4, 5))  # mean += j / 4 * std
# code grids (each 8 codes = 3 bits per window, except the 1- and 2-bit ones)
STD_GRIDS = {
    "e3": tuple(range(-6, 2)),  # eighth octaves -6/8 .. +1/8
    "q3": tuple(range(-10, 5, 2)),  # quarter octaves -10/8 .. +4/8
    "q2": (-4, -2, 0, 2),
    "e1": (-1, 0),
}
MEAN_GRIDS = {"m3": tuple(range(-4, 4)), "m2": (-2, -1, 0, 1)}
FLAG_P = tuple(2.0 ** -k for k in range(2, 9))  # P(change) of the run flags in (d)
CODE_BITS = 3  # bits of a new code in (d)
WIN_MARGIN = 0.05  # bit/scalar a variant must save (the brief's decision rule)
SPEED_COST = 0.10  # the most decode throughput it may cost


# ------------------------------------------------------------------------------------------------- data


def held_out_streams(tokens: int, layers: list[int] | None):
    """The cache's streams of every block: x ``[N, 64, 128]`` bf16, mean / std ``[N, 64, 1]`` float32 (std with
    the stream's scale applied, as the encoder passes it), plus the side-data and scale bytes and a label per
    stream (layer, block start, kind, head)."""
    model, tok = load_model()
    ids = token_ids(tok, tokens, split="evaluation")
    with torch.no_grad():
        cache, _ = run_decoder(model, ids)
    predictor = GenericPredictor()
    xs, means, stds, labels, scales = [], [], [], [], []
    side_bytes = 0
    for layer in layers if layers is not None else range(len(cache.layers)):
        keys_all, values_all = cache.layers[layer].keys, cache.layers[layer].values  # [1, heads, T, D]
        heads = keys_all.shape[1]
        for start in range(0, tokens - BLOCK + 1, BLOCK):
            keys = keys_all[:, :, start : start + BLOCK].contiguous()
            values = values_all[:, :, start : start + BLOCK].contiguous()
            side = predictor.block_side_data(layer, keys, values, start)
            side_bytes += sum(t.numel() * t.element_size() for t in side.values())
            session = predictor.session(BlockInputs(layer, 1, torch.arange(start, start + BLOCK), None, side))
            for kind, head in stream_order(heads):
                mean, std = session.predict(kind, head)
                x = (keys if kind == "k" else values)[:, head]
                scale = choose_scale(x[0], mean[0], std[0])
                scales.append(scale)
                xs.append(x[0].T)
                means.append(compact(mean[0].T))
                stds.append(compact(std[0].T).mul(scale_factor(scale)))
                labels.append((layer, start, kind, head))
    x = torch.stack(xs).contiguous()
    return (x, torch.stack(means).contiguous(), torch.stack(stds).contiguous(), labels, scales, side_bytes)


class IdealBits:
    """Per-element ideal code lengths of ``x`` under the codec's integer model (lanes: one window per stream)."""

    def __init__(self, x: torch.Tensor, cfg: codec.CodecConfig):
        self.shape = tuple(x.shape)
        self.n = x.numel()
        self.fmt = format_of(x.dtype)
        self.keys, _ = split_bits(tensor_bits(x), self.fmt)
        self.cfg = cfg
        self.models = models_for(self.fmt, cfg)
        e = float(self.models.flag_freq[cfg.tier_of_length(math.prod(self.shape[1:]))])
        self.valid_flag = PRECISION - math.log2(TOTAL - e)
        self.escape_flag = PRECISION - math.log2(e)

    def segments(self, mean: torch.Tensor, std: torch.Tensor) -> np.ndarray:
        """Bits per SEG-element segment (flat element order) under per-channel ``mean`` / ``std``."""
        src = ParamSource(self.shape, mean.numpy(), std.numpy(), self.fmt, self.cfg.mean_steps)
        p = src.params(0, self.n)
        t = self.models.tables
        valid, sym = symbols(self.keys, p, t, self.fmt)
        table = t.cost_bits[t.cost_offset[p.tid] + np.where(valid, sym, 0)]
        esc = PRECISION - np.log2(self.models.phat_freq[np.where(valid, 0, sym)].astype(np.float64))
        bits = np.where(valid, table + self.valid_flag, esc + self.escape_flag)
        return bits.reshape(-1, SEG).sum(1)


# ------------------------------------------------------------------------------------------------ choices


def window_choice(costs: np.ndarray, cands: tuple[int, ...], grid: tuple[int, ...], w: int):
    """Per window of ``w`` elements, the grid code with the fewest payload bits: (bits per window, codes)."""
    rows = [cands.index(g) for g in grid]
    sums = costs[rows].reshape(len(rows), -1, w // SEG).sum(2)  # [grid, windows]
    pick = sums.argmin(0)
    return sums[pick, np.arange(sums.shape[1])], np.asarray(grid)[pick]


def entropy_bits(codes: np.ndarray) -> float:
    _, counts = np.unique(codes, return_counts=True)
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum())


def run_dp(costs: np.ndarray, cands: tuple[int, ...], grid: tuple[int, ...], streams: int, p: float):
    """(d): per stream, codes per SEG-element segment minimising payload + run side bits. Returns (payload bits
    per stream, side bits, codes [streams, segments])."""
    rows = [cands.index(g) for g in grid]
    c = costs[rows].reshape(len(rows), streams, -1).transpose(1, 2, 0)  # [streams, segments, grid]
    k = len(grid)
    stay, change = -math.log2(1 - p), -math.log2(p) + CODE_BITS
    segs = c.shape[1]
    total = c[:, 0] + CODE_BITS  # the first code of a stream: CODE_BITS
    back = np.empty((segs, streams, k), dtype=np.int8)
    ar = np.arange(k)
    for t in range(1, segs):
        best = total.argmin(1)
        via_change = total[np.arange(streams), best] + change
        via_stay = total + stay
        keep = via_stay <= via_change[:, None]
        back[t] = np.where(keep, ar[None, :], best[:, None])
        total = np.where(keep, via_stay, via_change[:, None]) + c[:, t]
    state = total.argmin(1)
    codes = np.empty((streams, segs), dtype=np.int64)
    for t in range(segs - 1, -1, -1):
        codes[:, t] = state
        if t:
            state = back[t, np.arange(streams), state]
    payload = np.take_along_axis(c, codes[..., None], 2)[..., 0].sum(1)  # per stream
    changes = (codes[:, 1:] != codes[:, :-1]).sum()
    side = streams * CODE_BITS + changes * change + (codes[:, 1:] == codes[:, :-1]).sum() * stay
    return payload, float(side), np.asarray(grid)[codes]


# --------------------------------------------------------------------------------------------- real bytes


def per_window(values: np.ndarray, n_streams: int, dim: int, w: int) -> torch.Tensor:
    """Codes per window of ``w`` elements (flat over the streams) -> ``[N, 64, 128 / w, 1]`` (w < 128) or
    ``[N, 64, 1]`` (w >= 128: one value per channel, repeated over the channels of a window)."""
    per_stream = values.reshape(n_streams, -1)
    if w < BLOCK:
        return torch.from_numpy(per_stream.reshape(n_streams, dim, BLOCK // w, 1).astype(np.float32))
    return torch.from_numpy(np.repeat(per_stream, w // BLOCK, axis=1).reshape(n_streams, dim, 1).astype(np.float32))


def view_for(x: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
    return x if stat.dim() == 3 else x.view(x.shape[0], x.shape[1], stat.shape[2], -1)


def real_encode(x, mean, std, cfg) -> tuple[list[bytes], torch.Tensor]:
    xv = view_for(x, std if std.dim() == 4 else mean)
    blobs = codec.encode_batch(xv, mean, std, cfg)
    y = codec.decode_batch(blobs, mean, std, cfg)
    if not torch.equal(y.view(torch.int16), xv.view(torch.int16)):
        raise AssertionError("round trip failed")
    return blobs, xv


def median_throughput(calls: dict, n: int, repeats: int) -> dict[str, dict[str, float]]:
    """M scalars/s per named call, interleaved, median of ``repeats`` (after one warm-up call each), by wall
    clock and by the thread's CPU time (less sensitive to other jobs taking the core)."""
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():  # warm-up: compiles each statistics shape's kernels outside the timing
        fn()
    for _ in tqdm(range(repeats), desc="decode timing", leave=False):
        for name, fn in calls.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    return {name: {"wall": n / statistics.median(wall[name]) / 1e6, "cpu": n / statistics.median(cpu[name]) / 1e6}
            for name in calls}


# -------------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", default="all", help="'all' or comma-separated layer indices")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="results/adaptive_windows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    layers = None if args.layers == "all" else [int(v) for v in args.layers.split(",")]
    cfg = LosslessConfig().codec_config()

    x, mean, std, labels, scales, side_bytes = held_out_streams(args.tokens, layers)
    n_streams, dim, _ = x.shape
    n = x.numel()
    is_key = np.array([lab[2] == "k" for lab in labels])
    base_side_bits = 8.0 * side_bytes + 8.0 * len(scales)  # generic's bf16 mean/std + the per-stream scale byte
    print(f"{n_streams} streams of {tuple(x.shape[1:])} ({n:,} scalars), layers "
          f"{sorted({lab[0] for lab in labels})[0]}..{sorted({lab[0] for lab in labels})[-1]}; "
          f"stream scale codes used: {sorted(set(scales))}")

    # (a) fixed: real bytes
    blobs_a = codec.encode_batch(x, mean, std, cfg)
    bytes_a = sum(map(len, blobs_a))
    rate_a = (8.0 * bytes_a + base_side_bits) / n

    ideal = IdealBits(x, cfg)
    std_costs = np.stack([ideal.segments(mean, std * 2.0 ** (r / 8)) for r in tqdm(STD_R, desc="std candidates")])
    mean_costs = np.stack([ideal.segments(mean + (j / 4) * std, std) for j in tqdm(MEAN_J, desc="mean candidates")])
    base_payload = float(std_costs[STD_R.index(0)].sum())  # ideal payload of (a)
    per_stream_base = std_costs[STD_R.index(0)].reshape(n_streams, -1).sum(1)

    def gains_by_kind(payload_per_stream: np.ndarray) -> dict[str, float]:
        d = per_stream_base - payload_per_stream
        return {"k": float(d[is_key].sum() / (is_key.sum() * dim * BLOCK)),
                "v": float(d[~is_key].sum() / ((~is_key).sum() * dim * BLOCK))}

    ideal_rows = []
    for family, costs, cands, grids in (("b std", std_costs, STD_R, STD_GRIDS),
                                         ("c mean", mean_costs, MEAN_J, MEAN_GRIDS)):
        for grid_name, grid in grids.items():
            for w in WINDOWS:
                bits, codes = window_choice(costs, cands, grid, w)
                side = codes.size * math.log2(len(grid))
                gain = (base_payload - bits.sum()) / n
                ideal_rows.append({
                    "variant": family, "grid": grid_name, "window": w, "windows": int(codes.size),
                    "gain_before_side": gain, "side_bits_per_scalar": side / n, "net_gain": gain - side / n,
                    "side_entropy_bits_per_scalar": entropy_bits(codes) / n,
                    "net_gain_entropy_side": gain - entropy_bits(codes) / n,
                    "gain_by_kind": gains_by_kind(bits.reshape(n_streams, -1).sum(1)),
                    "code_histogram": {str(k): int(v) for k, v in zip(*np.unique(codes, return_counts=True))},
                })

    dp_rows = []
    for family, costs, cands, grid in (("d std runs", std_costs, STD_R, STD_GRIDS["e3"]),
                                       ("d mean runs", mean_costs, MEAN_J, MEAN_GRIDS["m3"])):
        for p in tqdm(FLAG_P, desc=f"{family} DP"):
            per_stream, side, _ = run_dp(costs, cands, grid, n_streams, p)
            payload = float(per_stream.sum())
            dp_rows.append({"variant": family, "grid": "e3" if "std" in family else "m3", "p_change": p,
                            "gain_before_side": (base_payload - payload) / n, "side_bits_per_scalar": side / n,
                            "net_gain": (base_payload - payload - side) / n, "gain_by_kind": gains_by_kind(per_stream)})

    # real bytes of the best of each family (by ideal net gain, fixed-length side bits), and speed
    def best_of(rows, variant):
        return max((r for r in rows if r["variant"] == variant), key=lambda r: r["net_gain"])

    chosen = {"b": best_of(ideal_rows, "b std"), "b16": next(r for r in ideal_rows if r["variant"] == "b std" and
                                                          r["grid"] == "e3" and r["window"] == SEG),
              "c": best_of(ideal_rows, "c mean"), "d_std": best_of(dp_rows, "d std runs"),
              "d_mean": best_of(dp_rows, "d mean runs")}
    real_rows = [{"variant": "a fixed", "bytes": bytes_a, "side_bits": base_side_bits, "rate": rate_a,
                  "ideal_rate": (base_payload + base_side_bits) / n, "stat_shape": list(mean.shape[1:])}]
    decode_inputs: dict[str, tuple] = {"a fixed": (blobs_a, mean, std)}
    for key, row in chosen.items():
        is_std = "std" in row["variant"]
        costs, cands = (std_costs, STD_R) if is_std else (mean_costs, MEAN_J)
        grid = (STD_GRIDS if is_std else MEAN_GRIDS)[row["grid"]]
        if key.startswith("d"):
            _, side, codes = run_dp(costs, cands, grid, n_streams, row["p_change"])
            w = SEG
            label = f"{row['variant']} p={row['p_change']:g}"
        else:
            w = row["window"]
            _, codes = window_choice(costs, cands, grid, w)
            side = codes.size * math.log2(len(grid))
            label = f"{row['variant']} {row['grid']} W={w}"
        codes = per_window(codes.astype(np.float64), n_streams, dim, w)
        if is_std:
            m = mean if codes.dim() == 3 else mean.unsqueeze(-1)
            s = (std if codes.dim() == 3 else std.unsqueeze(-1)) * torch.pow(2.0, codes / 8)
        else:
            s = std if codes.dim() == 3 else std.unsqueeze(-1)
            m = (mean if codes.dim() == 3 else mean.unsqueeze(-1)) + (codes / 4) * s
            s = s.expand_as(m).contiguous()
        m, s = m.contiguous(), s.contiguous()
        blobs, xv = real_encode(x, m, s, cfg)
        nbytes = sum(map(len, blobs))
        ideal_payload = base_payload - row["gain_before_side"] * n
        real_rows.append({"variant": label, "bytes": nbytes, "side_bits": base_side_bits + side,
                          "rate": (8.0 * nbytes + base_side_bits + side) / n,
                          "ideal_rate": (ideal_payload + base_side_bits + side) / n,
                          "stat_shape": list(s.shape[1:])})
        row["real_rate"] = real_rows[-1]["rate"]
        decode_inputs[label] = (blobs, m, s)
        if s.dim() == 4 and key in ("b16", "d_std"):  # the same statistics expanded to per-element tensors
            full = f"{label} (per-element stats)"
            m_full = m.expand(*s.shape[:3], xv.shape[3]).contiguous()
            s_full = s.expand(*s.shape[:3], xv.shape[3]).contiguous()
            decode_inputs[full] = (codec.encode_batch(xv, m_full, s_full, cfg), m_full, s_full)
    for row in real_rows:
        row["delta_vs_fixed"] = row["rate"] - rate_a

    # as the cache reads: one decode_batch per layer (all its blocks' streams), every layer per timed call
    layer_of = np.array([lab[0] for lab in labels])
    spans = [(int(np.flatnonzero(layer_of == la)[0]), int(np.flatnonzero(layer_of == la)[-1]) + 1)
             for la in sorted(set(layer_of.tolist()))]

    def decode_layers(blobs, m, s, out) -> None:
        for a, b in spans:
            codec.decode_batch(blobs[a:b], m[a:b], s[a:b], cfg, out=out[a:b], threads=1)

    outs = {name: torch.empty_like(view_for(x, inp[2] if inp[2].dim() == 4 else inp[1]))
            for name, inp in decode_inputs.items()}
    calls = {name: (lambda b=b, m=m, s=s, o=outs[name]: decode_layers(b, m, s, o))
             for name, (b, m, s) in decode_inputs.items()}
    speed = median_throughput(calls, n, args.repeats)

    # decision
    fixed_speed = speed["a fixed"]["cpu"]
    verdicts = []
    for row in real_rows[1:]:
        saving = -row["delta_vs_fixed"]
        cost = 1.0 - speed[row["variant"]]["cpu"] / fixed_speed
        verdicts.append({"variant": row["variant"], "saving": saving, "speed_cost": cost,
                         "wins": bool(saving >= WIN_MARGIN and cost <= SPEED_COST)})

    elapsed = time.perf_counter() - t_start
    result = {
        "tokens": args.tokens, "layers": sorted({lab[0] for lab in labels}), "streams": n_streams, "scalars": n,
        "codec_config": cfg.to_dict(), "stream_scale_codes": sorted(set(scales)),
        "rate_fixed": rate_a, "ideal_payload_fixed": base_payload / n,
        "std_candidates_total": {str(r): float(std_costs[i].sum() / n) for i, r in enumerate(STD_R)},
        "mean_candidates_total": {str(j): float(mean_costs[i].sum() / n) for i, j in enumerate(MEAN_J)},
        "ideal": ideal_rows, "dp": dp_rows, "real": real_rows, "decode_Mscalars_per_s": speed,
        "verdicts": verdicts, "any_wins": any(v["wins"] for v in verdicts),
        "seconds": elapsed, "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(),
                                        "python": platform.python_version(), "torch": torch.__version__},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print_tables(result)
    plot(result, out / "adaptive_windows.png")
    print(f"wrote {out / 'results.json'} and {out / 'adaptive_windows.png'} in {elapsed:.0f} s")


def print_tables(r: dict) -> None:
    print(f"\n(a) fixed: {r['rate_fixed']:.4f} bits/scalar (ideal payload {r['ideal_payload_fixed']:.4f} + side data)")
    print("\nideal code lengths, gain over (a) in bits/scalar (side: fixed-length codes; H: entropy of the codes)")
    print(f"{'variant':8} {'grid':4} {'W':>5} {'gain':>7} {'side':>7} {'net':>8} {'side H':>7} {'net H':>8}"
          f" {'gain K':>7} {'gain V':>7}")
    for row in r["ideal"]:
        print(f"{row['variant']:8} {row['grid']:4} {row['window']:5d} {row['gain_before_side']:7.4f} "
              f"{row['side_bits_per_scalar']:7.4f} {row['net_gain']:8.4f} {row['side_entropy_bits_per_scalar']:7.4f} "
              f"{row['net_gain_entropy_side']:8.4f} {row['gain_by_kind']['k']:7.4f} {row['gain_by_kind']['v']:7.4f}")
    print("\n(d) adaptive boundaries (16-element segments, runs of one code), ideal")
    print(f"{'variant':12} {'p':>8} {'gain':>7} {'side':>7} {'net':>8} {'gain K':>7} {'gain V':>7}")
    for row in r["dp"]:
        print(f"{row['variant']:12} {row['p_change']:8.5f} {row['gain_before_side']:7.4f} "
              f"{row['side_bits_per_scalar']:7.4f} {row['net_gain']:8.4f} {row['gain_by_kind']['k']:7.4f} "
              f"{row['gain_by_kind']['v']:7.4f}")
    print("\nreal bytes (codec.encode_batch, round trip checked) and decode throughput (1 thread, one call per layer, median)")
    print(f"{'variant':40} {'stats':>14} {'b/s':>8} {'ideal':>8} {'delta':>8} {'dec M/s':>8} {'(CPU)':>7}")
    for row in r["real"]:
        print(f"{row['variant']:40} {tuple(row['stat_shape'])!s:>14} {row['rate']:8.4f} {row['ideal_rate']:8.4f} "
              f"{row['delta_vs_fixed']:+8.4f} {r['decode_Mscalars_per_s'][row['variant']]['wall']:8.1f} "
              f"{r['decode_Mscalars_per_s'][row['variant']]['cpu']:7.1f}")
    for name, v in r["decode_Mscalars_per_s"].items():
        if name not in {row["variant"] for row in r["real"]}:
            print(f"{name:40} {'':>14} {'':>8} {'':>8} {'':>8} {v['wall']:8.1f} {v['cpu']:7.1f}")
    print("\nverdicts (wins: saves >= 0.05 bit/scalar at <= 10 % decode cost, by CPU-time throughput)")
    for v in r["verdicts"]:
        print(f"  {v['variant']:40} saves {v['saving']:+.4f} b/s, decode cost {100 * v['speed_cost']:+.1f} %: "
              f"{'WINS' if v['wins'] else 'no'}")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, grid, color in (("b std", "e3", "C0"), ("b std", "q2", "C2"), ("c mean", "m3", "C1")):
        rows = [row for row in r["ideal"] if row["variant"] == variant and row["grid"] == grid]
        w = [row["window"] for row in rows]
        ax.plot(w, [row["gain_before_side"] for row in rows], "--", color=color, label=f"{variant} {grid}: before side")
        ax.plot(w, [row["net_gain"] for row in rows], "o-", color=color, label=f"{variant} {grid}: net")
    for variant, marker in (("d std runs", "s"), ("d mean runs", "^")):
        best = max((row for row in r["dp"] if row["variant"] == variant), key=lambda row: row["net_gain"])
        ax.plot([16], [best["net_gain"]], marker, color="k", label=f"{variant} (best p): net")
    ax.axhline(WIN_MARGIN, color="r", lw=0.8, label="win margin 0.05")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window (elements; 128 = one channel of a block)")
    ax.set_ylabel("gain over fixed (bits/scalar, ideal)")
    ax.set_title(f"SmolLM2-135M K/V, {r['tokens']} held-out tokens, generic predictor")
    ax.legend(fontsize=7)
    names = list(r["decode_Mscalars_per_s"])
    y = np.arange(len(names))
    bx.barh(y - 0.2, [r["decode_Mscalars_per_s"][k]["wall"] for k in names], height=0.4, label="wall")
    bx.barh(y + 0.2, [r["decode_Mscalars_per_s"][k]["cpu"] for k in names], height=0.4, label="thread CPU time")
    bx.legend(fontsize=7)
    bx.set_yticks(y, [k.replace(" (per-element stats)", "\n(per-element stats)") for k in names],
                  fontsize=7)
    bx.set_xlabel("decode M scalars/s (1 thread, one call per layer, median)")
    bx.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
