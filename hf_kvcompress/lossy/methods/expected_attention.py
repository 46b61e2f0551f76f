"""Expected Attention (Devoto et al. 2025, https://arxiv.org/abs/2510.00636): score each entry by the attention the
*future* queries are expected to give it, times the norm of its value.

The queries of the next positions are modelled as Gaussian: the mean ``mu`` and covariance ``S`` of the pre-RoPE
queries (the reference queries, rotated back from their own positions), carried to the next ``query_horizon``
positions by the average RoPE rotation ``R`` over them. For a query ``q ~ N(R mu, R S R^T)`` and key ``k``,
``E[exp(s q.k)] = exp(s mu.(R^T k) + s^2 / 2 (R^T k)^T S (R^T k))`` (``s`` the attention scale); normalised over
everything the layer holds (sinks, region, recent window) it is the expected attention weight, averaged over the
query heads of the KV head's group, and multiplied by ``||v||`` (an entry's effect on the output scales with its
value). Under chunked prefill the statistics come from the queries of each chunk (with those kept since the last
summary), not the whole prompt: the library keeps no running moments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...layer.storage import Block
from ..budget import kept_blocks
from ..queries import apply_rope, rotate
from ..region import FitContext, Region
from ..registry import MethodSettings, register


def mean_rotation(inv_freq: torch.Tensor, now: int, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[f]`` of the RoPE rotation averaged over positions ``now .. now + horizon - 1``."""
    positions = torch.arange(now, now + max(horizon, 1), dtype=torch.float64)
    angle = positions[:, None] * inv_freq.to(torch.float64)[None, :]
    return angle.cos().mean(0), angle.sin().mean(0)


def query_moments(ctx: FitContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean [b, h, g, d], covariance [b, h, g, d, d])`` of the pre-RoPE reference queries of each query head (the
    ``g`` heads of each KV head's group), weighted by the query weights."""
    b, h, total, d = ctx.queries.shape
    per_head = ctx.positions.shape[-1]
    groups = total // per_head
    queries = ctx.queries
    if ctx.inv_freq is not None:
        shift = -ctx.positions.repeat(groups).to(torch.float64)
        queries = rotate(queries, shift, ctx.inv_freq)
    queries = queries.reshape(b, h, groups, per_head, d)
    weight = ctx.query_weight.reshape(b, h, groups, per_head, 1)
    count = weight.sum(-2, keepdim=True).clamp_min(1.0)
    mean = (queries * weight).sum(-2, keepdim=True) / count
    centred = (queries - mean) * weight.sqrt()
    return mean[..., 0, :], centred.transpose(-1, -2) @ centred / count


def expected_logits(keys: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, ctx: FitContext) -> torch.Tensor:
    """``[b, h, g, n]``: ``log E[exp(s q.k)]`` for each key of ``keys`` (``[b, h, n, d]``) and query head."""
    keys = keys.float()
    if ctx.inv_freq is not None:
        cos, sin = mean_rotation(ctx.inv_freq, ctx.now, ctx.config.query_horizon)
        keys = apply_rope(keys, cos, -sin)  # R^T k: the average rotation's transpose
    s = ctx.scaling
    linear = s * (mean @ keys.transpose(-1, -2))  # [b, h, g, n]
    quadratic = ((keys[:, :, None] @ cov) * keys[:, :, None]).sum(-1)  # k^T S k: [b, h, g, n]
    return linear + 0.5 * s * s * quadratic


def expected_scores(region: Region, ctx: FitContext) -> torch.Tensor:
    """``[b, h, n]``: expected attention weight of each region entry (group mean) times its value norm."""
    mean, cov = query_moments(ctx)
    region_logits = expected_logits(region.keys, mean, cov, ctx) + region.bias[:, :, None, :]
    context_logits = expected_logits(ctx.context_keys, mean, cov, ctx) + ctx.context_bias[:, :, None, :]
    total = torch.logsumexp(torch.cat([region_logits, context_logits], dim=-1), dim=-1, keepdim=True)
    weight = (region_logits - total).exp().mean(dim=2)
    score = weight * region.values.float().norm(dim=-1)
    return score.masked_fill(~region.live, float("-inf"))


@dataclass(frozen=True)
class ExpectedAttentionSettings(MethodSettings):
    """Expected Attention's settings (Devoto et al. 2025, https://arxiv.org/abs/2510.00636): its horizon of
    future positions is the shared ``LossyConfig.query_horizon``; nothing of its own."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2510.00636"


@register("expected_attention", settings=ExpectedAttentionSettings, needs_queries=True, own_positions=True)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Keep the entries of ``region`` with the highest expected attention times value norm that fit in ``budget``
    bytes per batch row, as they are."""
    if region.entries == 0:
        return []
    return kept_blocks(region, budget, expected_scores(region, ctx), ctx.config.entry_format)
