"""Linear-Gaussian prediction: every stream's mean is a linear function of what is already known, its
spread a calibrated per-channel sigma scaled by how surprising the token has been so far.

For stream (layer l, kind, head h) the features are, in this order (so that every stream's features are
a prefix of the next one's and one Gram matrix per layer fits them all):

    [1, extras..., K_{l-1} (pre-RoPE, all heads), V_{l-1} (all heads), [K_{l-2}, V_{l-2}], K_l heads
     (pre-RoPE), V_l heads]

keys use the key heads before h; values use all key heads and the value heads before h. Keys are
predicted in the pre-RoPE frame and rotated back. The std of an element is
``sigma[channel] * surprise(token) ** alpha``, where surprise is the RMS of the standardised errors of
the streams seen so far for that token (this layer's, else the layer below's): `Surprise`, which the coder's
`LinearSession` and the calibration fit both run, so the fitted ``alpha`` and ``sigma`` see the spread the
coder will use.

`CalibratedLinearPredictor` is the base of every predictor whose heads a `Calibration` fits (``none``,
``context``, ``probe``, ``twin``): a subclass sets its `FeatureRecipe` and, if it reads more than the cache,
its extra features and where the fit gets them (`fit_extras`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import (
    MEAN_TOLERANCE,
    ROUNDING_TOLERANCE,
    STD_TOLERANCE,
    BlockInputs,
    ExtrasSource,
    LayerValues,
    Predictor,
    PredictorSession,
    PredictorSettings,
)
from .generic import BlockStatsSession, block_stats
from .rope import RopeFrame

#: bounds of a token's surprise (the std multiplier is surprise ** alpha): a guard against a few streams'
#: luck or a single outlier setting a token's spread. It binds on 0.35 % of the fit's token surprises on
#: SmolLM2, and (1/16, 16) codes within 0.0004 bit of it (docs/lossless.md, "Constants of the linear
#: predictors", experiments/linear_constants.py)
SURPRISE_RANGE = (0.25, 8.0)
F32_MAX = torch.finfo(torch.float32).max


# K/V may hold NaN and infinities (lossless codes any bits). A mean or spread that reads them would be NaN or
# infinite, which the codec refuses, so: a non-finite element is a 0 feature, a non-finite or float32-overflowing
# mean is the head's bias, and the surprise reads a NaN element as 0. Each replaces only what was NaN or infinite
# before, so every block that coded before codes the same bytes (and old files decode), and one such element costs
# only its own token's streams (tests/cache/test_extreme_values.py).


def finite_features(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every NaN or infinite element 0 (``x`` itself when all are finite)."""
    finite = torch.isfinite(x)
    return x if bool(finite.all()) else torch.where(finite, x, torch.zeros((), dtype=x.dtype))


def nan_as_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every NaN element 0 and infinities kept: what the surprise reads of an observed stream (an
    infinite error saturates it, as it always did)."""
    nan = x.isnan()
    return torch.where(nan, torch.zeros((), dtype=x.dtype), x) if bool(nan.any()) else x


def finite_means(means: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``means`` with every element that is NaN or beyond float32's range replaced by ``bias`` (broadcast)."""
    within = means.abs() <= F32_MAX
    return means if bool(within.all()) else torch.where(within, means, bias.to(means.dtype))


class Surprise:
    """The per-token surprise of one block at one layer: the RMS of the standardised errors of the streams
    added so far, else the layer below's surprise, else 1; clamped to `SURPRISE_RANGE`.

    One recursion for the coder (`LinearSession`: float32 in generation, float64 when portable) and the
    calibration fit (float64 residuals): each keeps its own dtypes (``dtype``: of the neutral surprise), the steps
    are the same."""

    def __init__(self, below: torch.Tensor | None, dtype: torch.dtype = torch.float32):
        self.below = below
        self.dtype = dtype
        self.z2_sum: torch.Tensor | None = None
        self.count = 0

    def current(self, shape: Sequence[int]) -> torch.Tensor:
        """Surprise before the next stream, ``shape`` (``[batch, tokens]``) when nothing is known yet."""
        if self.count:
            raw = (self.z2_sum / self.count).sqrt()
        elif self.below is not None:
            raw = self.below.to(self.dtype)
        else:
            return torch.ones(*shape, dtype=self.dtype)
        return raw.clamp(*SURPRISE_RANGE)

    def add(self, z: torch.Tensor) -> None:
        """A stream's standardised errors ``(value - mean) / sigma``, ``[..., tokens, head_dim]``."""
        self.add_squares(z.square().mean(dim=-1))

    def add_squares(self, z2: torch.Tensor) -> None:
        """A stream's mean squared standardised error per token (`add` of its errors, squared and averaged)."""
        self.z2_sum = z2 if self.z2_sum is None else self.z2_sum + z2
        self.count += 1


