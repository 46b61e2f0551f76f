"""The ``mhuff`` coder (`CodecConfig(coder="mhuff")`): `huff` for a calibrated predictor's per-element statistics
(`below`'s). Each element's sign, exponent and top `K_BITS` (2) mantissa bits are one Huffman symbol against the
exponent and top bits of ``max(|mean|, std)`` (the sign against the mean's), coded with one of four tables per
stream chosen by the element's class (the exponent gap of ``max(|mean|, std)`` over ``std``, clipped to 3: how far
the mean stands above its spread); the other mantissa bits are stored as they are. The huff family's pieces
(length-limited canonical Huffman, bit packer, headers, crc, fingerprints, the four-stream decode loop) are
`huff`'s and `kernels`'; this module holds what differs: contexts, symbols and the layout's four tables.

Layout of one stream: huff's (`huff` module docstring) with magic "\\x89KM" and four code-length tables, one per
class, in class order. docs/codec_format.md section 14.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..codec_config import CodecConfig
from ..registry import register
from ..symbols import Format
from . import huff, kernels

MAGIC = b"\x89KM"
#: top mantissa bits in the symbol. SmolLM2 `below` statistics (experiments/mhuff_rate.py, bf16, real bytes with
#: tables and headers): k=2 8.591 bits/scalar, k=3 8.613 (its entropy is 0.08 lower, its tables cost more; huff
#: 9.219, lanes 8.298); float16 / float32 take as many
K_BITS = 2
#: longest code: 4 tables of 2^MAX_LEN entries per stream to build per stream (experiments/mhuff_rate.py: 11 or 12
#: bits code 8.587 bits/scalar, 10 bits 8.591 with half 11's table entries)
MAX_LEN = 10
#: tables per stream: classes 0..3
CLASSES = 4


def layouts(k: int = K_BITS, max_len: int = MAX_LEN) -> dict[int, huff.Layout]:
    """mhuff's `huff.Layout` per dtype code for ``k`` top mantissa bits and codes of up to ``max_len`` bits."""
    return {code: huff.Layout(CLASSES, 2 << (ew + k), ew + k, mw - k, 1 + ew + mw, max_len)
            for code, (ew, mw) in huff.FIELDS.items()}


def spec(k: int = K_BITS, max_len: int = MAX_LEN) -> huff.Spec:
    """The mhuff coder's `huff.Spec` (other ``k`` / ``max_len``: the measurement's variants; streams of them are
    not mhuff streams)."""

    def contexts(mean32: np.ndarray | None, std32: np.ndarray | None, fmt: Format, shape: tuple[int, ...],
                 n_streams: int) -> huff.Contexts:
        """One context per element (`kernels.mhuff_contexts`), whatever the statistics' shape."""
        zero = np.zeros((1,) * (len(shape) + 1), np.float32)
        ew = huff.FIELDS[fmt.code][0]

        def fill(mean: np.ndarray, std: np.ndarray, out: np.ndarray) -> None:
            kernels.mhuff_contexts(mean, std, fmt.code == 2, ew, k, out)

        return huff.element_contexts(zero if mean32 is None else mean32, zero if std32 is None else std32, fmt,
                                     shape, n_streams, fill)

    def encode_stream(bits: np.ndarray, ctx: np.ndarray, rows: int, run: int, lay: huff.Layout):
        words, nbits, lengths = kernels.mhuff_encode_stream(bits, ctx, lay.ew - k, lay.raw + k, k, lay.max_len)
        return words, nbits, list(lengths)

    return huff.Spec("mhuff", MAGIC, layouts(k, max_len), contexts, encode_stream)


SPEC = spec()


@register
class MHuffCoder(huff.HuffCoder):
    """Four Huffman tables per stream of (sign, exponent, top mantissa bits) against per-element contexts,
    the rest of the mantissa raw: see the module docstring."""

    name = "mhuff"
    magic = (MAGIC,)

    def check_config(self, cfg: CodecConfig) -> None:
        if cfg.window != "fixed":
            raise ValueError(f"CodecConfig(coder='mhuff') codes each stream with fixed tables: window must be "
                             f"'fixed', got {cfg.window!r} (adaptive windows: coder='ans')")

    def encode_batch(self, x, mean, std, cfg: CodecConfig, threads: int | None = None) -> list[bytes]:
        return huff.encode_family(x, mean, std, SPEC, threads)

    def decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                     threads: int | None = None, verify: bool | Sequence[bool] = True) -> torch.Tensor:
        device = next((t.device for t in (mean, std) if isinstance(t, torch.Tensor) and t.is_cuda), None)
        x = huff.decode_batch_impl(blobs, mean, std, out=out, threads=threads, verify=verify, spec=SPEC)
        return x if out is not None or device is None else x.to(device)

    def start_decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                           threads: int = 1, verify: bool | Sequence[bool] = True,
                           chunks: int = 8) -> huff.DecodeJob | None:
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in (mean, std)):
            return None
        huff.check_threads(threads)
        return huff.DecodeJob(blobs, mean, std, out, verify, chunks, SPEC).start(threads)

    def decode(self, blob, mean, std, config: CodecConfig | None, marginal=None, threads: int = 1,
               workers: int = 1) -> torch.Tensor:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"codec: blob must be bytes, got {type(blob).__name__}")
        return huff.decode_batch_impl([blob], mean, std, spec=SPEC)[0]

    def stream_infos(self, blobs, config: CodecConfig | None, marginal=None) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(head.fmt.dtype, head.shape) for head in (huff.parse_prefix(b, SPEC) for b in blobs)]

    def payload_bytes(self, blob: bytes, n: int, fmt: Format) -> int:
        return len(blob) - len(huff.parse_prefix(blob, SPEC).prefix) - 8
