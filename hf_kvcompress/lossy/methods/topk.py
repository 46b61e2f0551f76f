"""Top-K in the style of H2O (Zhang et al. 2023, https://arxiv.org/abs/2306.14048) and SnapKV (Li et al. 2024,
https://arxiv.org/abs/2404.14469): keep the entries that received the most attention from the reference queries,
as they are; drop the rest. Selection is per batch row and KV head (the group's query heads pool)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...layer.storage import Block
from ..budget import kept_blocks
from ..region import FitContext, Region
from ..registry import MethodSettings, register
from ..scores import attention_mass


@dataclass(frozen=True)
class TopKSettings(MethodSettings):
    """Top-K's settings: none of its own (H2O, Zhang et al. 2023, https://arxiv.org/abs/2306.14048; SnapKV
    without pooling, https://arxiv.org/abs/2404.14469): the reference queries, sinks and window are shared."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2306.14048, https://arxiv.org/abs/2404.14469"


@register("topk", settings=TopKSettings, needs_queries=True)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Keep the most attended entries of ``region`` that fit in ``budget`` bytes per batch row."""
    if region.entries == 0:
        return []
    return kept_blocks(region, budget, attention_mass(region, ctx), ctx.config.entry_format)
