"""Top-K baseline (H2O / SnapKV style): keep the entries that received the most attention from the reference
queries, as they are; drop the rest. Selection is per batch row and KV head (the group's query heads pool)."""

from __future__ import annotations

from ..cache.storage import Block
from .blocks import kept_block
from .budget import keep_within
from .entropy import attention_mass
from .region import FitContext, Region, dead_bias_or_none


def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Keep the most attended entries of ``region`` that fit in ``budget`` bytes per batch row."""
    if region.entries == 0:
        return []
    fmt = ctx.config.entry_format
    kept = keep_within(region, budget, attention_mass(region, ctx), fmt)
    if kept is None:
        return []
    bias = dead_bias_or_none(kept.bias, kept.keys.dtype)
    return [kept_block(kept.keys, kept.values, bias, tokens=region.tokens, fmt=fmt)]
