"""TOVA, Token Omission Via Attention (Oren et al. 2024, https://arxiv.org/abs/2401.06104): keep the entries the
*current* query attends to most, its attention averaged over all heads of the layer, so every head of a layer keeps
the same positions.

The paper drops one token per decoding step; here the drop happens at each summary (every ``interval`` tokens and at
every prefill chunk: `LossyConfig.interval`), scored by the newest reference query at its own position, as kvpress's
prefill version does. Score of region entry j: its attention weight (softmax over everything the layer holds) from
the newest query of every query head, averaged over the layer's query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...layer.storage import Block
from ..budget import kept_blocks
from ..region import FitContext, Region
from ..registry import MethodSettings, register
from ..scores import attention_mass
from .snapkv import window_context


@dataclass(frozen=True)
class TOVASettings(MethodSettings):
    """TOVA's settings (Oren et al. 2024, https://arxiv.org/abs/2401.06104): it scores with the newest query
    alone; nothing of its own."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2401.06104"


@register("tova", settings=TOVASettings, needs_queries=True, own_positions=True)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Keep the entries of ``region`` the newest query attends to most (head average) that fit in ``budget`` bytes
    per batch row, the same positions in every head."""
    if region.entries == 0:
        return []
    per_head = attention_mass(region, window_context(ctx, 1))  # [b, h, n], the group's heads averaged
    score = per_head.mean(dim=1, keepdim=True).expand_as(per_head).masked_fill(~region.live, float("-inf"))
    return kept_blocks(region, budget, score.contiguous(), ctx.config.entry_format)
