"""Every exception type the library raises on purpose, in one place (a leaf module: any part of the package,
the model-independent codec included, imports it without a cycle). Each is also importable from the module that
raises it. All but `CliError` are ``ValueError`` subclasses, so callers who treat any bad input alike can catch
that."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing problem of a command line: printed as one line, exit status 2."""


class ConfigTypeError(TypeError, ValueError):
    """A config field of the wrong type. A ``TypeError``, as Python raises for a wrong type (and as `CodecConfig`
    always did), and a ``ValueError``, as every config error of `CompressionConfig` is documented to be: callers
    catching either keep working."""


class CorruptStreamError(ValueError):
    """The bytes are not a stream this codec can decode bit-exactly.

    Raised for foreign, truncated or corrupted input, a format version from the future, tables or a marginal
    that differ from the encoder's, and a ``mean``/``std`` at decode time that differs from the one used to
    encode.
    """


class ParameterMismatchError(CorruptStreamError):
    """The ``mean`` or ``std`` given to decode is not the one the stream was encoded with (its fingerprint
    differs): the predictor that produced it did not reproduce."""


class PredictorMismatchError(ValueError):
    """Decoding found means that differ from the ones used to encode: the predictor did not reproduce
    (other thread count, CPU, library version or calibration)."""


class CacheFileError(ValueError):
    """A saved cache cannot be loaded: corrupt, truncated, foreign, from another version, model or
    calibration, or its predictor does not reproduce here."""


class CalibrationError(ValueError):
    """A calibration file is missing, corrupt, from another version, or does not fit the model."""


class ChunkError(ValueError):
    """A chunk this coder does not take: wrong dtype, layout, or not the calibrated model's shape."""


class ChunkPayloadError(ValueError):
    """Bytes that do not decode to the exact chunk: foreign, truncated, corrupted, or coded with another
    calibration or for another shape."""


class UnknownModelError(ValueError):
    """No local folder and no loadable hub model of that name (raised before any download or model load)."""


#: how a `LayerKindError` ends: what to do instead
BUILD_WITH_MODEL = ("Build it with CompressedCache(config, model=model), which holds the model's layer types or refuses "
                    "them, saying why.")


class LayerKindError(ValueError, AttributeError, IndexError):
    """The model asked its cache for a layer kind this cache does not hold: a cache layer it reads directly before
    any update made it (``cache.layers[i]``), or a method of a cache layer class of the model's own (DeepSeek-V4's
    ``store_compression_weights``). Typically a `CompressedCache` built without ``model=``, whose layers are made
    lazily as attention layers. Also an ``AttributeError`` / ``IndexError``, so ``hasattr``, ``getattr(..., default)``
    and index probes behave as on any object and list."""
