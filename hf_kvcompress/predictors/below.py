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

from .base import BlockInputs, LayerValues, PredictorSession, register
from .linear import (
    F32_MAX,
    CalibratedLinearPredictor,
    FeatureRecipe,
    LinearSession,
    StreamHead,
    Surprise,
    finite_features,
    linear_pieces,
    nan_as_zero,
)
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
    stacks_kind = True

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

    def predict_kind(self, kind: str, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`predict` of every head of ``kind``: ``[heads, batch, tokens, dim]`` each (the std per element)."""
        _, mean, std, surprise = self._phase.get(kind) or self._start(kind)
        alphas = self.layer_heads.alpha[kind]
        if heads != len(alphas):
            raise ValueError(f"predict_kind({kind!r}, {heads}): this layer has {len(alphas)} heads")
        # per head, as `predict` scales it (the same float32 operations, so the same bits)
        return mean.transpose(0, 1), torch.stack([std[h] * surprise.pow(a).unsqueeze(-1) if a
                                                  else std[h].expand(surprise.shape[0], -1, -1)
                                                  for h, a in enumerate(alphas)])

    def observe_kind(self, kind: str, values: torch.Tensor) -> None:
        """`observe` of every head of ``kind`` (``[batch, heads, tokens, dim]``) in one pass over the heads."""
        seen = self.builder.own_keys if kind == "k" else self.builder.own_values
        if kind not in self._phase or seen:
            raise RuntimeError(f"observe_kind({kind!r}) twice or without a predict() of its kind")
        batch, heads, tokens, _ = values.shape
        framed = self.builder.observe_heads(kind, values)
        predicted = self._phase[kind][0].view(batch, tokens, heads, self.dim).transpose(1, 2)
        sigma = self.layer_heads.sigma[kind].to(self.dtype)[:, None, :]
        squares = ((framed - predicted) / sigma).square().mean(dim=-1)  # [batch, heads, tokens]
        for h in range(heads):  # summed head after head, as `observe` adds them
            self.tracker.add_squares(squares[:, h])

    def _framed(self, framed: torch.Tensor, head: int) -> torch.Tensor:
        return framed[..., head * self.dim : (head + 1) * self.dim]

    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        seen = self.builder.own_keys if kind == "k" else self.builder.own_values
        if kind not in self._phase or head != len(seen):
            raise RuntimeError(f"observe({kind!r}, {head}) out of order or without a predict() of its kind")
        framed = self.builder.observe(kind, values)
        self.tracker.add((framed - self._framed(self._phase[kind][0], head)) / self.layer_heads.sigma[kind][head]
                         .to(self.dtype))


class PhasedLayer:
    """The `PhasedSession` work of several same-shaped blocks of one layer (a decoder's: float32 statistics in
    generation, float64 for files and chunks), done on tensors stacked over the blocks: one pass per operation instead of one per block. Every
    element gets the bits its block's own session gives it: the element-wise operations are the same, and the two
    whose result may depend on how long the tensor is (the matrix products, the ``pow`` of the surprise) still run
    block by block. `LayerBlockSession` is each block's face of it."""

    def __init__(self, heads: PhasedHeads, frame: RopeFrame, inputs: list[BlockInputs]):
        self.heads, self.frame, self.inputs = heads, frame, inputs
        self.dim, self.blocks = heads.sigma["k"].shape[1], len(inputs)
        self.batch, self.tokens = inputs[0].batch, inputs[0].positions.shape[0]
        self.dtype = frame.dtype
        tables = None if frame.is_identity else [frame.cos_sin(block.positions) for block in inputs]
        #: cos / sin ``[blocks, tokens, dim]`` (each block's memoised table), or None for the identity frame
        self.tables = None if tables is None else tuple(torch.stack([t[i] for t in tables]) for i in (0, 1))
        below = [block.below for block in inputs]
        self.base: list[torch.Tensor] = []  # each block's shared features, as `FeatureBuilder.base_matrix`
        if below[0] is not None:
            keys = finite_features(self._unrotate(torch.stack([b.keys for b in below]).to(self.dtype), 2))
            values = finite_features(torch.stack([b.values for b in below]).to(self.dtype))
            flat = torch.cat([self._flat(keys), self._flat(values)], dim=-1)  # [blocks, batch, tokens, features]
            self.base = [flat[i].clone() for i in range(self.blocks)]  # each its own tensor, as a session's
        self.tracker = Surprise(None if below[0] is None else torch.stack([b.surprise for b in below]), self.dtype)
        self.own_keys: list[list[torch.Tensor]] = [[] for _ in inputs]  # pre-RoPE, per block and head
        self._phase: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._seen: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}}
        self._surprise: torch.Tensor | None = None

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        """``[blocks, batch, heads, tokens, dim]`` -> ``[blocks, batch, tokens, heads * dim]`` (`flat_heads`)."""
        blocks, batch, heads, tokens, dim = x.shape
        return x.permute(0, 1, 3, 2, 4).reshape(blocks, batch, tokens, heads * dim)

    def _tables(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked tables with ``extra`` axes between the block and the token axes."""
        shape = (self.blocks, *([1] * extra), self.tokens, -1)
        return self.tables[0].view(shape), self.tables[1].view(shape)

    def _unrotate(self, x: torch.Tensor, extra: int) -> torch.Tensor:
        return x if self.tables is None else self.frame.unrotate_by(x, *self._tables(extra))

    def predicted(self, kind: str, heads: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``index``'s `PhasedSession.predict_kind` (every block's computed at the first call of a kind)."""
        if heads != self.heads.count:
            raise ValueError(f"predict_kind({kind!r}, {heads}): this layer has {self.heads.count} heads")
        if kind not in self._phase:
            self._start(kind)
        _, mean, std = self._phase[kind]
        return mean[index], std[index]

    def _start(self, kind: str) -> None:
        heads, dim, blocks, batch, tokens = self.heads.count, self.dim, self.blocks, self.batch, self.tokens
        if kind == "v" and len(self._seen["k"]) != blocks:
            raise RuntimeError("predict('v', ...) before every key head was observed")
        weight = self.heads.weight[kind].to(self.dtype)
        framed = torch.stack([linear_pieces(kind, 0, weight, self.base[i : i + 1] + (self.own_keys[i] if kind == "v"
                                                                                     else []), batch, tokens)
                              for i in range(blocks)])  # [blocks, batch, tokens, heads * dim]
        mean = framed.view(blocks, batch, tokens, heads, dim).transpose(2, 3)
        variance = self.heads.sigma[kind].to(self.dtype).square()[:, None, :].expand(-1, tokens, -1)
        if kind == "k" and self.tables is not None:
            mean = self.frame.rotate_by(mean, *self._tables(2)).clamp(-F32_MAX, F32_MAX)  # as PhasedSession's
            variance = self.frame.rotate_variance_by(variance, *self._tables(1))  # [blocks, heads, tokens, dim]
        std = variance.sqrt()
        surprise = self.tracker.current((blocks, batch, tokens))
        scaled = []
        for h, alpha in enumerate(self.heads.alpha[kind]):
            own = std[:, h, None] if std.dim() == 4 else std[h]
            if alpha:  # the pow block by block: its last elements may round otherwise in a longer tensor
                scaled.append(own * torch.stack([surprise[i].pow(alpha) for i in range(blocks)]).unsqueeze(-1))
            else:
                scaled.append(own.expand(blocks, batch, tokens, dim))
        self._phase[kind] = (framed, mean.transpose(1, 2), torch.stack(scaled, dim=1))

    def observed(self, kind: str, index: int, values: torch.Tensor) -> None:
        """Block ``index``'s `PhasedSession.observe_kind`; the last block's call observes them all."""
        seen = self._seen[kind]
        if kind not in self._phase or index in seen:
            raise RuntimeError(f"observe_kind({kind!r}) twice or without a predict() of its kind")
        seen[index] = values
        if len(seen) < self.blocks:
            return
        heads, dim = self.heads.count, self.dim
        stacked = torch.stack([seen[i] for i in range(self.blocks)]).to(self.dtype)  # [blocks, batch, heads, ...]
        framed = self._unrotate(stacked, 2) if kind == "k" else stacked
        features = finite_features(framed)  # one finiteness check serves the features and the surprise
        if kind == "k":
            for i in range(self.blocks):
                self.own_keys[i] = [features[i, :, h].clone() for h in range(heads)]
        framed = framed if features is framed else nan_as_zero(framed)
        predicted = self._phase[kind][0].view(self.blocks, self.batch, self.tokens, heads, dim).transpose(2, 3)
        sigma = self.heads.sigma[kind].to(self.dtype)[:, None, :]
        squares = ((framed - predicted) / sigma).square().mean(dim=-1)  # [blocks, batch, heads, tokens]
        for h in range(heads):
            self.tracker.add_squares(squares[:, :, h])

    def finish(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        if len(self._seen["v"]) != self.blocks:
            raise RuntimeError("finish() before every block's values were observed")
        if self._surprise is None:
            self._surprise = self.tracker.current((self.blocks, self.batch, self.tokens))
        return LayerValues.on_top_of(keys, values, self._surprise[index], self.inputs[index].below)


class LayerBlockSession(PredictorSession):
    """One block of a `PhasedLayer`: predicted and observed a kind at a time only (a decoder's session)."""

    kind_independent = True
    stacks_kind = True

    def __init__(self, layer: PhasedLayer, index: int):
        self.layer, self.index = layer, index
        self.portable = layer.dtype == torch.float64  # a decoder's: its statistics are settled, never bounded

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("a block decoded with its layer is predicted a kind at a time (predict_kind)")

    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        raise RuntimeError("a block decoded with its layer is observed a kind at a time (observe_kind)")

    def predict_kind(self, kind: str, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.predicted(kind, heads, self.index)

    def observe_kind(self, kind: str, values: torch.Tensor) -> None:
        self.layer.observed(kind, self.index, values)

    def finish(self, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        return self.layer.finish(self.index, keys, values)


def same_shaped(inputs: list[BlockInputs]) -> list[list[int]]:
    """The indices of ``inputs`` grouped by block shape (layer, rows, tokens, whether a layer below is read): the
    blocks a layer-batched session computes together."""
    shapes: dict[tuple, list[int]] = {}
    for i, block in enumerate(inputs):
        shapes.setdefault((block.layer, block.batch, block.positions.shape[0], block.below is None), []).append(i)
    return list(shapes.values())


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

    def sessions(self, inputs: list[BlockInputs]) -> list[PredictorSession]:
        """Same-shaped blocks of one layer share one `PhasedLayer` (in float64 for a `portable` predictor's, as its
        sessions compute); a block of a shape of its own (a file's last, shorter block) gets its own session."""
        if not self.calibrated:
            return super().sessions(inputs)
        out: list[PredictorSession | None] = [None] * len(inputs)
        frame = self.frame.in_float64() if self.portable else self.frame
        for members in same_shaped(inputs):
            if len(members) == 1:
                out[members[0]] = self.session(inputs[members[0]])
                continue
            layer = PhasedLayer(self.layer_heads(inputs[members[0]].layer), frame, [inputs[i] for i in members])
            for index, i in enumerate(members):
                out[i] = LayerBlockSession(layer, index)
        return out

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
