"""Plain per-head SVD: the region's K and V, each replaced by its best rank-r approximation (Eckart and Young
1936, https://doi.org/10.1007/BF02288367), with r as large as the budget allows. Attention sees every entry,
reconstructed from the factors. Factors are stored in the cache dtype (``entry_format`` does not apply)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...layer.storage import Block
from ..blocks import LowRankBlock
from ..region import FitContext, Region, dead_bias_or_none
from ..registry import MethodSettings, register
from ..solvers import truncated_svd


def rank_for_budget(heads: int, entries: int, head_dim: int, element_size: int, budget: int, bias_bytes: int,
                    value_dim: int | None = None) -> int:
    """Largest rank whose K and V factors (``n x r`` and ``r x d`` each, per head; values ``value_dim`` wide, default
    ``head_dim``) fit in ``budget`` bytes."""
    value_dim = head_dim if value_dim is None else value_dim
    per_rank = heads * (2 * entries + head_dim + value_dim) * element_size
    return max(0, min(head_dim, value_dim, entries, (budget - bias_bytes) // per_rank))


@dataclass(frozen=True)
class SVDSettings(MethodSettings):
    """Plain truncated SVD's settings (Eckart and Young 1936, https://doi.org/10.1007/BF02288367): its rank follows
    from the budget; nothing of its own."""

    PAPER: ClassVar[str] = "https://doi.org/10.1007/BF02288367"


@register("svd", settings=SVDSettings, needs_queries=False)
def compress(region: Region, budget: int, ctx: FitContext | None) -> list[Block]:
    """Low-rank factors of ``region``'s keys and values within ``budget`` bytes per batch row."""
    _, h, n, d = region.keys.shape
    elem = region.keys.element_size()
    bias = dead_bias_or_none(region.bias, region.keys.dtype)
    rank = rank_for_budget(h, n, d, elem, budget, 0 if bias is None else h * n * elem, region.values.shape[-1])
    if rank <= 0:
        return []
    live = region.live[..., None]
    # dead entries (padding) would pull the factors towards garbage; they stay masked by their bias anyway
    keys = torch.where(live, region.keys, torch.zeros_like(region.keys))
    values = torch.where(live, region.values, torch.zeros_like(region.values))
    return [LowRankBlock(truncated_svd(keys, rank, keys.dtype), truncated_svd(values, rank, values.dtype), bias,
                         tokens=region.tokens)]
