"""LMCache reads LMCACHE_TRACK_USAGE when it starts: no usage reporting from tests (set before any import)."""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
