"""The ``mhuff`` coder (`CodecConfig(coder="mhuff")`): `huff` for a calibrated predictor's per-element statistics
(`below`'s). Each element's sign, exponent and top `K_BITS` (3; version 1: 2) mantissa bits are one Huffman
symbol against the exponent and top bits of ``max(|mean|, std)`` (the sign against the mean's), coded with one of
four tables per stream chosen by the element's class (the exponent gap of ``max(|mean|, std)`` over ``std``, clipped to 3: how far
the mean stands above its spread); the other mantissa bits are stored as they are. The huff family's pieces
(length-limited canonical Huffman, bit packer, headers, crc, fingerprints, the four-stream decode loop) are
`huff`'s and `kernels`'; this module holds what differs: contexts, symbols and the layout's four tables.

Layout of one stream: huff's (`huff` module docstring) with four code-length tables, one per class, in class
order. Version 2 (magic "\\x89KN", what the coder writes) codes each table by pairs of symbols in static prefix
codes (`kernels.length_pairs`: 121 bytes a stream's four tables against 237 as nibbles, SmolLM2); version 1
(magic "\\x89KM", nibbles as huff's) still decodes. docs/codec_format.md section 14.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..codec_config import CodecConfig
from ..registry import register
from ..symbols import Format
from . import huff, kernels

#: version 2, what the coder writes: tables by pairs of symbols (`kernels.length_pairs`)
MAGIC = b"\x89KN"
#: version 1: tables as nibbles (`huff.length_segments`), decoded only
MAGIC_V1 = b"\x89KM"
#: top mantissa bits in the symbol, version 2. SmolLM2 grid statistics of a default save at 2,048 held-out tokens
#: (experiments/mhuff_tables.py, real bytes with tables and headers, every 4th coding call): version 2's tables
#: k=2 8.527 bits/scalar, k=3 8.487, k=4 8.520 (version 1's nibbles: k=2 8.578, k=3 8.599); float16 / float32 take
#: as many
K_BITS = 3
#: version 1's (its tables as nibbles made k=3 cost more than its entropy saves: experiments/mhuff_rate.py, `below`,
#: k=2 8.591, k=3 8.613)
K_BITS_V1 = 2
#: longest code: 4 tables of 2^MAX_LEN entries per stream to build per stream (experiments/mhuff_rate.py: 11 or 12
#: bits code 8.587 bits/scalar, 10 bits 8.591 with half 11's table entries)
MAX_LEN = 10
#: tables per stream: classes 0..3
CLASSES = 4


def layouts(k: int = K_BITS, max_len: int = MAX_LEN, paired: bool = True) -> dict[int, huff.Layout]:
    """mhuff's `huff.Layout` per dtype code for ``k`` top mantissa bits and codes of up to ``max_len`` bits
    (``paired``: version 2's tables)."""
    return {code: huff.Layout(CLASSES, 2 << (ew + k), ew + k, mw - k, 1 + ew + mw, max_len, paired)
            for code, (ew, mw) in huff.FIELDS.items()}


def spec(k: int | None = None, max_len: int = MAX_LEN, version: int = 2) -> huff.Spec:
    """The mhuff coder's `huff.Spec` of stream ``version`` 2 or 1 (``k`` default the version's; other ``k`` /
    ``max_len``: the measurement's variants, whose streams are not mhuff streams)."""
    if version not in (1, 2):
        raise ValueError(f"mhuff stream versions are 1 and 2, got {version!r}")
    if version == 2 and max_len > len(kernels.EVEN_LENGTHS) - 1:  # the static codes cover lengths 0..10
        raise ValueError(f"mhuff version 2's tables code lengths up to {len(kernels.EVEN_LENGTHS) - 1}, got "
                         f"max_len={max_len}")
    k = (K_BITS if version == 2 else K_BITS_V1) if k is None else k

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

    return huff.Spec("mhuff", MAGIC if version == 2 else MAGIC_V1, layouts(k, max_len, version == 2), contexts,
                     encode_stream)


SPEC = spec()
SPEC_V1 = spec(version=1)


def _spec_of(blobs) -> huff.Spec | None:
    """The spec of a batch's streams by their magic bytes (version 2 unless every stream is version 1; None for
    a batch that mixes the versions: `MHuffCoder.decode_batch` splits it). A stream of neither is left to the
    version 2 parser to name."""
    if not isinstance(blobs, (list, tuple)) or not blobs:
        return SPEC
    v1 = [isinstance(b, (bytes, bytearray, memoryview)) and bytes(b[:3]) == MAGIC_V1 for b in blobs]
    return SPEC_V1 if all(v1) else SPEC if not any(v1) else None


@register
class MHuffCoder(huff.HuffCoder):
    """Four Huffman tables per stream of (sign, exponent, top mantissa bits) against per-element contexts,
    the rest of the mantissa raw: see the module docstring."""

    name = "mhuff"
    magic = (MAGIC, MAGIC_V1)

    def check_config(self, cfg: CodecConfig) -> None:
        if cfg.window != "fixed":
            raise ValueError(f"CodecConfig(coder='mhuff') codes each stream with fixed tables: window must be "
                             f"'fixed', got {cfg.window!r} (adaptive windows: coder='ans')")

    def encode_batch(self, x, mean, std, cfg: CodecConfig, threads: int | None = None) -> list[bytes]:
        return huff.encode_family(x, mean, std, SPEC, threads)

    def decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                     threads: int | None = None, verify: bool | Sequence[bool] = True) -> torch.Tensor:
        device = next((t.device for t in (mean, std) if isinstance(t, torch.Tensor) and t.is_cuda), None)
        spec = _spec_of(blobs)
        if spec is None:
            x = _decode_mixed(blobs, mean, std, out, threads, verify)
        else:
            x = huff.decode_batch_impl(blobs, mean, std, out=out, threads=threads, verify=verify, spec=spec)
        return x if out is not None or device is None else x.to(device)

    def start_decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                           threads: int = 1, verify: bool | Sequence[bool] = True,
                           chunks: int = 8) -> huff.DecodeJob | None:
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in (mean, std)):
            return None
        huff.check_threads(threads)
        spec = _spec_of(blobs)
        if spec is None:  # versions mixed: `decode_batch` decodes each apart
            return None
        return huff.DecodeJob(blobs, mean, std, out, verify, chunks, spec).start(threads)

    def decode(self, blob, mean, std, config: CodecConfig | None, marginal=None, threads: int = 1,
               workers: int = 1) -> torch.Tensor:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"codec: blob must be bytes, got {type(blob).__name__}")
        return huff.decode_batch_impl([blob], mean, std, spec=_spec_of([blob]))[0]

    def stream_infos(self, blobs, config: CodecConfig | None, marginal=None) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(head.fmt.dtype, head.shape) for head in (huff.parse_prefix(b, _spec_of([b])) for b in blobs)]

    def payload_bytes(self, blob: bytes, n: int, fmt: Format) -> int:
        return len(blob) - len(huff.parse_prefix(blob, _spec_of([blob])).prefix) - 8


