"""hf_kvcompress: KV-cache compression for Hugging Face transformers.

The public names load on first use (PEP 562): ``import hf_kvcompress`` imports neither torch nor transformers, so
``hf-kvcompress --version`` and ``--help`` answer at once; ``from hf_kvcompress import CompressedCache`` loads what
it needs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

#: the documented exception types (`errors`: a leaf module, no torch), importable from here
ERRORS = ("CacheFileError", "CalibrationError", "ChunkError", "ChunkPayloadError", "ConfigTypeError",
          "CorruptStreamError", "LayerKindError", "ParameterMismatchError", "PredictorMismatchError",
          "UnknownModelError")

#: public name -> the module that defines it (a module name alone: the module itself)
_PUBLIC = {
    "CompressedCache": ".cache",
    "PrefixStore": ".cache",
    "Calibration": ".calibration",
    "CompressionConfig": ".config",
    "LosslessConfig": ".config",
    "LossyConfig": ".config",
    "configure_threads": ".threads",
    "codec": ".codec",
    "downloads": ".downloads",
    **{name: ".errors" for name in ERRORS},
}

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from . import codec as codec
    from . import downloads as downloads
    from .cache import CompressedCache, PrefixStore
    from .calibration import Calibration
    from .config import CompressionConfig, LosslessConfig, LossyConfig
    from .errors import CacheFileError as CacheFileError
    from .errors import CalibrationError as CalibrationError
    from .errors import ChunkError as ChunkError
    from .errors import ChunkPayloadError as ChunkPayloadError
    from .errors import ConfigTypeError as ConfigTypeError
    from .errors import CorruptStreamError as CorruptStreamError
    from .errors import LayerKindError as LayerKindError
    from .errors import ParameterMismatchError as ParameterMismatchError
    from .errors import PredictorMismatchError as PredictorMismatchError
    from .errors import UnknownModelError as UnknownModelError
    from .threads import configure_threads


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if where == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = [
    "Calibration", "CompressedCache", "CompressionConfig", "LosslessConfig", "LossyConfig", "PrefixStore", "__version__",
    "configure_threads", *ERRORS,
]
