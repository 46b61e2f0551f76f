"""Question (issue 48): on a calibrated predictor's per-element statistics (`below`'s, SmolLM2), how many bits per
scalar does the ``mhuff`` coder take, real bytes with its tables and headers, against ``huff`` and ``lanes``; how
many top mantissa bits ``k`` should its symbol hold and how long may its codes be; and does coding the top
mantissa bits against the mean's (where x's exponent is the mean's) pay?

A ``--tokens``-token held-out prompt coded by a ``below`` cache (``coder="huff"``, the calibration ``--calibration``,
block_tokens 128); every ``--every``-th block batch the coder is handed (x and its per-element mean / std) is coded
with huff, lanes and mhuff (k = 2, 3; codes up to 10, 11, 12 bits). The refinement is measured as entropy (tables
not counted) against mhuff's symbol: ``R`` codes the exponent offset and, where x's exponent equals the mean's, the
top k bits as an offset from the mean's (mod 2^k), else from ``max(|mean|, std)``'s; ``meanref`` takes |mean|'s
exponent and top bits as the reference wherever |mean|'s exponent is ``max(|mean|, std)``'s. Answer (SmolLM2,
1,024 tokens, every 4th batch, 120 batches of 3 x 64 x 128): mhuff k=2 codes 8.591 bits/scalar with 10-bit codes,
8.587 with 11 or 12 (huff 9.219, lanes 8.298); k=3 8.613 / 8.605 (0.08 bit less entropy, more table bytes); the
refinement does not pay (entropy k=2: R +0.23 bit, meanref +0.007), so mhuff has none.

    python experiments/mhuff_rate.py [--calibration PATH] [--tokens 1024] [--every 4]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from huff_symbols import captured_with, entropy  # experiments/ is the script's folder: sys.path[0]

from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec import CodecConfig, encode_batch
from hf_kvcompress.codec.huff_coder import huff, mhuff
from hf_kvcompress_eval.bench.common import workload


def captured(calibration: str, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every (x, mean, std) batch a `below` cache hands its coder while it takes the prompt."""
    work = workload(False)
    return captured_with(work, Calibration.load(calibration, work.model), tokens)


def refined_entropy(batches, k: int, variant: str) -> float:
    """Bits per bf16 element: the entropy of each stream's symbols per class plus 7 - k raw bits (tables not
    counted); ``variant`` "plain" (mhuff's symbol), "R" or "meanref" (module docstring)."""
    total = count = 0.0
    w, kmask = (1 << (8 + k)) - 1, (1 << k) - 1
    for x, mean, std in batches:
        xb = x.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        mb, sb = (t.numpy().view(np.uint32).astype(np.int64) for t in (mean, std))
        a = np.maximum(mb & 0x7FFFFFFF, sb & 0x7FFFFFFF)
        xe, xt, ae, at, me, mt = ((xb >> 7) & 0xFF, (xb >> (7 - k)) & kmask, (a >> 23) & 0xFF, (a >> (23 - k)) & kmask,
                                  (mb >> 23) & 0xFF, (mb >> (23 - k)) & kmask)
        if variant == "R":
            top = np.where(xe == me, xt - mt, xt - at) & kmask
            off = (((xe - ae) & 0xFF) << k) | top
        else:
            ref = np.where((me == ae) & (variant == "meanref"), (mb & 0x7FFFFFFF) >> (23 - k), a >> (23 - k)) & w
            off = (((xb >> (7 - k)) & w) - ref) & w
        symbol = (off << 1) | ((xb >> 15) ^ (mb >> 31))
        cls = np.clip(ae - ((sb >> 23) & 0xFF), 0, 3)
        for stream, c in zip(symbol, cls):
            for t in range(4):
                chosen = stream[c == t]
                total += entropy(chosen) + (7 - k) * chosen.size if chosen.size else 0.0
            count += stream.size
    return total / count


def coded_bits(batches, code) -> float:
    """Bits per scalar of every batch coded by ``code(x, mean, std) -> streams``: real bytes."""
    return 8 * sum(sum(map(len, code(x, m, s))) for x, m, s in batches) / sum(x.numel() for x, _, _ in batches)


def variant(spec: huff.Spec):
    return lambda x, m, s: huff.encode_family(x, m, s, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default="/work/wt/prompts/cal_below_smollm2")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = captured(args.calibration, args.tokens)[:: args.every]
    print(f"{len(batches)} batches of {tuple(batches[0][0].shape)} {batches[0][0].dtype}")
    rows = {"huff": lambda x, m, s: encode_batch(x, m, s, CodecConfig(coder="huff")),
            "lanes": lambda x, m, s: encode_batch(x, m, s, CodecConfig(coder="lanes")),
            "mhuff (the coder)": lambda x, m, s: encode_batch(x, m, s, CodecConfig(coder="mhuff"))}
    for k in (2, 3):
        for max_len in (10, 11, 12):
            rows[f"mhuff k={k}, max_len={max_len}"] = variant(mhuff.spec(k, max_len, version=1))  # nibble tables
    for name, code in rows.items():
        print(f"{name}: {coded_bits(batches, code):.3f} bits/scalar (real bytes)", flush=True)
    for k in (2, 3):
        for name in ("plain", "R", "meanref"):
            print(f"entropy k={k} {name}: {refined_entropy(batches, k, name):.3f} bits/scalar (no tables)",
                  flush=True)


if __name__ == "__main__":
    main()
