"""Per-entry scores from reference queries: attention mass (Top-K) and the top entries of any score.

The mass normalises each query's attention over everything the layer holds (sinks, region, recent window), so an
entry's score is the share of real attention it gets, not its share within the region. Dead entries (padding)
score ``-inf`` so they are never kept. The summary scores entries from the `matching.Kernel` it already holds for
its fit (`Kernel.mass`, and `Kernel.entropy` for ``selection="entropy"``).
"""

from __future__ import annotations

import torch

from ..kernels import attention_scores
from ..kernels.dispatch import use_triton
from .matching import Kernel
from .region import FitContext, Region


def attention_mass(region: Region, ctx: FitContext) -> torch.Tensor:
    """``[b, h, n]``: mean attention weight each entry receives over the valid reference queries.

    On a GPU one fused pass (`hf_kvcompress.kernels.attention_scores`, Triton) never holds the ``[m, n]`` weights.
    Without Triton the mass comes from one materialised kernel and one mat-vec (`matching.Kernel.mass`): the torch
    reference of the fused pass computes the logits twice and the entropy too, which cost 26-32 s of a 2,048-token
    prefill on CPU (docs/lossy.md, *Speed and queries*)."""
    if use_triton(ctx.queries, region.keys):
        mass = attention_scores(ctx.queries, ctx.query_weight, region.keys, region.bias, ctx.context_keys,
                                ctx.context_bias, ctx.scaling)[0]
    else:
        mass = Kernel(region, ctx).mass()
    return mass.masked_fill(~region.live, float("-inf"))


def top_entries(score: torch.Tensor, count: int) -> torch.Tensor:
    """``[b, h, count]`` indices of the highest scores per row and head, in ascending position order."""
    count = min(count, score.shape[-1])
    return score.topk(count, dim=-1).indices.sort(dim=-1).values
