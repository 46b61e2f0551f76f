"""The transformers seam: `CompressedCache`, its per-layer class and the block storages."""

from .cache import CompressedCache
from .layer import CompressedLayer
from .storage import Block, RawBlock, RawStorage, Storage

__all__ = ["Block", "CompressedCache", "CompressedLayer", "RawBlock", "RawStorage", "Storage"]
