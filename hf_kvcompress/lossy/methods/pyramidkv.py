"""PyramidKV (Cai et al. 2024, https://arxiv.org/abs/2406.02069): lower layers, whose attention is spread widely, get
more of the budget, higher layers, whose attention funnels onto few entries, less; each layer selects as SnapKV does.

Layer budgets (the paper's arithmetic sequence): with ``k`` the uniform per-layer budget and ``L`` layers, the top
layer gets ``k / BETA``, the bottom ``2k - k / BETA``, the layers between in a straight line, so the layers together
hold ``L k``, what every other method holds (`layer_share`; the cache applies it through
`registry.LossyMethod.layer_share`). A layer whose share exceeds the whole of its tokens never needs a summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...layer.storage import Block
from ...validation import check_number, checked
from ..budget import kept_blocks
from ..region import FitContext, Region
from ..registry import register
from .snapkv import SnapKVSettings, snap_scores

#: the top layer's budget is the uniform one divided by BETA (the paper's default, 20)
BETA = 20.0


@dataclass(frozen=True)
class PyramidKVSettings(SnapKVSettings):
    """PyramidKV's own settings (Cai et al. 2024, https://arxiv.org/abs/2406.02069): SnapKV's (``window``, ``kernel``:
    its selection, inherited) and ``beta``, the top layer's budget is the uniform one divided by it (`BETA`)."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2406.02069"

    beta: float = checked(BETA, check_number, low=1.0, high=1e6)


def layer_share(layer: int, layers: int, beta: float = BETA) -> float:
    """Share of the uniform per-layer budget layer ``layer`` of ``layers`` gets (they sum to ``layers``)."""
    if layers <= 1:
        return 1.0
    top = 1.0 / beta
    return (2.0 - top) - (2.0 - 2.0 * top) * layer / (layers - 1)


def _share(layer: int, layers: int, settings: PyramidKVSettings) -> float:
    return layer_share(layer, layers, settings.beta)


@register("pyramidkv", settings=PyramidKVSettings, needs_queries=True, own_positions=True, layer_share=_share)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """SnapKV's selection within this layer's share of the budget (``budget`` already is that share)."""
    if region.entries == 0:
        return []
    own = ctx.config.settings
    return kept_blocks(region, budget, snap_scores(region, ctx, own.window, own.kernel), ctx.config.entry_format)
