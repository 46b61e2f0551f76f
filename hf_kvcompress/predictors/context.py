"""Model-free predictors: from what the cache itself holds.

``none``    per-channel statistics only (the "no predictor" baseline);
``context`` the layer below at the same positions, earlier heads of the same layer and (for values) the
            keys, through calibrated linear maps.
Without a calibration both fall back to per-block channel statistics that the encoder sends as a few
bytes of side data (the generic built-in model: it needs nothing but the block itself).
"""

from __future__ import annotations

import torch

from .base import BlockInputs, PlainSession, Predictor, PredictorSession
from .linear import FeatureRecipe, LinearSession
from .rope import RopeFrame

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
        # [batch, 2, heads, dim] -> [2 * heads, batch, 1, dim]: one value per channel, broadcast over tokens
        def streams(t: torch.Tensor) -> torch.Tensor:
            return t.permute(1, 2, 0, 3).reshape(2 * heads, t.shape[0], 1, t.shape[3])

        return streams(self.mean), streams(self.std)


def block_stats(keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Side data of `BlockStatsSession`: per (row, k/v, head, channel) mean and std, rounded to bf16."""
    both = torch.stack([keys, values], dim=1).to(torch.float32)  # [batch, 2, heads, tokens, dim]
    finite = torch.where(torch.isfinite(both), both, torch.zeros_like(both))
    mean = finite.mean(dim=3)
    std = finite.std(dim=3, correction=0) if both.shape[3] > 1 else torch.ones_like(mean)
    return {BLOCK_MEAN: mean.to(torch.bfloat16), BLOCK_STD: std.clamp_min(1e-6).to(torch.bfloat16)}


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


class CalibratedLinearPredictor(Predictor):
    """A `LinearSession` predictor whose heads come from a calibration (block statistics without one)."""

    recipe = FeatureRecipe()

    def __init__(self, calibration=None, frame: RopeFrame | None = None):
        self.calibration = calibration
        if frame is None:
            frame = RopeFrame(None) if calibration is None else calibration.rope_frame()
        self.frame = frame

    @property
    def heads_name(self) -> str:
        """The name this predictor's heads have in a calibration."""
        return self.name

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {} if self.calibrated else block_stats(keys, values)

    def below_depth(self) -> int:
        # a fitted session reads its recipe's layers below, and at least the layer below's surprise
        return max(1, self.layer_recipe(0).below) if self.calibrated else 0

    def session(self, inputs: BlockInputs) -> PredictorSession:
        if not self.calibrated:
            return BlockStatsSession(inputs)
        heads = self.calibration.stream_heads(self.heads_name, inputs.layer)
        return LinearSession(heads, self.layer_recipe(inputs.layer), self.frame, inputs, self.features(inputs))

    def layer_recipe(self, layer: int) -> FeatureRecipe:
        return self.recipe

    def features(self, inputs: BlockInputs) -> list[torch.Tensor]:
        """Extra feature tensors ``[batch, tokens, n]`` (float32) placed before the context features."""
        return []


class NoPredictor(CalibratedLinearPredictor):
    """Per-channel mean and spread: what a predictor has to beat."""

    name = "none"
    recipe = FeatureRecipe(below=0, inter_head=False)


class ContextPredictor(CalibratedLinearPredictor):
    """The layer below, earlier heads and the keys, through calibrated linear maps."""

    name = "context"
    recipe = FeatureRecipe(below=2, inter_head=True)
