"""The transformers seam: `CompressedCache`, lossless mode's coded storage, cache files and the prefix store. The layer and
its block storages are `hf_kvcompress.layer`; lossy mode's layer is `hf_kvcompress.lossy`."""

from .cache import CompressedCache
from .store import PrefixStore

__all__ = ["CompressedCache", "PrefixStore"]
