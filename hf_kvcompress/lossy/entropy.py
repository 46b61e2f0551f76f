"""Per-entry scores from reference queries: attention mass (Top-K, summary selection) and attention entropy
(the seed's stage 1).

Both normalise each query's attention over everything the layer holds (sinks, region, recent window), so an entry's
score is the share of real attention it gets, not its share within the region. Dead entries (padding) score
``-inf`` (mass) / ``+inf`` (entropy) so they are never kept.
"""

from __future__ import annotations

import torch

from ..kernels import attention_scores
from ..kernels.dispatch import use_triton
from .region import FitContext, Region


def _scores(region: Region, ctx: FitContext) -> tuple[torch.Tensor, torch.Tensor]:
    # one fused pass (Triton on GPU, chunked torch otherwise) never holds the [m, n] weight matrix
    return attention_scores(ctx.queries, ctx.query_weight, region.keys, region.bias, ctx.context_keys,
                            ctx.context_bias, ctx.scaling)


def attention_mass(region: Region, ctx: FitContext) -> torch.Tensor:
    """``[b, h, n]``: mean attention weight each entry receives over the valid reference queries.

    Without Triton, the mass alone comes from one materialised kernel and one mat-vec (`matching.Kernel.mass`):
    the torch reference of the fused pass computes the logits twice and the entropy too, which cost 26-32 s of a
    2,048-token prefill on CPU (issue 12)."""
    if use_triton(ctx.queries, region.keys):
        mass = _scores(region, ctx)[0]
    else:
        from .matching import Kernel

        mass = Kernel(region, ctx).mass()
    return mass.masked_fill(~region.live, float("-inf"))


def entry_entropy(region: Region, ctx: FitContext) -> torch.Tensor:
    """``[b, h, n]``: entropy (nats) of each entry's attention over the reference queries, i.e. of the column
    ``a[:, j] / sum_q a[q, j]``. High = attended diffusely by many queries (the seed's "low information").

    Measured on SmolLM2 this is a poor importance signal: the attention sinks and the most attended entries have
    some of the *highest* column entropies (every query attends to them a little), see docs/lossy.md.
    """
    return _scores(region, ctx)[1].masked_fill(~region.live, float("inf"))


def top_entries(score: torch.Tensor, count: int) -> torch.Tensor:
    """``[b, h, count]`` indices of the highest scores per row and head, in ascending position order."""
    count = min(count, score.shape[-1])
    return score.topk(count, dim=-1).indices.sort(dim=-1).values
