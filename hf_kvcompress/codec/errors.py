"""The codec's exception types (defined in `hf_kvcompress.errors`, with every other error of the library)."""

from __future__ import annotations

from ..errors import CorruptStreamError, ParameterMismatchError

__all__ = ["CorruptStreamError", "ParameterMismatchError"]
