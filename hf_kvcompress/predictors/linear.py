"""Linear-Gaussian prediction: every stream's mean is a linear function of what is already known, its
spread a calibrated per-channel sigma scaled by how surprising the token has been so far.

For stream (layer l, kind, head h) the features are, in this order (so that every stream's features are
a prefix of the next one's and one Gram matrix per layer fits them all):

    [1, extras..., K_{l-1} (pre-RoPE, all heads), V_{l-1} (all heads), [K_{l-2}, V_{l-2}], K_l heads
     (pre-RoPE), V_l heads]

keys use the key heads before h; values use all key heads and the value heads before h. Keys are
predicted in the pre-RoPE frame and rotated back. The std of an element is
``sigma[channel] * surprise(token) ** alpha``, where surprise is the RMS of the standardised errors of
the streams seen so far for that token (this layer's, else the layer below's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BlockInputs, LayerValues, PredictorSession
from .rope import RopeFrame

SURPRISE_RANGE = (0.25, 8.0)


@dataclass(frozen=True)
class FeatureRecipe:
    """Which known quantities a linear predictor reads."""

    below: int = 1  # layers below whose K (pre-RoPE) and V are features
    inter_head: bool = True
    extras: tuple[str, ...] = ()


@dataclass
class StreamHead:
    """Fitted parameters of one stream: ``weight`` ``[features, head_dim]`` (row 0 is the bias),
    ``sigma`` ``[head_dim]`` (pre-RoPE frame for keys) and the surprise exponent ``alpha``."""

    weight: torch.Tensor
    sigma: torch.Tensor
    alpha: float


class FeatureBuilder:
    """Assembles the features of each stream of one block (shared by calibration and coding)."""

    def __init__(self, recipe: FeatureRecipe, frame: RopeFrame, inputs: BlockInputs, extras: list[torch.Tensor]):
        self.recipe = recipe
        self.frame = frame
        self.positions = inputs.positions
        parts = list(extras)
        if inputs.below is not None:
            for layer in inputs.below.chain(recipe.below):
                parts.append(_flat_heads(frame.unrotate(layer.keys, self.positions)))
                parts.append(_flat_heads(layer.values.to(torch.float32)))
        self.base = parts
        # one tensor for the shared part: each stream multiplies it once, without re-concatenating
        self.base_matrix = torch.cat(parts, dim=-1) if parts else None
        self.own_keys: list[torch.Tensor] = []  # pre-RoPE, [batch, tokens, head_dim] each
        self.own_values: list[torch.Tensor] = []

    def observe(self, kind: str, values: torch.Tensor) -> torch.Tensor:
        """Record a stream's true values; returns them in the prediction frame (pre-RoPE for keys)."""
        framed = self.frame.unrotate(values, self.positions) if kind == "k" else values.to(torch.float32)
        (self.own_keys if kind == "k" else self.own_values).append(framed)
        return framed

    def own(self, kind: str, head: int) -> list[torch.Tensor]:
        """The stream's own-layer features, in order (empty without inter-head prediction)."""
        if not self.recipe.inter_head:
            return []
        return self.own_keys[:head] if kind == "k" else self.own_keys + self.own_values[:head]

    def features(self, kind: str, head: int, batch: int, tokens: int) -> torch.Tensor:
        """``[batch, tokens, n]``: the constant 1, the shared features, the own-layer features."""
        return torch.cat([torch.ones(batch, tokens, 1), *self.base, *self.own(kind, head)], dim=-1)

    def apply(self, kind: str, head: int, weight: torch.Tensor, batch: int) -> torch.Tensor:
        """``features(kind, head) @ weight`` (``[batch, tokens, dim]``), computed piecewise: the same sum
        without concatenating the features."""
        own = self.own(kind, head)
        width = 1 + (self.base_matrix.shape[-1] if self.base_matrix is not None else 0) + sum(p.shape[-1] for p in own)
        if width != weight.shape[0]:
            raise ValueError(
                f"calibrated {kind}{head} head expects {weight.shape[0]} features, this predictor builds {width}: "
                "the calibration was fitted with other predictor features; recalibrate (hf-kvcompress calibrate)"
            )
        out = weight[0].expand(batch, self.positions.shape[0], -1)
        row = 1
        if self.base_matrix is not None:
            out = out + self.base_matrix @ weight[row : row + self.base_matrix.shape[-1]]
            row += self.base_matrix.shape[-1]
        for part in own:
            out = out + part @ weight[row : row + part.shape[-1]]
            row += part.shape[-1]
        return out


class LinearSession(PredictorSession):
    """Codes one block with fitted `StreamHead`s (see module docstring)."""

    def __init__(
        self,
        heads: dict[tuple[str, int], StreamHead],
        recipe: FeatureRecipe,
        frame: RopeFrame,
        inputs: BlockInputs,
        extras: list[torch.Tensor],
    ):
        self.heads = heads
        self.builder = FeatureBuilder(recipe, frame, inputs, extras)
        self.inputs = inputs
        self.frame = frame
        self.below_surprise = inputs.below.surprise if inputs.below is not None else None
        self.z2_sum: torch.Tensor | None = None
        self.z2_count = 0
        self.pending: tuple[str, int, torch.Tensor] | None = None

    def surprise(self, batch: int, tokens: int) -> torch.Tensor:
        if self.z2_count:
            raw = (self.z2_sum / self.z2_count).sqrt()
        elif self.below_surprise is not None:
            raw = self.below_surprise
        else:
            return torch.ones(batch, tokens)
        return raw.clamp(*SURPRISE_RANGE)

    def framed_prediction(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean in the prediction frame (pre-RoPE for keys) and the token surprise before this stream."""
        batch, tokens = self.inputs.batch, self.inputs.positions.shape[0]
        mean = self.builder.apply(kind, head, self.heads[(kind, head)].weight, batch)
        self.pending = (kind, head, mean)
        return mean, self.surprise(batch, tokens)

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        params = self.heads[(kind, head)]
        mean, surprise = self.framed_prediction(kind, head)
        scale = surprise.pow(params.alpha).unsqueeze(-1)
        variance = params.sigma.square().expand(mean.shape[1], -1)
        if kind == "k":
            mean = self.frame.rotate(mean, self.inputs.positions)
            variance = self.frame.rotate_variance(variance, self.inputs.positions)
        return mean, variance.sqrt() * scale

    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        if self.pending is None or self.pending[:2] != (kind, head):
            raise RuntimeError(f"observe({kind!r}, {head}) without a matching predict()")
        framed = self.builder.observe(kind, values)
        z = (framed - self.pending[2]) / self.heads[(kind, head)].sigma
        z2 = z.square().mean(dim=-1)
        self.z2_sum = z2 if self.z2_sum is None else self.z2_sum + z2
        self.z2_count += 1
        self.pending = None

    def finish(self, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        return LayerValues.on_top_of(keys, values, self.surprise(keys.shape[0], keys.shape[2]), self.inputs.below)


def _flat_heads(x: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, tokens, dim]`` -> ``[batch, tokens, heads * dim]`` float32."""
    batch, heads, tokens, dim = x.shape
    return x.to(torch.float32).permute(0, 2, 1, 3).reshape(batch, tokens, heads * dim)
