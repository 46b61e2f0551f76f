"""Model-independent lossless codec for float tensors given a predicted mean and spread.

``encode(x, mean, std)`` codes every element under a bin-integrated Gaussian mixture (integer tables chosen
from (mean, std) with exact integer arithmetic); ``decode`` returns a bit-identical tensor. Four coders
implement it (`interface.Coder`, registered in `coders`): ``lanes`` (the default; compiled interleaved rANS,
`encode_batch` / `decode_batch` code many streams per call), ``ans`` (constriction's ANS coder over
independently decodable adaptive windows) and ``huff`` (generation's: sign and exponent Huffman-coded against a
context from mean / std, mantissa raw, ~10x ``lanes``'s decode speed), with ``mhuff`` beside it (for per-element statistics: the top
mantissa bits in the symbol too, four tables per stream): ``CodecConfig(coder=...)``. See docs/codec_format.md for the formats and
the arithmetic.
"""

from __future__ import annotations

from ..errors import CorruptStreamError, ParameterMismatchError
from .api import (
    coder_of,
    coder_of_stream,
    decode,
    decode_batch,
    decode_range,
    decode_streams,
    encode,
    encode_batch,
    encode_streams,
    encode_with_stats,
    start_decode_batch,
    stream_info,
    stream_infos,
)
from .codec_config import DEFAULT_CODER, GENERATION_CODER, CodecConfig
from .coders import CODERS
from .interface import CodecStats, Coder, PendingDecode
from .lanes_coder import jit, lanes  # modules other code patches as codec.jit / codec.lanes
from .tables import Marginal, set_table_cache

__all__ = [
    "CODERS",
    "DEFAULT_CODER",
    "GENERATION_CODER",
    "CodecConfig",
    "CodecStats",
    "Coder",
    "CorruptStreamError",
    "Marginal",
    "ParameterMismatchError",
    "PendingDecode",
    "coder_of",
    "coder_of_stream",
    "decode",
    "decode_batch",
    "decode_range",
    "decode_streams",
    "encode",
    "encode_batch",
    "encode_streams",
    "encode_with_stats",
    "jit",
    "lanes",
    "set_table_cache",
    "start_decode_batch",
    "stream_info",
    "stream_infos",
]
