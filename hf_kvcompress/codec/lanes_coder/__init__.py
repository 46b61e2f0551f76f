"""The ``lanes`` coder: compiled interleaved rANS, one window per stream (`interleaved.LanesCoder`)."""