@dataclass(frozen=True)
class FeatureRecipe:
    """Which known quantities a linear predictor reads."""

    below: int = 1  # layers below whose K (pre-RoPE) and V are features
    inter_head: bool = True
    extras: tuple[str, ...] = ()
    #: two phases per block instead of one stream after another: keys read no own-layer heads, values read every
    #: key head of their layer (and no other value head), and all streams of a kind share the surprise known before
    #: the kind starts. A kind's streams then depend on nothing of each other: a coder predicts them in one matrix
    #: product and codes them in one codec call (`PredictorSession.kind_independent`)
    phased: bool = False

    def own_features(self, kind: str, head: int, heads: int) -> int:
        """How many own-layer head blocks stream (kind, head) reads (of ``heads`` per kind), in the order
        ``[own keys..., own values...]``: a prefix of them."""
        if not self.inter_head:
            return 0
        if self.phased:
            return 0 if kind == "k" else heads
        return head if kind == "k" else heads + head


@dataclass
class StreamHead:
    """Fitted parameters of one stream: ``weight`` ``[features, head_dim]`` (row 0 is the bias),
    ``sigma`` ``[head_dim]`` (pre-RoPE frame for keys) and the surprise exponent ``alpha``."""

    weight: torch.Tensor
    sigma: torch.Tensor
    alpha: float


