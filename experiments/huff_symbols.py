"""Question (issue 34): how much of `below`'s rate does the ``huff`` coder lose, and would a variant that also codes
the top mantissa bits against the context (and picks a table by how far the mean stands above the std) win it back?

`below`'s heads fitted on ``--fit-tokens`` calibration tokens, a ``--tokens``-token held-out prompt coded by a
``below`` cache with ``coder="huff"``; every block batch the coder is handed (x and its per-element mean / std) is
kept, and on every ``--every``-th one the empirical entropy (bits per element, per stream, its tables not counted)
of: huff's symbol (sign against the mean's, exponent offset from the exponent of ``max(|mean|, std)``) plus the raw
mantissa; the same with the top ``k`` mantissa bits in the offset (``(exponent, top k)`` of x minus that of
``max(|mean|, std)``), 7 - k raw; and each of those with one table per class, the class the exponent gap of
``max(|mean|, std)`` over ``std`` clipped to ``classes - 1``. Answer: docs/results/lossless.md, "Calibrated coding
in batches (issue 34)".

    python experiments/huff_symbols.py [--fit-tokens 2048] [--tokens 1024] [--every 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec.huff_coder import huff
from hf_kvcompress_eval.bench.common import workload
from hf_kvcompress_eval.bench.generate import fill
from hf_kvcompress_eval.bench.predictors import prefilled


def captured(fit_tokens: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    work = workload(False)
    calibration = Calibration.fit(work.model, None, ids=work.ids(fit_tokens, split="calibration"), tokens=fit_tokens,
                                  chunk=min(1024, fit_tokens), predictors=("below",), progress=False)
    return captured_with(work, calibration, tokens)


def captured_with(work, calibration: Calibration, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every (x, mean, std) batch a `below` cache of ``work``'s model hands its coder while it takes a ``tokens``-token
    held-out prompt."""
    got, encode = [], huff.encode_batch_impl

    def keep(x, mean, std, threads=None):
        got.append((x.detach().clone(), *(torch.as_tensor(t).float().expand(x.shape).clone() for t in (mean, std))))
        return encode(x, mean, std, threads)

    huff.encode_batch_impl = keep  # HuffCoder.encode_batch looks it up at each call
    try:
        prefix, _ = prefilled(work.model, work.ids(tokens, split="evaluation"))
        config = CompressionConfig(mode="lossless", block_tokens=128, lossless={"predictor": "below", "coder": "huff"})
        fill(CompressedCache(config, model=work.model, calibration=calibration), prefix)
    finally:
        huff.encode_batch_impl = encode
    return got


def entropy(symbols: np.ndarray) -> float:
    _, counts = np.unique(symbols, return_counts=True)
    return float(-(counts * np.log2(counts / counts.sum())).sum())


def bits(batches, k: int, classes: int) -> float:
    """Bits per element of bf16 streams: the symbol's entropy per stream (and class), plus 7 - k raw bits."""
    total = count = 0.0
    for x, mean, std in batches:
        xb = x.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        m, s = mean.numpy(), std.numpy()
        a = np.maximum(np.abs(m), s).view(np.uint32).astype(np.int64)
        width = (1 << (8 + k)) - 1
        offset = ((xb >> (7 - k)) & width) - ((a >> (23 - k)) & width) & width
        symbol = (offset << 1) | ((xb >> 15) ^ (m.view(np.uint32) >> 31).astype(np.int64))
        gap = np.clip(((a >> 23) & 0xFF) - ((s.view(np.uint32).astype(np.int64) >> 23) & 0xFF), 0, classes - 1)
        for stream, cls in zip(symbol, gap):
            for c in range(classes):
                chosen = stream[cls == c]
                total += entropy(chosen) + (7 - k) * chosen.size if chosen.size else 0.0
            count += stream.size
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit-tokens", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = captured(args.fit_tokens, args.tokens)[:: args.every]
    rows = {f"k={k}, classes={c}": bits(batches, k, c) for k in (0, 1, 2, 3, 4) for c in (1, 4)}
    out = Path("results/huff_symbols")
    out.mkdir(parents=True, exist_ok=True)
    (out / "huff_symbols.json").write_text(json.dumps({"args": vars(args), "bits": rows}, indent=1))
    for name, value in rows.items():
        print(f"{name}: {value:.3f} bits/element")


if __name__ == "__main__":
    main()
