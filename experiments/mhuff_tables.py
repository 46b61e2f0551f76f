"""Question (issue 48): what do mhuff's four code-length tables per stream cost on the default calibrated save
(`grid` + `mhuff`, SmolLM2 K/V), and what do version 2's tables (pairs of symbols in static prefix codes,
`kernels.length_pairs`) and more top mantissa bits ``k`` in the symbol save?

A ``--tokens``-token held-out prompt filled into a default lossless cache with the calibration ``--calibration``,
then saved (the default: `grid`, `mhuff`); every coding call of the save (x and its per-element mean / std) is kept
and every ``--every``-th coded again by each variant. Prints per variant the bits per scalar (real bytes, tables and
headers), per version the table bytes per stream, and (``--fit``) the static codes `kernels.EVEN_LENGTHS` /
`ODD_LENGTHS` refitted: Huffman (`kernels.code_lengths`, 10 bits) of each context's counts + 1 over every segment
(`kernels.PAIR_GAP`) of the streams' tables at k = `mhuff.K_BITS`.

Answer (SmolLM2 bf16, 2,048 tokens, a save's 60 calls of 48 streams of 64 x 128, every 4th): version 1 (k=2)
8.578 bits/scalar with 138.2 table bytes a stream; version 2 k=2 8.527, k=3 8.487 (121.3 table bytes; 237.1 as
nibbles), k=4 8.520. The whole save's file
bits: experiments/calibrated_storage_times.py.

    python experiments/mhuff_tables.py [--calibration DIR] [--tokens 2048] [--every 4] [--fit]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec.huff_coder import huff, kernels, mhuff
from hf_kvcompress_eval.bench.common import workload
from hf_kvcompress_eval.bench.generate import fill
from hf_kvcompress_eval.bench.predictors import prefilled


def saved_calls(calibration: str, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every (x, mean, std) mhuff coding call of a default save of a ``tokens``-token held-out prompt."""
    work = workload(False)
    prefix, _ = prefilled(work.model, work.ids(tokens, split="evaluation"))
    cache = CompressedCache(CompressionConfig(mode="lossless"), model=work.model,
                            calibration=Calibration.load(calibration, work.model))
    fill(cache, prefix)
    got, encode = [], huff.encode_family

    def keep(x, mean, std, spec, threads=None):
        if spec.name == "mhuff":
            got.append((x.clone(), *(torch.as_tensor(t).float().expand(x.shape).clone() for t in (mean, std))))
        return encode(x, mean, std, spec, threads)

    huff.encode_family = keep  # MHuffCoder.encode_batch looks it up at each call
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cache.save(Path(tmp) / "a.kvc")
    finally:
        huff.encode_family = encode
    return got


def stream_lengths(calls, spec: huff.Spec):
    """Each stream's code-length tables under ``spec`` ([ntab, alphabet] arrays)."""
    for x, mean, std in calls:
        fmt = huff.format_of(x.dtype)
        lay = spec.layouts[fmt.code]
        cx = spec.contexts(mean.numpy(), std.numpy(), fmt, tuple(x.shape[1:]), x.shape[0])
        for s, bits in enumerate(huff._bits(x)):
            yield spec.encode_stream(bits, cx.ctx[cx.crow[s]], cx.rows, cx.run, lay)[2]


def fit(calls) -> tuple[np.ndarray, np.ndarray]:
    """The static codes' lengths refitted (module docstring)."""
    even, odd = np.zeros((11, 11), np.int64), np.zeros((11, 11), np.int64)
    for tables in stream_lengths(calls, mhuff.SPEC):
        for lengths in tables:
            pairs = np.asarray(lengths, np.int64).reshape(-1, 2)
            used = np.flatnonzero(pairs.any(1))
            if not used.size:
                continue
            starts = used[np.r_[True, np.diff(used) - 1 >= kernels.PAIR_GAP]]
            ends = used[np.r_[np.diff(used) - 1 >= kernels.PAIR_GAP, True]]
            for a, b in zip(starts, ends, strict=True):
                prev = 0
                for e, o in pairs[a : b + 1]:
                    even[prev, e] += 1
                    odd[e, o] += 1
                    prev = e
    return (np.array([kernels.code_lengths(row + 1, 10) for row in even]),
            np.array([kernels.code_lengths(row + 1, 10) for row in odd]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default="/work/wt/prompts/cal_below_smollm2")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls = saved_calls(args.calibration, args.tokens)[:: args.every]
    scalars = sum(x.numel() for x, _, _ in calls)
    print(f"{len(calls)} calls of {tuple(calls[0][0].shape)} {calls[0][0].dtype}")
    if args.fit:
        even, odd = fit(calls)
        print("EVEN_LENGTHS", even.tolist(), "\nODD_LENGTHS", odd.tolist())
    variants = {"version 1 (k=2)": mhuff.SPEC_V1, **{f"version 2 k={k}": mhuff.spec(k) for k in (2, 3, 4)}}
    for name, spec in variants.items():
        size = sum(sum(map(len, huff.encode_family(x, m, s, spec))) for x, m, s in calls)
        print(f"{name}: {8 * size / scalars:.4f} bits/scalar (real bytes)", flush=True)
    for name, spec, write in (("version 1", mhuff.SPEC_V1, huff.length_segments),
                              ("version 2", mhuff.SPEC, huff.length_pairs)):
        sizes = [sum(len(write(t)) for t in tables) for tables in stream_lengths(calls, spec)]
        print(f"{name}: {np.mean(sizes):.1f} table bytes a stream")


if __name__ == "__main__":
    main()
