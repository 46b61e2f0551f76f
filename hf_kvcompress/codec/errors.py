"""The codec's exception types."""

from __future__ import annotations


class CorruptStreamError(ValueError):
    """The bytes are not a stream this codec can decode bit-exactly.

    Raised for foreign, truncated or corrupted input, a format version from the future, tables or a marginal
    that differ from the encoder's, and a ``mean``/``std`` at decode time that differs from the one used to
    encode. A subclass of ``ValueError`` so that callers who treat any bad input alike can catch that.
    """


class ParameterMismatchError(CorruptStreamError):
    """The ``mean`` or ``std`` given to decode is not the one the stream was encoded with (its fingerprint
    differs): the predictor that produced it did not reproduce."""

