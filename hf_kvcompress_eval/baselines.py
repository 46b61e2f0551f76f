"""General-purpose lossless baselines for float tensors: raw, zstd, zipnn and the ideal exponent-Huffman bound.

Shared by the evaluation harness and ``hf-kvcompress bench codec`` (bench/codec.py). ``baselines(tensors)`` is
the whole-tensor table of the codec benchmark; `baseline_bits` codes each tensor separately (the harness: one
tensor per layer and K/V) and keeps the per-tensor sizes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

#: (exponent shift, exponent mask, raw sign + mantissa bits) per float format
EXPONENT_FIELDS = {
    torch.bfloat16: (7, 0xFF, 8),
    torch.float16: (10, 0x1F, 6),
    torch.float32: (23, 0xFF, 24),
}
INT_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def timed(fn: Callable[[], Any], repeat: int = 1) -> tuple[Any, float, float]:
    """(result, best wall seconds, best CPU seconds of this process) over ``repeat`` calls."""
    best, best_cpu, out = math.inf, math.inf, None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    return out, best, best_cpu


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(INT_VIEWS[t.dtype]).numpy().tobytes()


def exponent_bound_bits(t: torch.Tensor) -> float:
    """Total bits of the ideal exponent-entropy code (DFloat11 style) of ``t``: the entropy of its exponent
    field under its own empirical distribution, plus the sign and mantissa bits sent raw."""
    shift, mask, rest = EXPONENT_FIELDS[t.dtype]
    bits = t.detach().cpu().contiguous().view(INT_VIEWS[t.dtype]).numpy().reshape(-1).astype(np.int64)
    exps = (bits >> shift) & mask
    p = np.bincount(exps, minlength=mask + 1) / max(1, exps.size)
    h = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    return exps.size * (rest + h)


def _zipnn_codec(dtype: torch.dtype):
    import zipnn

    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    return zipnn.ZipNN(input_format="torch", bytearray_dtype=name, threads=1)


def baseline_bits(tensors: Sequence[torch.Tensor], method: str) -> dict[str, Any]:
    """Code every tensor of ``tensors`` separately with ``method`` (``zstd-3``, ``zstd-19``, ``zipnn``,
    ``exponent-bound``) and check the round trip. Returns ``bits`` (per tensor), ``bits_per_scalar`` (all),
    ``enc_mps`` / ``dec_mps`` (M scalars per second, wall) and ``enc_cpu_mps`` / ``dec_cpu_mps`` (CPU time);
    ``available: False`` with a ``reason`` where the package is missing."""
    n = sum(t.numel() for t in tensors)
    row: dict[str, Any] = {"method": method, "available": True}
    if method == "exponent-bound":
        bits = [exponent_bound_bits(t) for t in tensors]
        row.update(bits=bits, bits_per_scalar=sum(bits) / n, enc_mps=None, dec_mps=None)
        return row
    if method.startswith("zstd-"):
        try:
            import zstandard
        except ImportError:
            return {**row, "available": False, "reason": "zstandard not installed (pip install zstandard)"}
        level = int(method.split("-")[1])
        raw = [raw_bytes(t) for t in tensors]
        cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        comp, te, tec = timed(lambda: [cctx.compress(b) for b in raw])
        back, td, tdc = timed(lambda: [dctx.decompress(c) for c in comp])
        if back != raw:
            raise RuntimeError(f"{method} did not round-trip")
        sizes = [8 * len(c) for c in comp]
    elif method == "zipnn":
        try:
            codec = _zipnn_codec(tensors[0].dtype)
        except ImportError:
            return {**row, "available": False, "reason": "zipnn not installed (pip install zipnn)"}
        # zipnn.compress reorders its input's bytes in place: hand it copies
        comp, te, tec = timed(lambda: [codec.compress(t.detach().cpu().clone()) for t in tensors])
        back, td, tdc = timed(lambda: [codec.decompress(c) for c in comp])
        view = INT_VIEWS[tensors[0].dtype]
        if not all(torch.equal(b.view(view).reshape(-1), t.cpu().view(view).reshape(-1)) for b, t in zip(back, tensors)):
            raise RuntimeError("zipnn did not round-trip")
        sizes = [8 * len(c) for c in comp]
    else:
        raise ValueError(f"unknown baseline {method!r}")
    row.update(bits=sizes, bits_per_scalar=sum(sizes) / n, enc_mps=n / te / 1e6, dec_mps=n / td / 1e6,
               enc_cpu_mps=n / max(tec, 1e-9) / 1e6, dec_cpu_mps=n / max(tdc, 1e-9) / 1e6)
    return row


def baselines(tensors: list[torch.Tensor]) -> list[dict]:
    """The codec benchmark's table: raw, zstd -3 / -19, zipnn and the exponent-Huffman bound over ``tensors``
    (bf16), each tensor coded whole."""
    rows: list[dict] = [{"method": "raw bf16", "bits_per_scalar": 16.0, "enc_mps": None, "dec_mps": None}]
    for method, label in (("zstd-3", "zstd -3"), ("zstd-19", "zstd -19"), ("zipnn", "zipnn")):
        row = baseline_bits(tensors, method)
        if not row["available"]:
            rows.append({"method": f"{label} (not installed)", "bits_per_scalar": None, "enc_mps": None,
                         "dec_mps": None})
            continue
        rows.append({"method": label, **{k: row[k] for k in ("bits_per_scalar", "enc_mps", "dec_mps",
                                                              "enc_cpu_mps", "dec_cpu_mps")}})
    exps = np.concatenate([
        ((t.contiguous().view(torch.int16).numpy().reshape(-1) >> 7) & 0xFF) for t in tensors
    ])
    p = np.bincount(exps, minlength=256) / exps.size
    h = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
    rows.append({"method": "exponent-Huffman bound (DFloat11)", "bits_per_scalar": 8.0 + h,
                 "enc_mps": None, "dec_mps": None, "note": f"H(exponent) = {h:.3f} + 8 raw sign/mantissa bits"})
    return rows
