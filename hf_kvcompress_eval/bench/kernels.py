"""Benchmark the Triton kernels (docs/kernels.md) against their torch references and the device's memory bandwidth.

Prepared for a GPU: ``hf-kvcompress bench kernels [--out DIR]``; writes bench_kernels.json. Reports, per kernel, time,
throughput and GB/s moved (and that over the measured device-to-device copy bandwidth), after checking the
Triton result against the torch reference; for the codec's ANS decoder, decode throughput in GB/s of bf16
output (DFloat11 reports hundreds of GB/s) and the decode time against one decode step's attention over the
same cache (the goal: decoding a layer's cache costs less than attending over it).

``--smoke``: tiny sizes on the CPU with Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernels are
first imported), to check that the benchmark runs; its numbers mean nothing (bench_kernels_smoke.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress.codec.symbols import BF16

from .common import out_folder

SIZES = {  # elements / windows / queries: GPU, smoke
    "model_n": (1 << 24, 1 << 11),
    "ans_windows": (4096, 4),
    "ans_window": (2048, 64),
    "att": ((1, 3, 256, 32768, 64), (1, 2, 16, 64, 64)),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int) -> tuple[object, float]:
    """(result, best seconds) of ``repeat`` runs after one warm-up."""
    out = fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return out, best


def copy_bandwidth(device, smoke: bool) -> float:
    """GB/s of a large device-to-device copy (read + write): the practical peak."""
    n = (1 << 16) if smoke else (1 << 28)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    _, t = timed(lambda: a.clone(), device, 3)
    return 2 * n / t / 1e9


def row(name, seconds, elements, nbytes, peak, check=None) -> dict:
    return {"kernel": name, "ms": 1e3 * seconds, "M_elements_per_s": elements / seconds / 1e6,
            "GB_per_s": nbytes / seconds / 1e9, "of_copy_peak": nbytes / seconds / 1e9 / peak, "check": check}


def bench_model(device, smoke, peak, repeat) -> list[dict]:
    from hf_kvcompress import kernels
    from hf_kvcompress.codec.ans_coder import device as codec_device

    n = SIZES["model_n"][smoke]
    g = torch.Generator(device="cpu").manual_seed(0)
    mean = (torch.randn(n, generator=g) * 0.8).to(device)
    std = (torch.rand(n, generator=g) * 0.6 + 0.2).to(device)
    x = (mean + std * torch.randn(n, generator=g).to(device)).to(torch.bfloat16)
    rows = []
    with kernels.forced("torch"):
        ref, t_ref = timed(lambda: codec_device.encode_model(x, mean, std), device, repeat)
    with kernels.forced("triton"):
        out, t_tri = timed(lambda: codec_device.encode_model(x, mean, std), device, repeat)
    ok = all(torch.equal(out[k], ref[k]) for k in ref)
    moved = n * (2 + 4 + 4 + 10 * 4)  # x, mean, std in; ten int32 fields out
    rows += [row("encode_model (triton)", t_tri, n, moved, peak, ok), row("encode_model (torch ref)", t_ref, n, moved, peak)]
    params = (out["tid"], out["cp"], out["cn"], out["s"])
    with kernels.forced("triton"):
        back, t_tri = timed(lambda: codec_device.decode_bits(out["sym"], out["escaped"], params, out["raw"], BF16),
                            device, repeat)
    with kernels.forced("torch"):
        back_ref, t_ref = timed(lambda: codec_device.decode_bits(out["sym"], out["escaped"], params, out["raw"],
                                                            BF16), device, repeat)
    ok = torch.equal(back, x.view(torch.int16)) and torch.equal(back, back_ref)
    moved = n * (7 * 4 + 2)
    rows += [row("decode_bits (triton)", t_tri, n, moved, peak, ok), row("decode_bits (torch ref)", t_ref, n, moved, peak)]
    return rows


def bench_ans(device, smoke, peak, repeat) -> tuple[list[dict], dict]:
    """Many windows of one stream, encoded on the CPU, entropy-decoded on the device."""
    from hf_kvcompress import kernels
    from hf_kvcompress.codec.ans_coder.device import decode_on_device
    from hf_kvcompress.codec.ans_coder.streams import Decoder

    windows, length = SIZES["ans_windows"][smoke], SIZES["ans_window"][smoke]
    n = windows * length
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(windows, length, generator=g) * 0.8
    std = torch.rand(windows, length, generator=g) * 0.6 + 0.2
    x = (mean + std * torch.randn(windows, length, generator=g)).to(torch.bfloat16)
    cfg = CodecConfig(coder="ans", header="compact", fixed_window=length, mean_steps=4)
    t0 = time.process_time()
    blob = codec.encode(x, mean, std, cfg)
    t_enc = time.process_time() - t0
    t0 = time.process_time()
    codec.decode(blob, mean, std, config=cfg)
    t_cpu = time.process_time() - t0
    d = Decoder(blob, mean, std, None, cfg)
    md, sd = mean.to(device), std.to(device)
    with kernels.forced("triton"):
        bits, t_dev = timed(lambda: decode_on_device(d, md, sd, device), device, repeat)
    ok = torch.equal(bits.cpu(), x.reshape(-1).view(torch.int16))
    out_bytes = 2 * n
    rows = [row(f"ANS decode, {windows} windows x {length} (triton, incl. model)", t_dev, n, out_bytes, peak, ok),
            row("ANS decode, same stream (constriction, 1 CPU thread)", t_cpu, n, out_bytes, peak)]
    rows[0]["note"] = "GB/s = bf16 output bytes; DFloat11 reports hundreds of GB/s"
    # one decode step's attention over the same cache, read as a layer's K and V: [1, heads, T, 64]
    heads = 8 if n >= 8 * 64 * 16 else 1
    t = n // (heads * 64)
    k = x.reshape(-1)[: heads * t * 64].reshape(1, heads, t, 64).to(device)
    q = torch.randn(1, heads, 1, 64, device=device).to(torch.bfloat16)
    _, t_att = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k), device, repeat)
    compare = {"decode_ms": 1e3 * t_dev, "attention_ms_one_query_per_head": 1e3 * t_att,
               "decode_over_attention": t_dev / t_att, "cpu_encode_M_per_s": n / t_enc / 1e6,
               "cpu_bits_per_scalar": 8 * len(blob) / n}
    return rows, compare


def bench_attention(device, smoke, peak, repeat) -> list[dict]:
    from hf_kvcompress import kernels
    from hf_kvcompress.kernels.attention import attention_scores_reference

    b, h, m, n, d = SIZES["att"][smoke]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, h, m, d, generator=g).to(device)
    qw = torch.rand(b, h, m, generator=g).to(device)
    keys = torch.randn(b, h, n, d, generator=g).to(torch.bfloat16).to(device)
    bias = torch.zeros(b, h, n, device=device)
    ctx = torch.randn(b, h, 64, d, generator=g).to(torch.bfloat16).to(device)
    cb = torch.zeros(b, h, 64, device=device)
    args = (q, qw, keys, bias, ctx, cb, d**-0.5)
    with kernels.forced("triton"):
        got, t_tri = timed(lambda: kernels.attention_scores(*args), device, repeat)
    ref, t_ref = timed(lambda: attention_scores_reference(*args), device, repeat)
    ok = bool((got[1] - ref[1]).abs().max() <= 1e-4) and bool(((got[0] - ref[0]).abs() <= 1e-5 + 1e-4 * ref[0]).all())
    moved = 2 * keys.numel() * keys.element_size()  # keys read by both passes (once per query block: see docs)
    return [row(f"attention scores b{b} h{h} m{m} n{n} (triton)", t_tri, b * h * n, moved, peak, ok),
            row("attention scores (torch ref, chunked)", t_ref, b * h * n, moved, peak)]


def run(args: argparse.Namespace) -> int:
    from hf_kvcompress.errors import CliError

    smoke = args.smoke
    if smoke:  # before the kernels are defined (imported on first use)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from hf_kvcompress import kernels

    if not smoke and not torch.cuda.is_available():
        raise CliError("no CUDA device; run with --smoke for the CPU interpreter check")
    if not kernels.triton_available():
        raise CliError("triton is not installed")
    device = torch.device("cpu" if smoke else "cuda")
    repeat = 1 if smoke else args.repeat
    name = "CPU (Triton interpreter: numbers are meaningless)" if smoke else torch.cuda.get_device_name(device)
    peak = copy_bandwidth(device, smoke)
    print(f"device: {name}; device-to-device copy: {peak:.3f} GB/s")
    rows = bench_model(device, smoke, peak, repeat)
    ans_rows, compare = bench_ans(device, smoke, peak, repeat)
    rows += ans_rows + bench_attention(device, smoke, peak, repeat)
    print(f"{'kernel':<62} {'ms':>9} {'M elem/s':>10} {'GB/s':>8} {'of copy':>8}  check")
    for r in rows:
        check = "" if r["check"] is None else ("ok" if r["check"] else "MISMATCH")
        print(f"{r['kernel']:<62} {r['ms']:>9.3f} {r['M_elements_per_s']:>10.1f} {r['GB_per_s']:>8.2f} "
              f"{r['of_copy_peak']:>8.1%}  {check}")
    print("ANS decode vs attention over the same cache (one decode query per head): "
          + ", ".join(f"{k} {v:.3f}" for k, v in compare.items()))
    out = out_folder(args, "kernels")
    report = {"device": name, "copy_GB_per_s": peak, "smoke": smoke, "rows": rows, "ans_vs_attention": compare,
              "torch": torch.__version__}
    path = out / ("bench_kernels_smoke.json" if smoke else "bench_kernels.json")
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    if not all(r["check"] in (None, True) for r in rows):
        raise CliError("a Triton kernel disagreed with its torch reference")
    return 0

