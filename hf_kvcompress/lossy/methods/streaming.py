"""StreamingLLM (Xiao et al. 2023, https://arxiv.org/abs/2309.17453): attention sinks plus the most recent
tokens, nothing else.

The layer already keeps the sinks and the recent window exact; this method spends the rest of the budget on the
newest entries of the region, so the cache is ``sinks + a longer recent window``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...layer.storage import Block
from ..budget import kept_blocks
from ..region import FitContext, Region
from ..registry import MethodSettings, register


@dataclass(frozen=True)
class StreamingSettings(MethodSettings):
    """StreamingLLM's settings (Xiao et al. 2023, https://arxiv.org/abs/2309.17453): its sinks and recent window
    are the shared ``LossyConfig.sinks`` and the cache's ``residual_tokens``; nothing of its own."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2309.17453"


@register("streaming", settings=StreamingSettings, needs_queries=False)
def compress(region: Region, budget: int, ctx: FitContext | None) -> list[Block]:
    """Keep the newest entries of ``region`` that fit in ``budget`` bytes per batch row."""
    return kept_blocks(region, budget, None, "model" if ctx is None else ctx.config.entry_format)
