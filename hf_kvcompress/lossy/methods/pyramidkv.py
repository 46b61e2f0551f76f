"""PyramidKV (Cai et al. 2024, https://arxiv.org/abs/2406.02069): lower layers, whose attention is spread widely, get
more of the budget, higher layers, whose attention funnels onto few entries, less; each layer selects as SnapKV does.

Layer budgets (the paper's arithmetic sequence): with ``k`` the uniform per-layer budget and ``L`` layers, the top
layer gets ``k / BETA``, the bottom ``2k - k / BETA``, the layers between in a straight line, so the layers together
hold ``L k``, what every other method holds (`layer_share`; the cache applies it through
`registry.LossyMethod.layer_share`). A layer whose share exceeds the whole of its tokens never needs a summary.
"""

from __future__ import annotations

from ...layer.storage import Block
from ..budget import kept_blocks
from ..region import FitContext, Region
from ..registry import register
from .snapkv import snap_scores

#: the top layer's budget is the uniform one divided by BETA (the paper's default, 20)
BETA = 20.0


def layer_share(layer: int, layers: int) -> float:
    """Share of the uniform per-layer budget layer ``layer`` of ``layers`` gets (they sum to ``layers``)."""
    if layers <= 1:
        return 1.0
    top = 1.0 / BETA
    return (2.0 - top) - (2.0 - 2.0 * top) * layer / (layers - 1)


@register("pyramidkv", paper="https://arxiv.org/abs/2406.02069", needs_queries=True, own_positions=True,
          layer_share=layer_share)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """SnapKV's selection within this layer's share of the budget (``budget`` already is that share)."""
    if region.entries == 0:
        return []
    return kept_blocks(region, budget, snap_scores(region, ctx), ctx.config.entry_format)
