"""``generic``: per-block channel statistics, the model-free baseline every other predictor builds on.

The encoder sends each block's per (row, k/v, head, channel) mean and spread as a few bytes of bf16 side
data; both sides predict every element of a channel with them. It needs nothing but the block itself, and no
stream depends on another, so a cache decodes a layer's blocks in one codec call. `framed`, `self` and the
calibrated predictors without a calibration reuse `block_stats` and `BlockStatsSession`.
"""

from __future__ import annotations

import torch

from .base import BlockInputs, PlainSession, Predictor, PredictorSession, register

BLOCK_MEAN, BLOCK_STD = "block_mean", "block_std"


class BlockStatsSession(PlainSession):
    """Mean and std per (row, head, channel) of the block itself, sent as bf16 side data."""

    independent = True

    def __init__(self, inputs: BlockInputs):
        self.inputs = inputs
        self.mean = inputs.extras[BLOCK_MEAN].to(torch.float32)  # [batch, 2, heads, dim]
        self.std = inputs.extras[BLOCK_STD].to(torch.float32)
        self.tokens = inputs.positions.shape[0]

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = 0 if kind == "k" else 1
        mean = self.mean[:, index, head].unsqueeze(1).expand(-1, self.tokens, -1)
        std = self.std[:, index, head].unsqueeze(1).expand(-1, self.tokens, -1)
        return mean, std

    def predict_all(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        mean, std = stream_stats(self.mean, self.std, 1, heads)
        return mean[0], std[0]


def stream_stats(mean: torch.Tensor, std: torch.Tensor, blocks: int,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block statistics ``[blocks * batch, 2, heads, dim]`` (float32) as per-stream statistics ``[blocks,
    2 * heads, batch, 1, dim]`` in `stream_order`: one value per channel, broadcast over tokens."""

    def streams(t: torch.Tensor) -> torch.Tensor:
        rows, dim = t.shape[0] // blocks, t.shape[3]
        return t.view(blocks, rows, 2, heads, dim).permute(0, 2, 3, 1, 4).reshape(blocks, 2 * heads, rows, 1, dim)

    return streams(mean), streams(std)


def block_stats(keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Side data of `BlockStatsSession`: per (row, k/v, head, channel) mean and std, rounded to bf16."""
    both = torch.stack([keys, values], dim=1).to(torch.float32)  # [batch, 2, heads, tokens, dim]
    finite = torch.where(torch.isfinite(both), both, torch.zeros_like(both))
    mean = finite.mean(dim=3)
    std = finite.std(dim=3, correction=0) if both.shape[3] > 1 else torch.ones_like(mean)
    return {BLOCK_MEAN: mean.to(torch.bfloat16), BLOCK_STD: std.clamp_min(1e-6).to(torch.bfloat16)}


@register
class GenericPredictor(Predictor):
    """Per-block channel statistics sent as side data: needs nothing, and every stream of a block is
    independent, so a cache decodes a layer's blocks in one codec call. The in-generation default: the
    calibrated predictors read earlier streams (and `context` the layers below) stream by stream, which
    costs 3.3x (`none`) and 3-5x (`context`) its step time (docs/lossless.md, "Inside generate()")."""

    name = "generic"

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return block_stats(keys, values)

    def session(self, inputs: BlockInputs) -> PredictorSession:
        return BlockStatsSession(inputs)

    def below_depth(self) -> int:
        return 0

    def predict_blocks(self, side: dict[str, torch.Tensor], blocks: int,
                       heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        return stream_stats(side[BLOCK_MEAN].to(torch.float32), side[BLOCK_STD].to(torch.float32), blocks, heads)
