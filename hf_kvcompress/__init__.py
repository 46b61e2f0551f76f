"""hf_kvcompress: KV-cache compression for Hugging Face transformers."""

from .cache import CompressedCache
from .config import CompressionConfig, LosslessConfig, LossyConfig

__version__ = "0.1.0"

__all__ = ["CompressedCache", "CompressionConfig", "LosslessConfig", "LossyConfig", "__version__"]
