"""The ``ans`` coder (`CodecConfig(coder="ans")`): adaptive windows (`windows`) of symbols coded with
constriction's ANS coder (`entropy`) in the full or compact layout (`layout`), encoded and decoded by
`streams` (the device path: `device`), monitored by `stats`. `AnsCoder` is its entry in the registry."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..codec_config import CodecConfig
from ..interface import CodecStats, Coder, check_out, check_tensor, copy_into
from ..registry import register
from ..symbols import format_of
from ..tables import Marginal
from .layout import COMPACT_MAGIC, MAGIC
from .stats import encode_with_stats
from .streams import decode_impl, decode_range_impl, encode_impl, stream_info_impl


@register
class AnsCoder(Coder):
    """Streams of windows coded by constriction's ANS coder; self-describing (``header="full"``) or compact.
    Not batched: a batch is coded stream by stream (constriction holds the GIL; ``workers`` fork processes
    over one stream's windows when decoding)."""

    name = "ans"
    magic = (MAGIC, COMPACT_MAGIC)
    windows = ("fixed", "metadata", "predicted", "causal")
    batched = False

    def encode(self, x, mean, std, cfg: CodecConfig) -> bytes:
        return encode_impl(x, mean, std, cfg)[0]

    def encode_batch(self, x, mean, std, cfg: CodecConfig, threads: int | None = None) -> list[bytes]:
        check_tensor(x)
        if x.dim() < 1:
            raise ValueError("codec.encode_batch: x needs a leading stream dimension [N, ...]")
        return [encode_impl(x[i], _row(mean, x.dim(), i), _row(std, x.dim(), i), cfg)[0] for i in range(x.shape[0])]

    def decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                     threads: int | None = None, verify: bool | Sequence[bool] = True) -> torch.Tensor:
        # every stream is verified (its window and data checksums cost little beside constriction)
        if isinstance(blobs, (bytes, bytearray, memoryview)) or not hasattr(blobs, "__len__"):
            raise TypeError(f"codec.decode_batch: blobs must be a sequence of bytes, got {type(blobs).__name__}")
        if len(blobs) == 0:
            raise ValueError("codec.decode_batch: no streams given (the output shape would be unknown)")
        threads = 1 if threads is None else threads
        ndim = 1 + len(stream_info_impl(blobs[0], None, cfg)[1])
        ys = [decode_impl(b, _row(mean, ndim, i), _row(std, ndim, i), None, 1, threads, config=cfg)
              for i, b in enumerate(blobs)]
        first = ys[0]
        for i, y in enumerate(ys):
            if y.dtype != first.dtype or y.shape != first.shape:
                raise ValueError(f"codec.decode_batch: stream {i} holds {y.dtype} {tuple(y.shape)}, stream 0 "
                                 f"{first.dtype} {tuple(first.shape)}; a batch needs one shape, dtype and stats")
        x = torch.stack([y.cpu() for y in ys])
        if out is not None:
            check_out(out, format_of(first.dtype), tuple(x.shape))
            return copy_into(out, x)
        return x.to(first.device)

    def decode(self, blob, mean, std, config: CodecConfig | None, marginal: Marginal | None = None,
               threads: int = 1, workers: int = 1) -> torch.Tensor:
        return decode_impl(blob, mean, std, marginal, threads, workers, config=config)

    def decode_range(self, blob, start: int, stop: int, mean, std, config: CodecConfig | None,
                     marginal: Marginal | None = None) -> torch.Tensor:
        return decode_range_impl(blob, start, stop, mean, std, marginal, config)

    def stream_infos(self, blobs, config: CodecConfig | None,
                     marginal: Marginal | None = None) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [stream_info_impl(blob, marginal, config) for blob in blobs]

    def encode_with_stats(self, x, mean, std, cfg: CodecConfig, *, decode: bool = True,
                          exact: bool = True) -> tuple[bytes, CodecStats]:
        return encode_with_stats(x, mean, std, cfg, decode=decode, exact=exact)


def _row(stat, ndim: int, i: int):
    """Stream ``i``'s mean / std of a batch of ``ndim`` dims: ``stat[i]``, or ``stat[0]`` for a shared leading
    dim (a stat of fewer dims padded in front first); numbers and None as they are."""
    if not isinstance(stat, torch.Tensor):
        return stat
    if stat.dim() < ndim:
        stat = stat.reshape((1,) * (ndim - stat.dim()) + tuple(stat.shape))
    return stat[i if stat.shape[0] != 1 else 0]
