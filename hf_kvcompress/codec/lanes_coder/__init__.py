"""The ``lanes`` coder: compiled interleaved rANS, one window per stream (`interleaved.LanesCoder`)."""

from . import interleaved  # noqa: F401 (registers the coder)
