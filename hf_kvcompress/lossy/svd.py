"""Plain per-head SVD baseline: the region's K and V, each replaced by its best rank-r approximation (Eckart-Young),
with r as large as the budget allows. Attention sees every entry, reconstructed from the factors."""

from __future__ import annotations

import torch

from ..cache.storage import Block
from .blocks import LowRankBlock
from .region import FitContext, Region, dead_bias_or_none


def rank_for_budget(heads: int, entries: int, head_dim: int, element_size: int, budget: int, bias_bytes: int) -> int:
    """Largest rank whose K and V factors (``n x r`` and ``r x d`` each, per head) fit in ``budget`` bytes."""
    per_rank = 2 * heads * (entries + head_dim) * element_size
    return max(0, min(head_dim, entries, (budget - bias_bytes) // per_rank))


def truncated(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U S, W)`` of the rank-``rank`` truncated SVD of ``x`` (``[..., n, d]``), in ``x``'s dtype."""
    u, s, vh = torch.linalg.svd(x.float(), full_matrices=False)
    return (u[..., :rank] * s[..., None, :rank]).to(x.dtype), vh[..., :rank, :].contiguous().to(x.dtype)


def compress(region: Region, budget: int, ctx: FitContext | None) -> list[Block]:
    """Low-rank factors of ``region``'s keys and values within ``budget`` bytes per batch row."""
    _, h, n, d = region.keys.shape
    elem = region.keys.element_size()
    bias = dead_bias_or_none(region.bias, region.keys.dtype)
    rank = rank_for_budget(h, n, d, elem, budget, 0 if bias is None else h * n * elem)
    if rank <= 0:
        return []
    live = region.live[..., None]
    # dead entries (padding) would pull the factors towards garbage; they stay masked by their bias anyway
    keys = torch.where(live, region.keys, torch.zeros_like(region.keys))
    values = torch.where(live, region.values, torch.zeros_like(region.values))
    return [LowRankBlock(truncated(keys, rank), truncated(values, rank), bias, tokens=region.tokens)]
