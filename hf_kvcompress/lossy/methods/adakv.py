"""AdaKV (Feng et al. 2024, https://arxiv.org/abs/2407.11550): the layer's budget is shared out among its KV heads by
their scores instead of evenly, so a head whose attention is concentrated gives entries to one whose attention is
spread out.

Scores are SnapKV's (each head's pooled observation-window votes, an attention weight, so the heads' scores are on
one scale). Of the entries the layer's budget pays for (per batch row), each head first gets its best ``SAFEGUARD``
share of an even split (the paper's safeguard against starving a head), the rest go to the best-scored entries of
any head. The heads then hold different numbers of entries: a `blocks.RaggedBlock` stores them compactly (the bytes a
head does not use are freed, `held_bytes` counts what is stored); attention reads the padded form. ``entry_format``
``mixed`` stores every kept entry in its cheapest tier here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...layer.storage import Block
from ...validation import check_number, checked
from ..blocks import RaggedBlock
from ..budget import entry_bytes
from ..region import FitContext, Region
from ..registry import register
from .snapkv import SnapKVSettings, snap_scores

#: every head keeps at least this share of an even split of the layer's entries (the paper's safeguard, 0.2)
SAFEGUARD = 0.2


@dataclass(frozen=True)
class AdaKVSettings(SnapKVSettings):
    """AdaKV's own settings (Feng et al. 2024, https://arxiv.org/abs/2407.11550): SnapKV's (``window``, ``kernel``: its
    scores, inherited) and ``safeguard``, the share of an even split every head keeps at least (`SAFEGUARD`)."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2407.11550"

    safeguard: float = checked(SAFEGUARD, check_number, low=0.0, high=1.0)


def adaptive_keep(score: torch.Tensor, total: int, safeguard: float = SAFEGUARD) -> torch.Tensor:
    """``[b, h, n]`` bool: per batch row, ``total`` entries over all heads (fewer if fewer are live, ``score`` finite):
    each head's best ``floor(safeguard * total / h)`` first, then the best remaining of any head."""
    b, h, n = score.shape
    live = torch.isfinite(score)
    keep = torch.zeros_like(live)
    floor_count = min(n, int(safeguard * total / h))
    if floor_count:
        first = score.topk(floor_count, dim=-1).indices
        keep.scatter_(-1, first, True)
        keep &= live
    rest = score.masked_fill(keep | ~live, float("-inf")).reshape(b, h * n)
    for row in range(b):
        more = min(total - int(keep[row].sum()), int(torch.isfinite(rest[row]).sum()))
        if more > 0:
            keep[row].view(-1)[rest[row].topk(more).indices] = True
    return keep


@register("adakv", settings=AdaKVSettings, needs_queries=True, own_positions=True)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Keep the best-scored entries of all heads of ``region`` together within ``budget`` bytes per batch row."""
    _, h, n, d = region.keys.shape
    if n == 0:
        return []
    per_entry = entry_bytes(1, d, region.keys.element_size(), with_bias=False, fmt=ctx.config.entry_format,
                            value_dim=region.values.shape[-1])
    total = min(h * n, (budget - h * 4) // per_entry)  # the counts: one int32 per head
    if total <= 0:
        return []
    own = ctx.config.settings
    keep = adaptive_keep(snap_scores(region, ctx, own.window, own.kernel), total, own.safeguard)
    return [RaggedBlock.from_mask(region.keys, region.values, keep, tokens=region.tokens, fmt=ctx.config.entry_format)]
