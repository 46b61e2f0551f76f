"""The coder registry: every coder by its `CodecConfig.coder` name. A coder is a module with an `interface.Coder`
subclass decorated with `registry.register`; the import line below (the registry line) loads them."""

from __future__ import annotations

from . import ans_coder, huff_coder, lanes_coder  # noqa: F401 (the registry line: importing a coder module registers it)
from .interface import Coder
from .registry import REGISTERED

#: name -> coder, in registration order
CODERS: dict[str, Coder] = REGISTERED
