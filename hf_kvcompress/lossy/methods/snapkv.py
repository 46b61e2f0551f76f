"""SnapKV (Li et al. 2024, https://arxiv.org/abs/2404.14469): each KV head keeps the entries the *observation window*
(the last queries of the prompt, at their own positions) attends to most, after pooling the votes along the positions
so that neighbours of an important entry come with it ("clustered important KV positions", Algorithm 1).

Score of region entry j for KV head h: the attention weight (softmax over everything the layer holds: sinks, region,
recent window) that each of the last `WINDOW` reference queries of each query head of h's group gives j, summed over
those queries and the group (GQA pools the group's votes), then max-pooled over `KERNEL` neighbouring region entries.
Under chunked prefill the window is the last queries of each chunk (with the queries kept since the last summary
before them). Pooling runs over the region's entry order, which is position order (an earlier summary's kept entries
first, then newer tokens), so entries next to each other there may be far apart in the text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

from ...layer.storage import Block
from ...validation import check_int, checked
from ..budget import kept_blocks
from ..region import FitContext, Region
from ..registry import MethodSettings, register
from ..scores import attention_mass

#: observation window, in queries per query head (the paper's experiments use the last 32 prompt tokens)
WINDOW = 32
#: pooling kernel over neighbouring entries (odd, so that it centres on the entry; the authors' code uses 5 or 7)
KERNEL = 7


def _odd(where: str, value: object) -> None:
    check_int(where, value, minimum=1)
    if value % 2 == 0:  # type: ignore[operator]
        raise ValueError(f"{where} must be odd (the pooling centres on the entry), got {value}")


@dataclass(frozen=True)
class SnapKVSettings(MethodSettings):
    """SnapKV's own settings (Li et al. 2024, https://arxiv.org/abs/2404.14469): ``window``, the observation window
    in queries per query head (`WINDOW`); ``kernel``, the pooling kernel over neighbouring entries (`KERNEL`)."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2404.14469"

    window: int = checked(WINDOW, check_int, minimum=1)
    kernel: int = checked(KERNEL, _odd)


def window_context(ctx: FitContext, window: int) -> FitContext:
    """``ctx`` with only the last ``window`` reference queries of each query head (the observation window); the
    queries lie group after group along the query axis (`region.FitContext`)."""
    b, h, total, d = ctx.queries.shape
    per_head = total if ctx.positions is None else ctx.positions.shape[-1]
    groups = max(1, total // max(per_head, 1))
    keep = min(window, per_head)
    queries = ctx.queries.reshape(b, h, groups, per_head, d)[..., -keep:, :].reshape(b, h, groups * keep, d)
    weight = ctx.query_weight.reshape(b, h, groups, per_head)[..., -keep:].reshape(b, h, groups * keep)
    positions = None if ctx.positions is None else ctx.positions[-keep:]
    return replace(ctx, queries=queries, query_weight=weight, positions=positions)


def snap_scores(region: Region, ctx: FitContext, window: int = WINDOW, kernel: int = KERNEL) -> torch.Tensor:
    """``[b, h, n]`` SnapKV's pooled votes of the observation window (dead entries ``-inf``)."""
    votes = attention_mass(region, window_context(ctx, window)).masked_fill(~region.live, 0.0)
    b, h, n = votes.shape
    pooled = F.max_pool1d(votes.reshape(b * h, 1, n), kernel, stride=1, padding=kernel // 2).reshape(b, h, n)
    return pooled.masked_fill(~region.live, float("-inf"))


@register("snapkv", settings=SnapKVSettings, needs_queries=True, own_positions=True)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Keep the entries of ``region`` with the highest pooled observation-window votes that fit in ``budget`` bytes
    per batch row, as they are."""
    if region.entries == 0:
        return []
    own = ctx.config.settings
    return kept_blocks(region, budget, snap_scores(region, ctx, own.window, own.kernel), ctx.config.entry_format)
