"""The huff family: ``huff`` (Huffman-coded sign and exponent per stream, mantissa raw, a fast compiled decoder:
`huff.HuffCoder`) and ``mhuff`` (sign, exponent and top mantissa bits, four tables per stream, for per-element
statistics: `mhuff.MHuffCoder`); both decode on a CUDA device with Triton (`huff_triton`, imported when used)."""

from . import huff, mhuff  # noqa: F401 (registers the coders)