def _decode_mixed(blobs, mean, std, out: torch.Tensor | None, threads: int | None, verify) -> torch.Tensor:
    """`MHuffCoder.decode_batch` of a batch holding both stream versions (a store written before and after
    version 2): each version's streams decoded in one call with their statistics, written back in batch order."""
    check = huff.verify_mask(verify, len(blobs))
    v1 = np.array([bytes(b[:3]) == MAGIC_V1 for b in blobs])
    ndim = 1 + len(huff.parse_prefix(blobs[0], SPEC_V1 if v1[0] else SPEC).shape)
    parts = {}
    for flag, spec in ((True, SPEC_V1), (False, SPEC)):
        index = np.flatnonzero(v1 == flag)
        pick = torch.from_numpy(index)
        # statistics of the batch's full rank with one row per stream: this version's rows
        mean_v, std_v = (t[pick] if isinstance(t, torch.Tensor) and t.dim() == ndim and t.shape[0] == len(blobs)
                         else t for t in (mean, std))
        parts[flag] = (pick, huff.decode_batch_impl([blobs[i] for i in index.tolist()], mean_v, std_v,
                                                   threads=threads, verify=[bool(v) for v in check[index]], spec=spec))
    first = parts[False][1]
    x = torch.empty((len(blobs), *first.shape[1:]), dtype=first.dtype)
    for pick, part in parts.values():
        x[pick] = part
    if out is None:
        return x
    out.copy_(x)
    return out