class FeatureBuilder:
    """Assembles the features of each stream of one block (shared by calibration and coding), in the frame's
    dtype (float32 for the fit and in generation, float64 for portable sessions)."""

    def __init__(self, recipe: FeatureRecipe, frame: RopeFrame, inputs: BlockInputs, extras: list[torch.Tensor]):
        self.recipe = recipe
        self.frame = frame
        self.dtype = frame.dtype
        self.positions = inputs.positions
        self.inputs, self.extras = inputs, extras
        parts = [e.to(self.dtype) for e in extras]
        if inputs.below is not None:
            for layer in inputs.below.chain(recipe.below):
                parts.append(flat_heads(finite_features(frame.unrotate(layer.keys, self.positions)), self.dtype))
                parts.append(flat_heads(finite_features(layer.values.to(self.dtype)), self.dtype))
        self.base = parts
        # one tensor for the shared part: each stream multiplies it once, without re-concatenating
        self.base_matrix = torch.cat(parts, dim=-1) if parts else None
        self._base_bound: torch.Tensor | None = None
        self.own_keys: list[torch.Tensor] = []  # pre-RoPE, [batch, tokens, head_dim] each
        self.own_values: list[torch.Tensor] = []
        self.own_bounds: list[torch.Tensor] = []  # `bound` of each own stream, in the order observed

    def observe(self, kind: str, values: torch.Tensor) -> torch.Tensor:
        """Record a stream's true values as features; returns them in the prediction frame (pre-RoPE for keys) for
        the surprise: NaN as 0, infinities kept (an infinite error saturates the surprise, as it always did)."""
        framed = self.frame.unrotate(values, self.positions) if kind == "k" else values.to(self.dtype)
        features = finite_features(framed)
        (self.own_keys if kind == "k" else self.own_values).append(features)
        if self.dtype == torch.float64:  # only portable sessions ask for `magnitude`
            self.own_bounds.append(self.bound(kind, values))
        return framed if features is framed else nan_as_zero(framed)

    def observe_heads(self, kind: str, values: torch.Tensor) -> torch.Tensor:
        """`observe` of every head of ``kind`` at once (``values`` ``[batch, heads, tokens, head_dim]``, each head's
        prediction frame computed in one pass); returns them framed, the same shape."""
        framed = self.frame.unrotate(values, self.positions) if kind == "k" else values.to(self.dtype)
        features = finite_features(framed)
        # each head its own tensor, as `observe` records it: the matrix products that read it see the same layout
        (self.own_keys if kind == "k" else self.own_values).extend(features[:, h].clone()
                                                                   for h in range(values.shape[1]))
        if self.dtype == torch.float64:
            self.own_bounds.extend(self.bound(kind, values[:, h]) for h in range(values.shape[1]))
        return framed if features is framed else nan_as_zero(framed)

    def bound(self, kind: str, values: torch.Tensor) -> torch.Tensor:
        """float32 bounds on the magnitude of the feature values of ``values`` and of what rounding touched: for
        keys, the un-rotated pair's magnitudes (the un-rotation's error is relative to them)."""
        size = finite_features(values.to(torch.float32)).abs()
        return self.frame.rotate_bound(size) if kind == "k" else size

    def own(self, kind: str, head: int) -> list[torch.Tensor]:
        """The stream's own-layer features, in order (empty without inter-head prediction)."""
        count = self.recipe.own_features(kind, head, len(self.own_keys) if kind == "v" else head)
        return (self.own_keys + self.own_values)[:count]

    def features(self, kind: str, head: int, batch: int, tokens: int) -> torch.Tensor:
        """``[batch, tokens, n]``: the constant 1, the shared features, the own-layer features."""
        return torch.cat([torch.ones(batch, tokens, 1, dtype=self.dtype), *self.base, *self.own(kind, head)], dim=-1)

    def apply(self, kind: str, head: int, weight: torch.Tensor, batch: int) -> torch.Tensor:
        """``features(kind, head) @ weight`` (``[batch, tokens, dim]``), computed piecewise: the same sum
        without concatenating the features."""
        pieces = ([self.base_matrix] if self.base_matrix is not None else []) + self.own(kind, head)
        return linear_pieces(kind, head, weight, pieces, batch, self.positions.shape[0])

    def magnitude(self, kind: str, head: int, weight: torch.Tensor) -> torch.Tensor:
        """A bound on the sum of the absolute products of `apply` without the bias (``[batch, tokens, dim]``,
        float64): ``bound(features) @ |weight|`` in float32, rounded up; it bounds the product's rounding error."""
        if self._base_bound is None:
            parts = [e.abs().to(torch.float32) for e in self.extras]
            if self.inputs.below is not None:
                for layer in self.inputs.below.chain(self.recipe.below):
                    parts.append(flat_heads(self.bound("k", layer.keys)))
                    parts.append(flat_heads(self.bound("v", layer.values)))
            self._base_bound = (torch.cat(parts, dim=-1) if parts
                                else torch.zeros(self.inputs.batch, self.positions.shape[0], 0))
        own = self.own_bounds[: self.recipe.own_features(kind, head, len(self.own_keys) if kind == "v" else head)]
        size = weight[1:].abs().to(torch.float32)
        out, row = self._base_bound @ size[: self._base_bound.shape[-1]], self._base_bound.shape[-1]
        for part in own:  # piecewise, as `apply`: no concatenation per stream
            out = out + part @ size[row : row + part.shape[-1]]
            row += part.shape[-1]
        return out.to(torch.float64) * (1 + 2.0**-10)  # float32 sums of non-negative terms: rounding covered


def linear_pieces(kind: str, head: int, weight: torch.Tensor, pieces: list[torch.Tensor], batch: int,
                  tokens: int) -> torch.Tensor:
    """``cat([1, *pieces], -1) @ weight`` (``[batch, tokens, dim]``) of stream (kind, head), summed piece by piece in
    this order (every coder of a stream runs these operations, so that its means are the same bits)."""
    width = 1 + sum(p.shape[-1] for p in pieces)
    if width != weight.shape[0]:
        raise ValueError(
            f"calibrated {kind}{head} head expects {weight.shape[0]} features, this predictor builds {width}: "
            "the calibration was fitted with other predictor features; recalibrate (hf-kvcompress calibrate)"
        )
    out = weight[0].expand(batch, tokens, -1)
    row = 1
    for part in pieces:
        out = out + part @ weight[row : row + part.shape[-1]]
        row += part.shape[-1]
    return finite_means(out, weight[0])


