"""Model-independent lossless codec for float tensors given a predicted mean and spread.

``encode(x, mean, std)`` codes every element under a bin-integrated Gaussian mixture (integer tables chosen
from (mean, std) with exact integer arithmetic) with constriction's ANS coder, in independently decodable
windows; ``decode`` returns a bit-identical tensor. ``CodecConfig(coder="lanes")`` selects the compiled
interleaved-rANS format instead, with `encode_batch` / `decode_batch` coding many streams per call. See
docs/codec.md for the formats and the arithmetic.
"""

from __future__ import annotations

from .api import decode, decode_batch, decode_range, encode, encode_batch, start_decode_batch, stream_info
from .config import CodecConfig
from .errors import CorruptStreamError, ParameterMismatchError
from .stats import CodecStats, encode_with_stats
from .tables import Marginal, set_table_cache

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
    "set_table_cache",
    "start_decode_batch",
    "stream_info",
]
