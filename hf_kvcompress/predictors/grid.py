"""``grid``: `below`'s calibrated maps with statistics that every CPU computes bit for bit, by construction.

`below` sums float products whose order (BLAS blocking, thread count, SIMD width, oneDNN) changes their last bits,
so a file it codes must carry float64 "portable" statistics (`bounds`, listed elements, `codec.params.settle`).
``grid`` reads the same head set (``heads_name`` "below": the same features and fitted weights) but computes the
mean from integers:

- each feature channel of a block (per batch row, over the block's tokens) is quantized to ``|q| <= 127`` with a
  power-of-two scale ``2^(E-7)`` (`torch.frexp` of the channel's max ``|x|``): exact operations only;
- the feature scales are folded into the weights (exact: powers of two) and each output column of the folded weights
  is quantized the same way (scale ``2^(T_j-7)``);
- ``q @ qW`` is then a sum of integers of at most ``127 * 127``: a float32 product is exact, whatever the order, as
  long as every partial sum stays below 2^24, i.e. for up to `EXACT_FEATURES` features (longer sums go in chunks of
  that many, added in float64 in a fixed order: integers below 2^53, exact);
- the mean is ``sum * 2^(T_j-7) + bias`` in float32: the integer sum and its power-of-two scaling are exact, the
  addition one correctly rounded operation (in float64, then rounded to float32, where the scale is beyond float32's
  range or the sum took several chunks). The bias is added apart, unquantized: the column's 7 bits go to the
  features.

RoPE tables come from `codec.detmath.det_sincos` (angles ``position * inv_freq`` are exact in float64) rounded once
to float32; rotations are separate float32 multiplies and adds. The surprise (`below`'s per-token std multiplier)
is made exact too: standardised squared errors on a fixed-point grid summed in int64, a token's level the number of
quarter-octave thresholds (over `SURPRISE_RANGE`) its sum passes, the multiplier ``surprise ** alpha`` per level and
head a table from `detmath.det_exp`. Everything else is element-wise IEEE arithmetic, so sessions are not
`PredictorSession.portable`: their float32 statistics are the same bits on every CPU, thread count and matrix
library path, and a saved file needs no settled listing.

On the CPU the element-wise passes (feature quantization, weight folding, key unrotation, the surprise's error
sums) run as compiled loops (`grid_kernels`) with the same IEEE operations: the same bits as the torch expressions
kept here for other devices (tests/predictors/test_grid_kernels.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..codec.detmath import SINCOS_LIMIT, det_exp, det_sincos
from .base import BlockInputs, LayerValues, PredictorSession, register
from .below import BelowPredictor, PhasedHeads, same_shaped
from .grid_kernels import (
    error_sums_compiled,
    quantize_features_compiled,
    quantize_folded_compiled,
    unrotate_compiled,
)
from .linear import F32_MAX, SURPRISE_RANGE, finite_features
from .rope import RopeFrame

#: the most features whose float32 integer dot product is exact: every partial sum of products ``|q q'| <= 127^2``
#: stays below 2^24 (1040 * 16129 = 16,774,160 < 16,777,216)
EXACT_FEATURES = 1040
#: bits of a quantized feature or weight besides its sign: ``|q| <= Q_MAX = 127`` at scale ``2^(E - GRID_BITS)``
#: (what keeps 1,040 products' sums exact in float32; SmolLM2, 2,048 held-out tokens, lanes: 8.580 bits/scalar
#: against `below`'s float means' 8.551; 9 bits would give 8.555 with float64 products: experiments/grid_rate.py)
GRID_BITS = 7
Q_MAX = 2**GRID_BITS - 1
#: fixed-point bits of a standardised squared error (the surprise sums them in int64)
E2_BITS = 12
#: a standardised squared error counts at most this much: one such element (|z| >= 2^15) still saturates its token's
#: surprise for up to 2^20 elements per token, and int64 sums of 2^20 of them cannot overflow (2^20 * 2^42 < 2^63)
E2_CAP = 2.0**30
MAX_SURPRISE_ELEMENTS = 2**20
#: surprise levels: quarter octaves over `SURPRISE_RANGE` (0.25 .. 8 is 5 octaves: levels 0..20, level 8 = 1)
_LOW_OCTAVE = round(math.log2(SURPRISE_RANGE[0]))  # -2
LEVELS = 4 * (round(math.log2(SURPRISE_RANGE[1])) - _LOW_OCTAVE) + 1
NEUTRAL_LEVEL = -4 * _LOW_OCTAVE
_LN2 = 0.6931471805599453


def _root_ceil(x: int, halvings: int) -> int:
    """``ceil(x ** (1 / 2^halvings))`` for an integer ``x >= 0``, exactly (nested integer square roots: the floor
    of a root of a floor is the floor of the root)."""
    root = x
    for _ in range(halvings):
        root = math.isqrt(root)
    return root if root ** (2**halvings) == x else root + 1


def _two_to_eighths(k: int) -> float:
    """``2^(k/8)`` rounded to float64 from exact integer arithmetic (no libm): the floor of ``2^(k/8 + 120)``
    over ``2^120`` (Python's int division is correctly rounded)."""
    bits = 120
    root = math.isqrt(math.isqrt(math.isqrt(2 ** (k + 8 * bits))))  # floor(2^(k/8 + bits)), k >= -8 bits
    return root / 2**bits


#: a level's surprise: ``2^((level - NEUTRAL_LEVEL) / 4)``, float32 (what `LayerValues.surprise` carries)
LEVEL_SURPRISE = torch.tensor([_two_to_eighths(2 * (level - NEUTRAL_LEVEL)) for level in range(LEVELS)],
                              dtype=torch.float32)
#: the edges between levels (geometric midpoints ``2^((2 (level - NEUTRAL_LEVEL) - 1) / 8)``), float32: a surprise
#: ``>= LEVEL_EDGES[i]`` is at level ``i + 1`` or above
LEVEL_EDGES = torch.tensor([_two_to_eighths(2 * (level - NEUTRAL_LEVEL) - 1) for level in range(1, LEVELS)],
                           dtype=torch.float32)


def level_thresholds(elements: int) -> torch.Tensor:
    """int64 thresholds on a token's sum of ``elements`` fixed-point squared errors (`squared_error_sums`): level
    ``i + 1`` or above where the sum reaches ``thresholds[i]``, i.e. where the RMS error reaches ``LEVEL_EDGES[i]``
    (edge^2 = ``2^(k/4)``: the threshold ``ceil(base 2^(k/4))`` is a fourth root, computed in integers)."""
    if not 0 < elements <= MAX_SURPRISE_ELEMENTS:
        raise ValueError(f"the grid surprise sums 1 to {MAX_SURPRISE_ELEMENTS} elements per token, got {elements}")
    base = elements * 2**E2_BITS  # sum / base = the mean squared error
    out = []
    for level in range(1, LEVELS):
        k = 2 * (level - NEUTRAL_LEVEL) - 1  # >= -33: base^4 = elements^4 2^48 keeps base^4 2^k an integer
        power = base**4 * 2**k if k >= 0 else base**4 // 2**-k
        out.append(_root_ceil(power, 2))
    return torch.tensor(out, dtype=torch.int64)


def level_of_surprise(surprise: torch.Tensor) -> torch.Tensor:
    """The level (int64) of each float32 surprise (exact comparisons with `LEVEL_EDGES`)."""
    return (surprise.to(torch.float32).unsqueeze(-1) >= LEVEL_EDGES).sum(dim=-1)


def level_multipliers(alphas: list[float]) -> torch.Tensor:
    """``[heads, LEVELS]`` float32: each level's surprise to each head's ``alpha`` (`detmath.det_exp`)."""
    steps = (np.arange(LEVELS, dtype=np.float64) - NEUTRAL_LEVEL) * 0.25  # log2 of the level's surprise, exact
    table = np.stack([det_exp(np.float64(alpha) * steps * _LN2) for alpha in alphas])
    return torch.from_numpy(table.astype(np.float32))


def squared_error_sums(errors: torch.Tensor) -> torch.Tensor:
    """``errors`` ``[..., heads, tokens, dim]`` (float32 standardised errors) -> int64 ``[..., tokens]``: the sum of
    their squares on the fixed-point grid (NaN counts 0, each square at most `E2_CAP`): exact in any order."""
    fixed = (errors * errors).clamp_(max=E2_CAP).mul_(2.0**E2_BITS).floor_().nan_to_num_(nan=0.0)
    return fixed.to(torch.int64).sum(dim=(-3, -1))


def pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` float64 for integer ``k`` in ``[-1022, 1023]``, built from its bits (no libm)."""
    if k.numel() and (int(k.min()) < -1022 or int(k.max()) > 1023):
        raise ValueError("pow2: exponent beyond float64's normal range")
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def quantize_features(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, tokens, features]`` (float32; NaN and infinities read as 0, as `linear.finite_features`) ->
    integers ``|q| <= Q_MAX`` (float32) and the int64 exponents ``E`` ``[rows, 1, features]`` with
    ``x ~ q * 2^(E - GRID_BITS)``: per row and channel, from `torch.frexp` of the channel's largest ``|x|`` (exact
    operations: frexp, a power-of-two scaling, round half to even, clamp)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:  # the same bits in one compiled pass per output
        return quantize_features_compiled(x, GRID_BITS, Q_MAX)
    return quantize_features_torch(x)


def quantize_features_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_features` in torch operations (any device; the reference of its compiled CPU loop)."""
    top = x.abs().amax(dim=1, keepdim=True)
    if not bool(torch.isfinite(top).all()):  # checked on the maxima: a pass over x only where one is not finite
        x = finite_features(x)
        top = x.abs().amax(dim=1, keepdim=True)
    _, exponent = torch.frexp(top)
    shift = GRID_BITS - exponent.to(torch.int64)  # -121 (2^128 > max) .. 155 (the smallest subnormal)
    scaled = x * pow2(shift.clamp(max=127)).to(torch.float32)
    if bool((shift > 127).any()):  # a channel of subnormals: the scale beyond float32's range, applied in two steps
        scaled.mul_(pow2((shift - 127).clamp(min=0)).to(torch.float32))
    return scaled.round_().clamp_(-Q_MAX, Q_MAX), exponent.to(torch.int64)


def exact_float32_matmul() -> bool:
    """Whether float32 matrix products run in float32 (no bf16 / tf32 reduced-precision mode)."""
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    return (torch.get_float32_matmul_precision() == "highest"
            and getattr(mkldnn, "fp32_precision", "none") in ("none", "ieee"))


def grid_means(pieces: list[tuple[torch.Tensor, torch.Tensor]], weight: torch.Tensor) -> torch.Tensor:
    """``[1, features] @ weight`` of features as `quantize_features` gave them, piece by piece (``pieces``: ``q``
    ``[rows, tokens, n_i]`` and its exponents ``[rows, 1, n_i]``, in the order of the weight's rows; ``weight``
    ``[1 + sum n_i, out]``, row 0 the bias): float32 ``[rows, tokens, out]``, the same bits on every CPU."""
    rows, tokens = pieces[0][0].shape[:2]
    widths = [q.shape[-1] for q, _ in pieces]
    n = sum(widths)
    if weight.shape[0] != 1 + n:
        raise ValueError(
            f"calibrated head expects {weight.shape[0]} features, the grid predictor builds {1 + n}: the calibration "
            "was fitted with other predictor features; recalibrate (hf-kvcompress calibrate)"
        )
    if n == 0:
        return weight[0].to(torch.float32).expand(rows, tokens, -1).clamp(-F32_MAX, F32_MAX)
    exponent = torch.cat([e for _, e in pieces], dim=-1)
    qw, shift = quantized_weights(weight[1:], exponent)
    if n > EXACT_FEATURES:  # chunks of exact float32 sums (float64 in a reduced-precision mode), added in order
        q = torch.cat([q for q, _ in pieces], dim=-1)
        sums = _integer_products(q[..., :EXACT_FEATURES], qw[:, :EXACT_FEATURES]).to(torch.float64)
        for start in range(EXACT_FEATURES, n, EXACT_FEATURES):
            end = start + EXACT_FEATURES
            sums = sums + _integer_products(q[..., start:end], qw[:, start:end]).to(torch.float64)
        return _scaled_in_float64(sums, shift, weight[0])
    # every partial sum of the pieces together stays below 2^24: exact in float32 in any order, so the pieces are
    # summed one after the other (no concatenated copy)
    sums, row = None, 0
    for (q, _), width in zip(pieces, widths, strict=True):
        if width:
            sums = _integer_products(q, qw[:, row : row + width], sums)
        row += width
    sums = sums.to(torch.float32)
    # sums * 2^shift is exact in float32 for a scale float32 holds (the bias then added in one rounding); a column
    # whose scale it does not hold (folded weights beyond ~2^-119 .. 2^134) goes through float64
    within = (shift >= -126) & (shift <= 127)
    outside = None if bool(within.all()) else _scaled_in_float64(sums.to(torch.float64), shift, weight[0])
    means = sums.mul_(pow2(shift.clamp(-126, 127)).to(torch.float32)).add_(weight[0].to(torch.float32))
    if outside is not None:
        means = torch.where(within, means, outside)
    return means.clamp_(-F32_MAX, F32_MAX)


def quantized_weights(weight: torch.Tensor, exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[n, out]`` (a head's rows past the bias) folded with each row's feature scales ``2^(exponent -
    GRID_BITS)`` (``exponent`` ``[rows, 1, n]``, from `quantize_features`) and each output column quantized to
    ``|q| <= Q_MAX`` at scale ``2^shift``: the integers (float32 ``[rows, n, out]``) and ``shift`` (int64 ``[rows,
    1, out]``). Exact operations: a power-of-two scaling, `torch.frexp`, round half to even, clamp."""
    if weight.device.type == "cpu" and bool(torch.isfinite(weight).all()):  # one compiled pass per output
        return quantize_folded_compiled(weight, exponent, GRID_BITS, Q_MAX)
    return quantized_weights_torch(weight, exponent)


def quantized_weights_torch(weight: torch.Tensor, exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantized_weights` in torch operations (any device, any weights; the reference of its compiled loop)."""
    folded = weight.to(torch.float64).unsqueeze(0) * pow2(exponent - GRID_BITS).transpose(1, 2)  # exact
    _, column = torch.frexp(folded.abs().amax(dim=1, keepdim=True))  # [rows, 1, out]
    shift = column.to(torch.int64) - GRID_BITS
    return torch.round(folded * pow2(-shift)).clamp(-Q_MAX, Q_MAX).to(torch.float32), shift


def _integer_products(q: torch.Tensor, qw: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """``into + q @ qw`` of integer-valued float32 operands (``[rows, tokens, <= EXACT_FEATURES]``): float32
    products (exact while every partial sum stays below 2^24), or float64 ones under a reduced-precision float32
    mode (exact too)."""
    if not exact_float32_matmul():
        q, qw = q.to(torch.float64), qw.to(torch.float64)
    return torch.bmm(q, qw) if into is None else torch.baddbmm(into.to(qw.dtype), q, qw)


def _scaled_in_float64(sums: torch.Tensor, shift: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``bias + sums * 2^shift`` in float64 (the power of two exact, the addition one rounding), then float32."""
    return (sums * pow2(shift) + bias.to(torch.float64)).to(torch.float32).clamp(-F32_MAX, F32_MAX)


class ExactRopeFrame(RopeFrame):
    """A float32 `RopeFrame` whose cos / sin tables are the same bits on every CPU (`detmath.det_sincos` of
    float64 angles ``position * inv_freq``, exact products, rounded once to float32). Its rotations are
    `RopeFrame`'s: separate element-wise float32 operations."""

    def __init__(self, inv_freq: torch.Tensor | None):
        super().__init__(inv_freq, torch.float32)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = positions.cpu().numpy().astype(np.int64)
        key = (int(steps[0]), int(steps.shape[0])) if steps.size else (0, 0)
        contiguous = steps.size < 2 or bool((np.diff(steps) == 1).all())
        if contiguous and key in self._memo:
            return self._memo[key]
        if steps.size and (int(steps.min()) < 0 or int(steps.max()) >= 2**29):
            raise ValueError("the grid predictor's RoPE tables take positions 0 .. 2^29 - 1 (exact float64 angles)")
        frequencies = self.inv_freq.numpy().astype(np.float64)
        angles = steps.astype(np.float64)[:, None] * frequencies[None, :]  # 24 x 29 bits: exact
        if angles.size and float(angles.max()) > SINCOS_LIMIT:
            raise ValueError(f"the grid predictor's RoPE angles reach {float(angles.max()):.6g}, beyond the "
                             f"{SINCOS_LIMIT:.6g} its deterministic sin / cos cover (positions too far)")
        sin, cos = det_sincos(np.concatenate([angles, angles], axis=-1))
        result = (torch.from_numpy(cos.astype(np.float32)), torch.from_numpy(sin.astype(np.float32)))
        if contiguous:
            if len(self._memo) >= 64:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = result
        return result

    def in_float64(self) -> RopeFrame:
        raise RuntimeError("the grid predictor's frame computes in float32 only (its tables are exact)")


class GridLayer:
    """The grid statistics of one or more same-shaped blocks of one layer, computed together: one batched matrix
    product per kind over every block (integer sums: the bits of each block's own computation). `GridSession` is
    each block's face of it."""

    def __init__(self, heads: PhasedHeads, multipliers: dict[str, torch.Tensor], frame: ExactRopeFrame,
                 inputs: list[BlockInputs]):
        self.heads, self.multipliers, self.frame, self.inputs = heads, multipliers, frame, inputs
        self.count, self.dim = heads.sigma["k"].shape
        self.blocks, self.batch, self.tokens = len(inputs), inputs[0].batch, inputs[0].positions.shape[0]
        self.rows = self.blocks * self.batch
        if self.tokens == 0:
            raise ValueError("the grid predictor needs blocks of at least one token")
        tables = None if frame.is_identity else [frame.cos_sin(block.positions) for block in inputs]
        #: cos / sin ``[blocks, 1, 1, tokens, dim]`` (broadcast over batch rows and heads), or None (no RoPE)
        self.tables = None if tables is None else tuple(
            torch.stack([t[i] for t in tables]).view(self.blocks, 1, 1, self.tokens, -1) for i in (0, 1))
        below = [block.below for block in inputs]
        if below[0] is not None:
            keys = self._unrotate(torch.stack([b.keys for b in below]).to(torch.float32))
            values = torch.stack([b.values for b in below]).to(torch.float32)
            self.base = quantize_features(torch.cat([self._flat(keys), self._flat(values)], dim=-1))
            self.level_below = level_of_surprise(torch.stack([b.surprise for b in below]).reshape(self.rows, -1))
        else:
            empty = torch.zeros(self.rows, self.tokens, 0)
            self.base = (empty, torch.zeros(self.rows, 1, 0, dtype=torch.int64))
            self.level_below = torch.full((self.rows, self.tokens), NEUTRAL_LEVEL, dtype=torch.int64)
        self.own_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # quantized, as `base`
        self.errors: dict[str, torch.Tensor] = {}  # kind -> int64 [rows, tokens] sums (`squared_error_sums`)
        self._phase: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._seen: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}}
        self._surprise: torch.Tensor | None = None

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        """``[blocks, batch, heads, tokens, dim]`` -> ``[blocks * batch, tokens, heads * dim]``."""
        return x.permute(0, 1, 3, 2, 4).reshape(self.rows, self.tokens, -1)

    def _unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """Keys ``[blocks, batch, heads, tokens, dim]`` to the pre-RoPE frame; for the features and the errors
        only, which read a NaN as 0: on the CPU a compiled pass (the same bits but for NaN payloads)."""
        if self.tables is None:
            return x
        if x.device.type == "cpu" and x.dtype == torch.float32:
            return unrotate_compiled(x, *self.tables)
        return self.frame.unrotate_by(x, *self.tables)

    def _level(self, sums: torch.Tensor, streams: int) -> torch.Tensor:
        thresholds = level_thresholds(streams * self.dim)
        return (sums.unsqueeze(-1) >= thresholds).sum(dim=-1)

    def predicted(self, kind: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``index``'s means and stds of every head of ``kind``, ``[heads, batch, tokens, dim]`` each."""
        if kind not in self._phase:
            self._start(kind)
        _, mean, std = self._phase[kind]
        return mean[index], std[index]

    def _start(self, kind: str) -> None:
        if kind == "v" and self.own_keys is None:
            raise RuntimeError("predict('v', ...) before every key head was observed")
        heads, dim, blocks, batch, tokens = self.count, self.dim, self.blocks, self.batch, self.tokens
        pieces = [self.base] if kind == "k" else [self.base, self.own_keys]
        framed = grid_means(pieces, self.heads.weight[kind])  # [rows, tokens, heads * dim]
        mean = framed.view(blocks, batch, tokens, heads, dim).transpose(2, 3)  # [blocks, batch, heads, tokens, dim]
        sigma = self.heads.sigma[kind]
        variance = (sigma * sigma)[:, None, :]  # [heads, 1, dim]
        if kind == "k" and self.tables is not None:
            mean = self.frame.rotate_by(mean, *self.tables).clamp(-F32_MAX, F32_MAX)
            variance = self.frame.rotate_variance_by(variance, *self.tables)  # [blocks, 1, heads, tokens, dim]
        std = variance.sqrt().expand(blocks, batch, heads, tokens, dim)
        level = self.level_below if kind == "k" else self._level(self.errors["k"], heads)
        scale = self.multipliers[kind][:, level]  # [heads, rows, tokens]
        scale = scale.view(heads, blocks, batch, tokens).permute(1, 2, 0, 3).unsqueeze(-1)
        self._phase[kind] = (framed, mean.transpose(1, 2), (std * scale).transpose(1, 2))

    def observed(self, kind: str, index: int, values: torch.Tensor) -> None:
        """Block ``index``'s true values of every head of ``kind`` (``[batch, heads, tokens, dim]``); the last
        block's call observes them all."""
        seen = self._seen[kind]
        if kind not in self._phase or index in seen:
            raise RuntimeError(f"observe_kind({kind!r}) twice or without a predict() of its kind")
        seen[index] = values
        if len(seen) < self.blocks:
            return
        heads, dim = self.count, self.dim
        stacked = torch.stack([seen[i] for i in range(self.blocks)]).to(torch.float32)  # [blocks, batch, heads, ...]
        framed = self._unrotate(stacked) if kind == "k" else stacked
        if kind == "k":
            self.own_keys = quantize_features(self._flat(framed))
        means, sigma = self._phase[kind][0], self.heads.sigma[kind]  # [rows, tokens, heads * dim], [heads, dim]
        if means.device.type == "cpu" and framed.dtype == sigma.dtype == torch.float32:  # one compiled pass
            self.errors[kind] = error_sums_compiled(framed.reshape(self.rows, heads, self.tokens, dim), means, sigma,
                                                    E2_CAP, E2_BITS)
            return
        predicted = means.view(self.blocks, self.batch, self.tokens, heads, dim).transpose(2, 3)
        errors = (framed - predicted) / sigma[:, None, :]  # a NaN element counts 0
        self.errors[kind] = squared_error_sums(errors).reshape(self.rows, self.tokens)

    def finish(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        if len(self._seen["v"]) != self.blocks:
            raise RuntimeError("finish() before every block's values were observed")
        if self._surprise is None:
            level = self._level(self.errors["k"] + self.errors["v"], 2 * self.count)
            self._surprise = LEVEL_SURPRISE[level].view(self.blocks, self.batch, self.tokens)
        return LayerValues.on_top_of(keys, values, self._surprise[index], self.inputs[index].below)


class GridSession(PredictorSession):
    """One block of a `GridLayer`: a kind at a time (`predict_kind` / `observe_kind`) or head by head (`predict` /
    `observe`, the encoder's), the same bits either way. Float32 statistics every CPU computes alike."""

    kind_independent = True
    stacks_kind = True
    portable = False

    def __init__(self, layer: GridLayer, index: int):
        self.layer, self.index = layer, index
        self._heads: dict[str, list[torch.Tensor]] = {"k": [], "v": []}

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        mean, std = self.layer.predicted(kind, self.index)
        return mean[head], std[head]

    def predict_kind(self, kind: str, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if heads != self.layer.count:
            raise ValueError(f"predict_kind({kind!r}, {heads}): this layer has {self.layer.count} heads")
        return self.layer.predicted(kind, self.index)

    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        pending = self._heads[kind]
        if kind not in self.layer._phase or head != len(pending):
            raise RuntimeError(f"observe({kind!r}, {head}) out of order or without a predict() of its kind")
        pending.append(values)
        if len(pending) == self.layer.count:
            self.layer.observed(kind, self.index, torch.stack(pending, dim=1))

    def observe_kind(self, kind: str, values: torch.Tensor) -> None:
        if self._heads[kind]:
            raise RuntimeError(f"observe_kind({kind!r}) after observe() of some of its heads")
        self.layer.observed(kind, self.index, values)

    def finish(self, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        return self.layer.finish(self.index, keys, values)


@register
class GridPredictor(BelowPredictor):
    """`below`'s head set on integer grids: the same statistics on every CPU (see module docstring)."""

    name = "grid"
    #: reads the head set `below` fits (`registry.head_set`): a fit asked for ``grid`` fits ``below``
    reads_heads_of = "below"
    #: its float32 statistics are the same bits on every CPU: a block coded in generation is what a file or a
    #: stored chunk codes, so loads and puts take it as it is (`BlockCodec.codes_like`)
    exact_everywhere = True
    #: `GridSession`s serve an encoder's calls too: the blocks of a seal or a save share one `GridLayer`
    encodes_together = True
    #: per-element statistics: the mantissa-modelling Huffman coder (docs/codec.md "The coders"; the frontier in
    #: docs/results/lossless.md "Calibrated storage (issue 48)")
    coder = "mhuff"
    storage_coder = "mhuff"

    def __init__(self, calibration=None, frame: RopeFrame | None = None, *, portable: bool = False):
        if frame is None and calibration is not None:
            frame = calibration.rope_frame()
        if frame is not None and not isinstance(frame, ExactRopeFrame):  # its own tables: exact ones
            frame = ExactRopeFrame(frame.inv_freq)
        super().__init__(calibration, frame, portable=portable)
        self._multipliers: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def heads_name(self) -> str:
        return self.reads_heads_of

    def session(self, inputs: BlockInputs) -> PredictorSession:
        if not self.calibrated:
            return super().session(inputs)
        return GridSession(self._grid_layer([inputs]), 0)

    def sessions(self, inputs: list[BlockInputs]) -> list[PredictorSession]:
        """Same-shaped blocks of one layer share one `GridLayer` (one batched product per kind); the others (a
        file's last, shorter block) get their own."""
        if not self.calibrated:
            return [self.session(block) for block in inputs]
        out: list[PredictorSession | None] = [None] * len(inputs)
        for members in same_shaped(inputs):
            layer = self._grid_layer([inputs[i] for i in members])
            for index, i in enumerate(members):
                out[i] = GridSession(layer, index)
        return out

    def _grid_layer(self, inputs: list[BlockInputs]) -> GridLayer:
        index = inputs[0].layer
        heads = self.layer_heads(index)
        if index not in self._multipliers:
            self._multipliers[index] = {kind: level_multipliers(heads.alpha[kind]) for kind in "kv"}
        return GridLayer(heads, self._multipliers[index], self.frame, inputs)

    def state_tensors(self) -> list[torch.Tensor]:
        return super().state_tensors() + [t for table in self._multipliers.values() for t in table.values()]
