"""StreamingLLM baseline (Xiao et al. 2023): attention sinks plus the most recent tokens, nothing else.

The layer already keeps the sinks and the recent window exact; this method spends the rest of the budget on the
newest entries of the region, so the cache is ``sinks + a longer recent window``.
"""

from __future__ import annotations

from ..cache.storage import Block
from .blocks import LossyBlock
from .budget import keep_within
from .region import FitContext, Region, dead_bias_or_none


def compress(region: Region, budget: int, ctx: FitContext | None) -> list[Block]:
    """Keep the newest entries of ``region`` that fit in ``budget`` bytes per batch row."""
    kept = keep_within(region, budget, None)
    if kept is None:
        return []
    return [LossyBlock(kept.keys, kept.values, dead_bias_or_none(kept.bias, kept.keys.dtype), tokens=region.tokens)]
