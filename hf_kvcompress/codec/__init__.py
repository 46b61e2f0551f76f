"""Model-independent lossless codec for float tensors given a predicted mean and spread.

``encode(x, mean, std)`` codes every element under a bin-integrated Gaussian mixture (integer tables chosen
from (mean, std) with exact integer arithmetic) with constriction's ANS coder, in independently decodable
windows; ``decode`` returns a bit-identical tensor. ``CodecConfig(coder="lanes")`` selects the compiled
interleaved-rANS format instead, with `encode_batch` / `decode_batch` coding many streams per call. See
docs/codec.md for the formats and the arithmetic.
"""

from __future__ import annotations

import torch

from .config import CodecConfig
from .decoder import decode_impl, decode_range_impl, stream_info_impl
from .encoder import encode_impl
from .errors import CorruptStreamError, ParameterMismatchError
from .inputs import check_config
from .marginal import Marginal
from .stats import CodecStats, encode_with_stats
from .stream import LANES_MAGIC

__all__ = [
    "CodecConfig",
    "CodecStats",
    "CorruptStreamError",
    "Marginal",
    "ParameterMismatchError",
    "decode",
    "decode_batch",
    "decode_range",
    "encode",
    "encode_batch",
    "encode_with_stats",
    "stream_info",
]


def encode(
    x: torch.Tensor,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    config: CodecConfig | None = None,
) -> bytes:
    """Losslessly code ``x`` (bfloat16, float16 or float32, any shape) given a predicted ``mean`` and
    spread ``std``, each broadcastable to ``x`` (or None: mean 0 / a per-window spread sent as side info)."""
    cfg = check_config(config)
    if cfg.coder == "lanes":
        from .lanes import encode_one

        return encode_one(x, mean, std, cfg)
    return encode_impl(x, mean, std, cfg)[0]


def encode_batch(
    x: torch.Tensor,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    config: CodecConfig | None = None,
    threads: int | None = None,
) -> list[bytes]:
    """Code ``x`` of shape ``[N, ...]`` as N independent streams (``x[i]`` each) in one compiled call
    (``threads`` > 1: one per thread, the streams split between them).

    ``mean`` / ``std`` broadcast to ``x`` (e.g. ``[N, 1, D]`` per stream and channel, ``[1, 1, D]`` shared);
    stream ``i`` is byte-identical to ``encode(x[i], mean[i], std[i], config)`` (with ``mean[0]`` for a
    shared leading dim). Needs ``config.coder == "lanes"``."""
    cfg = check_config(config)
    if cfg.coder != "lanes":
        raise ValueError(f"codec.encode_batch needs CodecConfig(coder='lanes'), got coder={cfg.coder!r}")
    from .lanes import encode_batch_impl

    return encode_batch_impl(x, mean, std, cfg, threads=threads)


def decode_batch(
    blobs: list[bytes],
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    config: CodecConfig | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Inverse of `encode_batch`: ``[N, ...]`` from N lanes streams of one shape and dtype, decoded in one
    compiled call (GIL released; ``threads`` > 1 splits the streams over that many threads), into ``out``
    (a contiguous CPU tensor of that shape and dtype) when given. ``mean`` / ``std`` as for `encode_batch`,
    checked per stream by fingerprint (`ParameterMismatchError`); `CorruptStreamError` for any stream that
    cannot decode exactly."""
    cfg = check_config(config)
    if cfg.coder != "lanes":
        raise ValueError(f"codec.decode_batch needs CodecConfig(coder='lanes'), got coder={cfg.coder!r}")
    from .lanes import decode_batch_impl

    return decode_batch_impl(blobs, mean, std, cfg, out=out, threads=threads)


def decode(
    blob: bytes,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    *,
    config: CodecConfig | None = None,
    marginal: Marginal | None = None,
    threads: int = 1,
    workers: int = 1,
) -> torch.Tensor:
    """Inverse of `encode`: the same mean/std (checked by fingerprint) give back ``x`` bit for bit.

    ``config``: the encoder's `CodecConfig`; required for ``header="compact"`` streams (checked by digest);
    full streams carry their own and only take the marginal from it. ``marginal``: the p_hat the
    stream was encoded with, if not the default (or pass it inside ``config``). ``workers > 1`` decodes
    windows in forked processes (scales: constriction holds the GIL), ``threads > 1`` on threads (overlaps
    only numpy work). Raises `CorruptStreamError` for anything that cannot decode exactly. Lanes streams
    (``coder="lanes"``) are recognised by their magic bytes and need ``config=``.
    """
    if _is_lanes(blob):
        from .lanes import decode_one

        _check_threads(threads, workers)
        return decode_one(blob, mean, std, _lanes_config(config, marginal))
    return decode_impl(blob, mean, std, marginal, threads, workers, config=config)


def decode_range(
    blob: bytes,
    start: int,
    stop: int,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    *,
    config: CodecConfig | None = None,
    marginal: Marginal | None = None,
) -> torch.Tensor:
    """Elements ``start:stop`` of the flattened tensor (1-D), decoding only the windows they lie in
    (causal mode: all windows up to ``stop``, since boundaries are found serially). ``config`` and
    ``marginal`` as for `decode`."""
    if _is_lanes(blob):
        from .lanes import decode_range_one

        return decode_range_one(blob, start, stop, mean, std, _lanes_config(config, marginal))
    return decode_range_impl(blob, start, stop, mean, std, marginal, config)


def _is_lanes(blob: object) -> bool:
    return isinstance(blob, (bytes, bytearray, memoryview)) and bytes(blob[:3]) == LANES_MAGIC


def _check_threads(threads: int, workers: int) -> None:
    for name, v in (("threads", threads), ("workers", workers)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"codec: {name} must be an int >= 1, got {v!r}")


def _lanes_config(config: CodecConfig | None, marginal: Marginal | None) -> CodecConfig | None:
    """The config to check a lanes stream's digest against (``marginal=`` may supply the p_hat)."""
    if marginal is not None and not isinstance(marginal, Marginal):
        raise TypeError(f"codec: marginal must be a Marginal or None, got {type(marginal).__name__}")
    if config is None or marginal is None:
        return config
    if not isinstance(config, CodecConfig):
        raise TypeError(f"codec: config must be a CodecConfig or None, got {type(config).__name__}")
    if config.marginal is not None and marginal != config.marginal:
        raise ValueError("codec: marginal= differs from config.marginal; pass the marginal in one place")
    import dataclasses

    return dataclasses.replace(config, marginal=marginal)


def stream_info(
    blob: bytes, *, config: CodecConfig | None = None, marginal: Marginal | None = None
) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape ``blob`` decodes to, from its checked header and window table (the payload is
    not decoded): lets a container check a stream against what it expects before allocating for it.
    ``config`` and ``marginal`` as for `decode`; raises `CorruptStreamError` like `decode`."""
    if _is_lanes(blob):
        from .lanes import stream_info_one

        return stream_info_one(blob, _lanes_config(config, marginal))
    return stream_info_impl(blob, marginal, config)
