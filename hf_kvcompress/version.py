"""The library version (saved caches record it; a module of its own so that any module can import it)."""

__version__ = "0.1.0"
