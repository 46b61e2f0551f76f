"""Name -> compression function. Each takes ``(region, budget_bytes_per_row, context)`` and returns the blocks
that replace the region."""

from __future__ import annotations

from collections.abc import Callable

from ..cache.storage import Block
from . import streaming, summary, svd, topk
from .region import FitContext, Region

Method = Callable[[Region, int, FitContext], list[Block]]

METHODS: dict[str, Method] = {
    "summary": summary.compress,
    "topk": topk.compress,
    "streaming": streaming.compress,
    "svd": svd.compress,
}
