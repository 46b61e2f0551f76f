"""``below``: the layer below through calibrated linear maps, in two batched phases per block.

Keys are a full-rank ridge map of the layer below's pre-RoPE keys and values; values a map of the layer below and
this layer's decoded pre-RoPE keys (`FeatureRecipe.phased`). The spread is the fit's per-channel residual sigma
(rotated into the cached frame for keys) times the token's surprise, one per kind. No stream reads another of
its kind, so a block's key heads are one matrix product and one codec call, then its value heads likewise
(`PredictorSession.kind_independent`), where ``context`` predicts and codes stream after stream. The point of the
rate / cost frontier that measured 8.68 bits/scalar on SmolLM2 at 2,048 tokens against ``generic``'s 10.46
(docs/results/lossless.md, "Predictor rate / cost frontier (issue 10)"). Model-free: it reads only what the
cache holds; without a calibration, `generic`'s block statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BlockInputs, PredictorSession, register
from .linear import F32_MAX, CalibratedLinearPredictor, FeatureRecipe, LinearSession, StreamHead
from .rope import RopeFrame


@dataclass
class PhasedHeads:
    """One layer's heads stacked per kind: ``weight[kind]`` ``[features, heads * head_dim]`` (as the calibration
    stores them: float16 where they fit), ``sigma[kind]`` ``[heads, head_dim]`` float32, ``alpha[kind]`` per head."""

    weight: dict[str, torch.Tensor]
    sigma: dict[str, torch.Tensor]
    alpha: dict[str, list[float]]

    @classmethod
    def of(cls, heads: dict[tuple[str, int], StreamHead], stored: dict[tuple[str, int], torch.Tensor]) -> PhasedHeads:
        count = len(heads) // 2
        return cls({kind: torch.cat([stored[(kind, h)] for h in range(count)], dim=1) for kind in "kv"},
                   {kind: torch.stack([heads[(kind, h)].sigma for h in range(count)]) for kind in "kv"},
                   {kind: [heads[(kind, h)].alpha for h in range(count)] for kind in "kv"})

    @property
    def count(self) -> int:
        return self.sigma["k"].shape[0]

    def stream_heads(self) -> dict[tuple[str, int], StreamHead]:
        """Per-stream views (what `LinearSession`'s bounds read)."""
        dim = self.sigma["k"].shape[1]
        return {(kind, h): StreamHead(self.weight[kind][:, h * dim : (h + 1) * dim], self.sigma[kind][h],
                                      self.alpha[kind][h]) for kind in "kv" for h in range(self.count)}

    def tensors(self) -> list[torch.Tensor]:
        return [*self.weight.values(), *self.sigma.values()]


class PhasedSession(LinearSession):
    """A `LinearSession` of a phased recipe: the first `predict` of a kind computes every head of it in one matrix
    product (``[batch, tokens, features] @ [features, heads * head_dim]``) under the surprise known then; values
    may start only once every key head was observed."""

    kind_independent = True

    def __init__(self, layer_heads: PhasedHeads, recipe: FeatureRecipe, frame: RopeFrame, inputs: BlockInputs,
                 portable: bool = False):
        super().__init__(layer_heads.stream_heads(), recipe, frame, inputs, [], portable)
        self.layer_heads = layer_heads
        self.dim = layer_heads.sigma["k"].shape[1]
        self._phase: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _start(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Framed means ``[batch, tokens, heads * dim]``, means in the cached frame ``[batch, heads, tokens, dim]``,
        stds before the surprise ``[heads, tokens, dim]`` and the surprise ``[batch, tokens]`` of every head of
        ``kind``."""
        heads, positions = self.layer_heads.count, self.inputs.positions
        if kind == "v" and len(self.builder.own_keys) != heads:
            raise RuntimeError("predict('v', ...) before every key head was observed")
        batch, tokens = self.inputs.batch, positions.shape[0]
        framed = self.builder.apply(kind, 0, self.layer_heads.weight[kind].to(self.dtype), batch)
        mean = framed.view(batch, tokens, heads, self.dim).transpose(1, 2)
        variance = self.layer_heads.sigma[kind].to(self.dtype).square()[:, None, :].expand(-1, tokens, -1)
        if kind == "k":  # a pair of means near float32's limit may rotate past it (linear.finite_means)
            mean = self.frame.rotate(mean, positions).clamp(-F32_MAX, F32_MAX)
            variance = self.frame.rotate_variance(variance, positions)
        found = (framed, mean, variance.sqrt(), self.tracker.current((batch, tokens)))
        self._phase[kind] = found
        return found

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        framed, mean, std, surprise = self._phase.get(kind) or self._start(kind)
        alpha = self.layer_heads.alpha[kind][head]
        std = std[head] * surprise.pow(alpha).unsqueeze(-1) if alpha else std[head].expand(surprise.shape[0], -1, -1)
        if self.portable:  # what `bounds` needs (the encoder only), as `LinearSession.predict` keeps it
            neutral = self.tracker.count == 0 and self.tracker.below is None
            self._last = (kind, head, self._framed(framed, head), std, neutral)
        return mean[:, head], std

    def _framed(self, framed: torch.Tensor, head: int) -> torch.Tensor:
        return framed[..., head * self.dim : (head + 1) * self.dim]

    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        seen = self.builder.own_keys if kind == "k" else self.builder.own_values
        if kind not in self._phase or head != len(seen):
            raise RuntimeError(f"observe({kind!r}, {head}) out of order or without a predict() of its kind")
        framed = self.builder.observe(kind, values)
        self.tracker.add((framed - self._framed(self._phase[kind][0], head)) / self.layer_heads.sigma[kind][head]
                         .to(self.dtype))


@register
class BelowPredictor(CalibratedLinearPredictor):
    """The layer below (and, for values, this layer's keys) through calibrated linear maps, a kind at a time."""

    name = "below"
    recipe = FeatureRecipe(below=1, inter_head=True, phased=True)

    def __init__(self, calibration=None, frame: RopeFrame | None = None, *, portable: bool = False):
        super().__init__(calibration, frame, portable=portable)
        self._layers: dict[int, PhasedHeads] = {}

    @property
    def kind_batched(self) -> bool:
        return self.calibrated

    def session(self, inputs: BlockInputs) -> PredictorSession:
        if not self.calibrated:
            return super().session(inputs)
        return PhasedSession(self.layer_heads(inputs.layer), self.recipe, self.frame, inputs, self.portable)

    def layer_heads(self, layer: int) -> PhasedHeads:
        """``layer``'s stacked heads. Every layer's are read from the calibration at the first call and held
        (`state_tensors`, counted in ``held_bytes``); the calibration's own copy is then released (it reads its
        file again if another user asks)."""
        if not self._layers:
            name = self.heads_name
            for index in range(int(self.calibration.meta["model"]["layers"])):
                heads = self.calibration.stream_heads(name, index)
                stored = {key: self.calibration.tensors[f"{name}/L{index}/{key[0]}{key[1]}/weight"] for key in heads}
                self._layers[index] = PhasedHeads.of(heads, stored)
            self.calibration.release()
        if layer not in self._layers:
            self.calibration.stream_heads(self.heads_name, layer)  # raises the calibration's error for a missing layer
        return self._layers[layer]

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for heads in self._layers.values() for t in heads.tensors()] + self.frame.tensors()
