"""Model-independent lossless codec for float tensors given a predicted mean and spread.

``encode(x, mean, std)`` codes every element under a bin-integrated Gaussian mixture (integer tables chosen
from (mean, std) with exact integer arithmetic) with constriction's ANS coder, in independently decodable
windows; ``decode`` returns a bit-identical tensor. See docs/codec.md for the format and the arithmetic.
"""

from __future__ import annotations

import torch

from .config import CodecConfig
from .decoder import decode_impl, decode_range_impl, stream_info_impl
from .encoder import encode_impl
from .errors import CorruptStreamError, ParameterMismatchError
from .marginal import Marginal
from .stats import CodecStats, encode_with_stats

__all__ = [
    "CodecConfig",
    "CodecStats",
    "CorruptStreamError",
    "Marginal",
    "ParameterMismatchError",
    "decode",
    "decode_range",
    "encode",
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
    return encode_impl(x, mean, std, config)[0]


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
    only numpy work). Raises `CorruptStreamError` for anything that cannot decode exactly.
    """
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
    return decode_range_impl(blob, start, stop, mean, std, marginal, config)


def stream_info(
    blob: bytes, *, config: CodecConfig | None = None, marginal: Marginal | None = None
) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape ``blob`` decodes to, from its checked header and window table (the payload is
    not decoded): lets a container check a stream against what it expects before allocating for it.
    ``config`` and ``marginal`` as for `decode`; raises `CorruptStreamError` like `decode`."""
    return stream_info_impl(blob, marginal, config)
