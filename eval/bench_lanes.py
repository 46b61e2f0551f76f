"""Throughput and rate of the lanes codec (`CodecConfig(coder="lanes")`) against today's ``ans`` streams.

One cache block: 2 (K/V) x 3 heads x 256 tokens x 64 dims, bf16, coded as N = 6 streams of [256, 64]
(``--batch`` multiplies N). Data: KV-like synthetic values (per-channel offsets and scales, three outlier
channels per head, seeded), or with ``--real`` the K/V of SmolLM2-135M (layer ``--layer``) after prefilling
held-out text. Two kinds of statistics:

- ``channel``: per-(stream, channel) mean and std, ``[N, 1, 64]`` (fitted on the block itself);
- ``element``: per-element mean and std ``[N, 256, 64]`` as a predictor would give (synthetic: the value's
  generating mean and spread, with the true value drawn from them; real: per-channel stats plus a noisy
  copy of the value as the mean, spread from the noise).

Prints, per kind: bits/scalar of lanes and of ``ans`` (compact header, one window per stream: the cache's
setting), encode and decode M scalars/s of the whole block (per-element model, fingerprints, header
parsing and checks included) on 1 and 2 threads (wall clock, best of ``--repeats``), the 1-thread decode
also in thread CPU time (robust when other processes share the cores), and ``ans``'s per-stream decode
for comparison. Usage: ``python eval/bench_lanes.py [--repeats 7] [--batch 1] [--real]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import torch

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model

LANES = CodecConfig(coder="lanes")
ANS = CodecConfig(header="compact", fixed_window=65536)


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


def real_block(batch: int, layer: int):
    model, tok = load_model()
    ids = token_ids(tok, 256 * batch, split="evaluation")
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


def run(x: torch.Tensor, mean, std, repeats: int) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1, help="blocks of 6 streams coded per call")
    ap.add_argument("--real", action="store_true", help="SmolLM2 K/V instead of synthetic values")
    ap.add_argument("--layer", type=int, default=10)
    args = ap.parse_args()
    x, mean_e, std_e = real_block(args.batch, args.layer) if args.real else synthetic_block(args.batch)
    xf = x.float()
    mean_c, std_c = xf.mean(1, keepdim=True), xf.std(1, keepdim=True)
    src = f"SmolLM2-135M layer {args.layer}" if args.real else "synthetic KV-like"
    print(f"block {tuple(x.shape)} bf16 ({src}), {x.numel()} scalars; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}")
    codec.decode_batch(codec.encode_batch(x[:1], 0.0, 1.0, LANES), 0.0, 1.0, LANES)  # compile / load the cache
    head = (f"{'stats':8} {'lanes b/s':>9} {'ans b/s':>8} {'delta':>7} | {'enc 1t':>7} {'enc 2t':>7} | "
            f"{'dec 1t':>7} {'dec 2t':>7} {'dec 1t cpu':>10} | {'ans dec 1t':>10}   (M scalars/s)")
    print(head)
    for name, m, s in (("channel", mean_c, std_c), ("element", mean_e, std_e)):
        r = run(x, m, s, args.repeats)
        print(f"{name:8} {r['lanes_bits']:9.4f} {r['ans_bits']:8.4f} {r['lanes_bits'] - r['ans_bits']:+7.4f} | "
              f"{r['enc_1']:7.1f} {r['enc_2']:7.1f} | {r['dec_1']:7.1f} {r['dec_2']:7.1f} {r['dec_1_cpu']:10.1f} | "
              f"{r['ans_dec_1']:10.2f}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
