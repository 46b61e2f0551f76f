"""hf_kvcompress: KV-cache compression for Hugging Face transformers."""

from .cache import CompressedCache
from .config import CompressionConfig, LosslessConfig, LossyConfig
from .version import __version__

__all__ = ["CompressedCache", "CompressionConfig", "LosslessConfig", "LossyConfig", "__version__"]