class LinearSession(PredictorSession):
    """Codes one block with fitted `StreamHead`s (see module docstring): in float32 inside generation, in float64
    when ``portable`` (another CPU reproduces the statistics within `bounds`, and `codec.params.settle` makes
    them exact: saved files and chunk payloads)."""

    def __init__(
        self,
        heads: dict[tuple[str, int], StreamHead],
        recipe: FeatureRecipe,
        frame: RopeFrame,
        inputs: BlockInputs,
        extras: list[torch.Tensor],
        portable: bool = False,
    ):
        self.heads = heads
        self.portable = portable
        self.dtype = torch.float64 if portable else torch.float32
        self.frame = frame.in_float64() if portable else frame
        self.builder = FeatureBuilder(recipe, self.frame, inputs, extras)
        self.inputs = inputs
        self.tracker = Surprise(inputs.below.surprise if inputs.below is not None else None, self.dtype)
        self.pending: tuple[str, int, torch.Tensor] | None = None
        self._weights: dict[tuple[str, int], torch.Tensor] = {}
        self._last: tuple | None = None

    def _weight(self, kind: str, head: int) -> torch.Tensor:
        if (kind, head) not in self._weights:
            self._weights[(kind, head)] = self.heads[(kind, head)].weight.to(self.dtype)
        return self._weights[(kind, head)]

    def surprise(self, batch: int, tokens: int) -> torch.Tensor:
        return self.tracker.current((batch, tokens))

    def framed_prediction(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean in the prediction frame (pre-RoPE for keys) and the token surprise before this stream."""
        batch, tokens = self.inputs.batch, self.inputs.positions.shape[0]
        mean = self.builder.apply(kind, head, self._weight(kind, head), batch)
        self.pending = (kind, head, mean)
        return mean, self.surprise(batch, tokens)

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        params = self.heads[(kind, head)]
        mean, surprise = self.framed_prediction(kind, head)
        scale = surprise.pow(params.alpha).unsqueeze(-1)
        variance = params.sigma.to(self.dtype).square().expand(mean.shape[1], -1)
        if kind == "k":  # a pair of means near float32's limit may rotate past it
            mean = self.frame.rotate(mean, self.inputs.positions).clamp(-F32_MAX, F32_MAX)
            variance = self.frame.rotate_variance(variance, self.inputs.positions)
        std = variance.sqrt() * scale
        if not self.portable:
            return mean, std
        # what `bounds` needs (the encoder only): own-layer features, framed mean, std, whether the surprise is exact
        neutral = self.tracker.count == 0 and self.tracker.below is None
        self._last = (kind, head, self.pending[2], std, neutral)
        return mean, std

    def bounds(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[:2] != (kind, head):
            raise RuntimeError(f"bounds({kind!r}, {head}) without a matching predict()")
        _, _, framed, std, neutral = self._last
        weight = self._weight(kind, head)
        products = self.builder.magnitude(kind, head, weight).expand_as(framed)
        # no products (a bias alone, or all-zero features): the mean is the bias, exactly
        # MEAN_TOLERANCE covers sums of up to 2^11 terms; longer ones scale it (n 2^-53 grows with n)
        tolerance = MEAN_TOLERANCE * max(1.0, weight.shape[0] / 2048)
        mean_tol = torch.where(products > 0, tolerance * (weight[0].abs() + products), 0.0)
        if kind == "k":
            mean_tol = self.frame.rotate_tolerance(mean_tol, framed.abs() + mean_tol, self.inputs.positions,
                                                   ROUNDING_TOLERANCE)
        return mean_tol, std * (ROUNDING_TOLERANCE if neutral else STD_TOLERANCE)

    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        if self.pending is None or self.pending[:2] != (kind, head):
            raise RuntimeError(f"observe({kind!r}, {head}) without a matching predict()")
        framed = self.builder.observe(kind, values)
        self.tracker.add((framed - self.pending[2]) / self.heads[(kind, head)].sigma.to(self.dtype))
        self.pending = None

    def finish(self, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        return LayerValues.on_top_of(keys, values, self.surprise(keys.shape[0], keys.shape[2]), self.inputs.below)


class CalibratedLinearPredictor(Predictor):
    """A `LinearSession` predictor whose heads come from a calibration (block statistics without one).

    A subclass sets `name` and `recipe` and, when it reads more than the cache holds, overrides `features`
    (its extra feature tensors, from `BlockInputs.extras`), `model_extras` (how a decoder computes those
    extras) and `fit_hidden_layers` / `fit_extras` (how the calibration fit gets them); `fit_instances`
    when one name fits several head sets (``probe`` at several layers)."""

    recipe: ClassVar[FeatureRecipe] = FeatureRecipe()
    fitted_by_calibration = True

    def __init__(self, calibration=None, frame: RopeFrame | None = None, *, portable: bool = False):
        super().__init__(portable=portable)
        self.calibration = calibration
        if frame is None:
            frame = RopeFrame(None) if calibration is None else calibration.rope_frame()
        self.frame = frame

    @classmethod
    def build(cls, *, calibration=None, model: torch.nn.Module | None = None, settings: PredictorSettings,
              portable: bool = False) -> CalibratedLinearPredictor:
        return cls(calibration, portable=portable)

    @classmethod
    def fit_instances(cls, frame: RopeFrame, model: torch.nn.Module,
                      probe_layers: Sequence[int]) -> list[CalibratedLinearPredictor]:
        """Uncalibrated instances whose heads `Calibration.fit` fits (one head set each, `heads_name`);
        ``probe_layers`` are the fit's probe layers that the model has."""
        return [cls(None, frame)]

    @property
    def heads_name(self) -> str:
        """The name this predictor's heads have in a calibration."""
        return self.name

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    @property
    def first_fitted_layer(self) -> int:
        """Layers below this one have no heads (the decoder recomputes them: ``probe``)."""
        return 0

    def require_calibration(self) -> None:
        """Raise unless this predictor has a calibration (predictors that cannot fall back to block statistics)."""
        if self.calibration is None:
            raise ValueError(
                f"the {self.heads_name} predictor needs a calibration that fitted it "
                "(hf-kvcompress calibrate, then Calibration.load)"
            )

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.calibrated:
            return block_stats(keys, values)  # per kind where keys and values differ in width
        if keys.shape[-1] != values.shape[-1]:  # fitted heads have one width (`Calibration.fit` refuses others)
            raise ValueError(
                f"layer {layer}: keys {keys.shape[-1]} and values {values.shape[-1]} wide, but the calibrated "
                f"'{self.name}' predictor's heads have one width; use predictor='generic' (or no calibration)"
            )
        return {}

    def below_depth(self) -> int:
        # a fitted session reads its recipe's layers below, and at least the layer below's surprise
        return max(1, self.layer_recipe(0).below) if self.calibrated else 0

    def session(self, inputs: BlockInputs) -> PredictorSession:
        if not self.calibrated:
            return BlockStatsSession(inputs)
        heads = self.calibration.stream_heads(self.heads_name, inputs.layer)
        return LinearSession(heads, self.layer_recipe(inputs.layer), self.frame, inputs, self.features(inputs),
                             self.portable)

    def layer_recipe(self, layer: int) -> FeatureRecipe:
        return self.recipe

    def features(self, inputs: BlockInputs) -> list[torch.Tensor]:
        """Extra feature tensors ``[batch, tokens, n]`` (float32) placed before the context features."""
        return []

    def fit_hidden_layers(self) -> tuple[int, ...]:
        """Layers whose entering hidden state the fit's forward pass must capture for `fit_extras`."""
        return ()

    def fit_extras(self, token_ids: torch.Tensor, hidden: Mapping[int, torch.Tensor]) -> ExtrasSource | None:
        """The extras of one calibration chunk ``token_ids`` ``[1, tokens]``, given the hidden states the fit's
        forward pass captured (`fit_hidden_layers`); None when the predictor reads none."""
        return None


def flat_heads(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[batch, heads, tokens, dim]`` -> ``[batch, tokens, heads * dim]`` in ``dtype``."""
    batch, heads, tokens, dim = x.shape
    return x.to(dtype).permute(0, 2, 1, 3).reshape(batch, tokens, heads * dim)
