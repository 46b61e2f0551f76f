"""Budget accounting: how many bytes a lossy layer may hold, and what an entry costs."""

from __future__ import annotations

import math
from itertools import accumulate, pairwise

import torch

from ..layer.storage import Block
from .blocks import kept_block
from .packed import MIXED_TIERS, vector_bytes
from .region import Region, dead_bias_or_none
from .scores import top_entries
from .settings import LossyConfig


def token_bytes(kv_heads: int, head_dim: int, element_size: int, value_dim: int | None = None) -> int:
    """Bytes one text position costs in a full cache, per batch row (its key and value over all KV heads; values
    ``value_dim`` wide, default ``head_dim``)."""
    return kv_heads * (head_dim + (head_dim if value_dim is None else value_dim)) * element_size


def budget_bytes(config: LossyConfig, seen_tokens: int, per_token: int) -> int:
    """Bytes one batch row of a layer may hold after a summary.

    ``budget`` is a fraction of what the full cache would hold for ``seen_tokens`` positions; ``budget_tokens``
    a number of token-equivalents. Side data (biases, factors, masks) counts against it.
    """
    if config.budget_tokens is not None:
        return config.budget_tokens * per_token
    return math.floor(config.budget * seen_tokens * per_token)


def full_budget(config: LossyConfig) -> bool:
    """A budget fraction of 1.0: everything fits, nothing is ever summarised."""
    return config.budget_tokens is None and config.budget >= 1.0


def entry_bytes(
    kv_heads: int, head_dim: int, element_size: int, *, with_bias: bool, value_rank: int | None = None,
    fmt: str = "model", value_dim: int | None = None,
) -> int:
    """Bytes of one kept entry per batch row: its key, its value (or its row of value factors at ``value_rank``)
    and its bias when biases are stored; keys and tensor values in entry format ``fmt`` (`packed`); values
    ``value_dim`` wide (default ``head_dim``)."""
    key = vector_bytes(head_dim, element_size, fmt)
    if value_rank is not None:
        value = value_rank * element_size
    else:
        value = key if value_dim is None or value_dim == head_dim else vector_bytes(value_dim, element_size, fmt)
    return kv_heads * (key + value + (element_size if with_bias else 0))


def keep_within(
    region: Region, budget: int, order: torch.Tensor | None, fmt: str = "model"
) -> tuple[Region, torch.Tensor] | None:
    """The best entries of ``region`` that fit in ``budget`` bytes per row and their indices (``[b, h, t]``), or None
    if none does.

    ``order``: ``[b, h, n]`` score, higher = keep first (None: the newest entries). A bias per entry is stored
    only if a kept entry needs one (a dead or earlier-fitted entry), so the count is settled in two steps.
    """
    b, h, n, d = region.keys.shape
    elem = region.keys.element_size()
    for with_bias in (False, True):
        count = min(n, budget // entry_bytes(h, d, elem, with_bias=with_bias, fmt=fmt, value_dim=region.values.shape[-1]))
        if count <= 0:
            return None
        if order is None:
            index = torch.arange(n - count, n, device=region.keys.device).expand(b, h, count)
        else:
            index = top_entries(order, count)
        kept = region.gather(index)
        if with_bias or bool((kept.bias == 0).all()):
            return kept, index
    return kept, index


def upgrade_order(
    score: torch.Tensor, budget: int, head_dim: int, element_size: int, *, with_bias: bool,
    value_dim: int | None = None,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Entry format ``mixed``: of ``t`` kept entries (``score`` ``[b, h, t]``, higher = more important), all stored in
    the last of `packed.MIXED_TIERS`, how many the budget left lets move up to each better tier (every entry to the
    second-to-last tier before any to the one above it), and the order that puts the best first: ``(order
    [b, h, t] indices into the kept entries, counts per tier but the last)``, each tier in its original order.
    Values are ``value_dim`` wide (default ``head_dim``)."""
    h, t = score.shape[-2:]
    tiers = MIXED_TIERS
    value_dim = head_dim if value_dim is None else value_dim
    spare = budget - t * entry_bytes(h, head_dim, element_size, with_bias=with_bias, fmt=tiers[-1], value_dim=value_dim)
    reach = []  # entries at this tier or better, from the last-but-one tier up
    for better, worse in zip(tiers[-2::-1], tiers[:0:-1]):
        step = h * sum(vector_bytes(width, element_size, better) - vector_bytes(width, element_size, worse)
                       for width in (head_dim, value_dim))
        n = max(0, min(reach[-1] if reach else t, spare // step))
        spare -= n * step
        reach.append(n)
    reach = reach[::-1]  # entries at each tier or better, best tier first (non-decreasing)
    counts = tuple(n - m for n, m in zip(reach, [0, *reach[:-1]]))
    ranked = score.argsort(dim=-1, descending=True, stable=True)
    edges = [0, *accumulate(counts), t]
    order = torch.cat([ranked[..., a:b].sort(dim=-1).values for a, b in pairwise(edges)], dim=-1)
    return order, counts


def tiered(kept: Region, score: torch.Tensor, budget: int, fmt: str, *, with_bias: bool) -> tuple[Region, tuple[int, ...]]:
    """``kept`` in the order its entry format stores it, and the counts `packed.pack` takes: unchanged for every
    format but ``mixed``, whose best-scored entries (``score`` ``[b, h, t]``) go first (`upgrade_order`)."""
    if fmt != "mixed":
        return kept, ()
    order, tiers = upgrade_order(score, budget, kept.keys.shape[-1], kept.keys.element_size(), with_bias=with_bias,
                                 value_dim=kept.values.shape[-1])
    return kept.gather(order), tiers


def kept_blocks(region: Region, budget: int, order: torch.Tensor | None, fmt: str) -> list[Block]:
    """What a selection method returns: the best entries of ``region`` (by ``order``, see `keep_within`) that fit
    in ``budget`` bytes per row, kept as they are in entry format ``fmt`` (no block if none fits)."""
    found = keep_within(region, budget, order, fmt)
    if found is None:
        return []
    kept, index = found
    # the newest entries are the most important without scores (StreamingLLM)
    score = index.float() if order is None else torch.gather(order, -1, index)
    kept, tiers = tiered(kept, score, budget, fmt, with_bias=not bool((kept.bias == 0).all()))
    bias = dead_bias_or_none(kept.bias, kept.keys.dtype)
    return [kept_block(kept.keys, kept.values, bias, tokens=region.tokens, fmt=fmt, tiers=tiers)]
