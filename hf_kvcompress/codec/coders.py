"""The coder registry: every coder by its `CodecConfig.coder` name. A coder is a module with an
`interface.Coder` subclass and its line here."""

from __future__ import annotations

from .ans_coder.ans import AnsCoder
from .codec_config import install_coders
from .interface import Coder
from .lanes_coder.interleaved import LanesCoder

CODERS: dict[str, Coder] = {coder.name: coder for coder in (
    AnsCoder(),
    LanesCoder(),
)}
install_coders(CODERS)
