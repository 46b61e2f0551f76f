"""One model layer's cache: `CompressedLayer` (sealed blocks plus a residual of recent tokens), its sliding-window
subclass `SlidingWindowLayer`, and the `Block` / `Storage` interface its sealed blocks are held through.
Lossless mode plugs in a `Storage` (`hf_kvcompress.cache.coded`); lossy mode subclasses the layer
(`hf_kvcompress.lossy.layer`). Both import this package; it imports neither."""

from .layer import CompressedLayer
from .sliding import SlidingWindowLayer
from .storage import Block, RawBlock, RawStorage, Storage

__all__ = ["Block", "CompressedLayer", "RawBlock", "RawStorage", "SlidingWindowLayer", "Storage"]
