"""hf_kvcompress: KV-cache compression for Hugging Face transformers."""

from . import codec, downloads
from .cache import CompressedCache, PrefixStore
from .config import CompressionConfig, LosslessConfig, LossyConfig
from .version import __version__

# The codec knows no application folders; the library keeps its built tables with its other files (a path read
# when the tables are first built, so importing creates nothing).
codec.set_table_cache(lambda: downloads.cache_dir() / "codec")

__all__ = ["CompressedCache", "CompressionConfig", "LosslessConfig", "LossyConfig", "PrefixStore", "__version__"]
