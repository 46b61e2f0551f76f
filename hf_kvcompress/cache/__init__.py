"""The transformers seam: `CompressedCache`, lossless mode's coded storage, and cache files. The layer and
its block storages are `hf_kvcompress.layer`; lossy mode's layer is `hf_kvcompress.lossy`."""

from .cache import CompressedCache

__all__ = ["CompressedCache"]
