"""The ``huff`` coder: Huffman-coded sign and exponent per stream, mantissa raw, a fast compiled decoder
(`huff.HuffCoder`)."""

from . import huff  # noqa: F401 (registers the coder)
