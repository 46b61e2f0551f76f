"""``self``: a predictor that calibrates itself on the blocks the cache has already sealed.

No model, no calibration. Every block carries the per-block channel statistics of `generic` (its side
data). On top of that, from layer 1 up, a block's keys are predicted from the same block's keys one layer
down, through maps fitted on the cache's own earlier blocks:

    K_l - mean_l  ~  W_l (K_{l-1} - mean_{l-1})

in complex form: channel pairs (c, c + head_dim/2) are the real and imaginary parts of one number (the
``rotate_half`` RoPE layout), and ``W_l`` maps, per pair, the layer below's key heads to this layer's key
heads as complex numbers. A complex scalar commutes with a rotation, so the map is the same at every position
without knowing the model's RoPE frequencies. ``mean_l`` is the block's side-data mean, ``mean_{l-1}`` the
exact mean of the decoded block below. The std of a key channel is the fitted map's residual spread (of its
pair); values keep the block statistics (per kind where keys and values differ in width), and so do the keys of a
layer whose keys are of another width than the layer below's (per-layer head dims: no map between them).

Fitting is causal and from decoded data only: per layer the predictor accumulates ``sum f^H f``,
``sum f^H y`` and ``sum |y|^2`` over its blocks in position order (a block's share in float64, the running
sums in single precision), and fits a map when the first block of an epoch comes (epochs start at 128,
256, 512, ... tokens): blocks of an epoch use the map fitted on every token before that epoch's first block. Encoder and decoder run the same code on the same (exact)
values in the same order, so the maps are bit-identical; nothing is stored. The state is ~5 KB per layer plus
~1.5 KB of bf16 map per epoch (counted in ``held_bytes``); a structural change of the cache (crop, reorder,
row selection, load) drops it, and the next read refits it from the decoded blocks, in order (`history`
tells the cache which block it needs first).

Measured on SmolLM2 held-out text: docs/results/lossless.md, "`self` and `framed`".
"""

from __future__ import annotations

import torch

from .base import BlockInputs, LayerValues, Predictor, register
from .generic import BLOCK_MEAN, BLOCK_STD, KIND_MEAN, BlockStatsSession, block_stats

#: first epoch boundary in tokens; epochs start at FIRST_EPOCH * 2^k
FIRST_EPOCH = 128
#: per-feature ridge penalty, relative to the feature's energy
RIDGE = 1e-2
VAR_FLOOR = 1e-12


def epoch_of(start: int) -> int | None:
    """The epoch of a block starting at ``start`` (None before the first)."""
    if start < FIRST_EPOCH:
        return None
    return (start // FIRST_EPOCH).bit_length() - 1


def _complex(keys: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[rows, heads, tokens, dim]`` -> centered complex ``[rows, dim/2, tokens, heads]`` (complex128 from
    float64 for a block's sums, complex64 from float32 for predictions)."""
    x = keys.to(dtype)
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:])
    z = z - z.mean(dim=2, keepdim=True)
    return z.permute(0, 3, 2, 1)


class _Stats:
    """Running sums of one layer, per batch row."""

    def __init__(self):
        self.covered = 0  # tokens absorbed, from position 0
        # held in single precision (a block's share is summed in double first): half the bytes
        self.gram: torch.Tensor | None = None  # [rows, pairs, F, F] complex64
        self.cross: torch.Tensor | None = None  # [rows, pairs, F, H] complex64
        self.energy: torch.Tensor | None = None  # [rows, pairs, H] float32

    def add(self, feats: torch.Tensor, target: torch.Tensor) -> None:
        gram = (feats.mH @ feats).to(torch.complex64)
        cross = (feats.mH @ target).to(torch.complex64)
        energy = target.abs().square().sum(dim=2).to(torch.float32)
        if self.gram is None:
            self.gram, self.cross, self.energy = gram, cross, energy
        else:
            self.gram, self.cross, self.energy = self.gram + gram, self.cross + cross, self.energy + energy

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.gram, self.cross, self.energy) if t is not None]


class _Map:
    """A fitted map: ``weight`` ``[rows, pairs, F, H, 2]`` (real and imaginary parts, bf16: the map is held
    for every epoch, and bf16 coefficients cost nothing measurable) and ``sigma`` ``[rows, H, pairs]`` float32,
    the residual spread of each pair."""

    def __init__(self, stats: _Stats):
        gram, cross = stats.gram.to(torch.complex128), stats.cross.to(torch.complex128)
        diag = gram.diagonal(dim1=-2, dim2=-1).real.clamp_min(VAR_FLOOR)
        penalised = gram + torch.diag_embed(RIDGE * diag).to(gram.dtype)
        solved = torch.linalg.solve(penalised, cross)
        self.weight = torch.view_as_real(solved).to(torch.bfloat16)
        weight = self.complex_weight().to(torch.complex128)
        fitted = (weight.conj() * (gram @ weight)).sum(dim=-2).real
        energy = stats.energy.to(torch.float64)
        residual = energy - 2.0 * (weight.conj() * cross).sum(dim=-2).real + fitted  # [rows, pairs, H]
        var = (residual / (2.0 * stats.covered)).clamp_min(VAR_FLOOR)
        self.sigma = var.sqrt().to(torch.float32).permute(0, 2, 1).contiguous()  # [rows, H, pairs]

    def complex_weight(self) -> torch.Tensor:
        """``[rows, pairs, F, H]`` complex64."""
        return torch.view_as_complex(self.weight.to(torch.float32))

    def channel_sigma(self) -> torch.Tensor:
        """``[rows, H, 1, dim]``: a pair's spread for both its channels."""
        return torch.cat([self.sigma, self.sigma], dim=-1).unsqueeze(2)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.sigma]


class SelfFitSession(BlockStatsSession):
    """Block statistics, keys predicted from the layer below once a map is fitted (see module docstring)."""

    independent = True

    def __init__(self, predictor: SelfFitPredictor, inputs: BlockInputs, fitted: _Map | None):
        super().__init__(inputs)
        self.predictor = predictor
        self.fitted = fitted
        self._streams: tuple[torch.Tensor, torch.Tensor] | None = None
        self._keys: torch.Tensor | None = None

    def key_means(self) -> torch.Tensor:
        """``[rows, H, tokens, dim]``: the fitted map's keys from the layer below, plus the block's key means."""
        below = _complex(self.inputs.below.keys, torch.float32)  # [rows, pairs, tokens, F]
        pred = (below @ self.fitted.complex_weight()).permute(0, 3, 2, 1)  # [rows, H, tokens, pairs]
        return torch.cat([pred.real, pred.imag], dim=-1) + self.means["k"].unsqueeze(2)

    def predict_all(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fitted is None or self.split:  # (split: keys and values of two widths, refused there)
            return super().predict_all(heads)
        if self._streams is None:
            key_mean = self.key_means()
            tokens = key_mean.shape[2]
            value_mean = self.mean[:, 1].unsqueeze(2).expand(-1, -1, tokens, -1)
            means = torch.cat([key_mean, value_mean], dim=1)  # [rows, 2H, tokens, dim]
            stds = torch.cat([self.fitted.channel_sigma(), self.std[:, 1].unsqueeze(2)], dim=1)  # [rows, 2H, 1, dim]
            self._streams = (means.transpose(0, 1).contiguous(), stds.transpose(0, 1).contiguous())
        return self._streams

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fitted is None or (self.split and kind == "v"):
            return super().predict(kind, head)
        if self.split:  # keys of another width than the values: this stream alone
            if self._keys is None:
                self._keys = self.key_means()
            return self._keys[:, head], self.fitted.channel_sigma()[:, head].expand(-1, self.tokens, -1)
        heads = self.means["k"].shape[1]
        means, stds = self.predict_all(heads)
        index = head if kind == "k" else heads + head
        return means[index], stds[index].expand(-1, self.tokens, -1)

    def finish(self, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        if self.inputs.below is not None:
            self.predictor.absorb(self.inputs.layer, int(self.inputs.positions[0]), self.inputs.below.keys, keys)
        return super().finish(keys, values)


@register
class SelfFitPredictor(Predictor):
    """Generic block statistics plus cross-layer key maps fitted on the cache's own sealed blocks."""

    name = "self"

    def __init__(self, *, portable: bool = False):
        super().__init__(portable=portable)
        self._stats: dict[int, _Stats] = {}
        self._maps: dict[tuple[int, int], _Map] = {}
        self._odd = False  # odd head_dim: no complex pairs, block statistics only
        #: layers whose keys differ in width from the layer below's (per-layer head dims): block statistics only
        self._unmapped: set[int] = set()

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return block_stats(keys, values)

    def below_depth(self) -> int:
        return 1

    #: sessions never depend on other streams of their block: a cache may decode a layer's blocks together
    independent_blocks = True
    self_fitting = True

    def _active(self, layer: int, start: int, dim: int | None = None) -> bool:
        even = not self._odd if dim is None else dim % 2 == 0
        return layer > 0 and epoch_of(start) is not None and even and layer not in self._unmapped

    def history(self, layer: int, start: int) -> int | None:
        """None when a block of ``layer`` at ``start`` can be predicted now; else the start of the block
        the predictor must see (decoded, via `absorb`) first."""
        if not self._active(layer, start):
            return None
        epoch = epoch_of(start)
        if (layer, epoch) in self._maps:
            return None
        stats = self._stats.get(layer)
        covered = 0 if stats is None else stats.covered
        if covered < start:
            return covered
        if covered > start or stats is None or stats.gram is None:
            raise RuntimeError(f"self predictor: no map for layer {layer} epoch {epoch} and tokens {start} already seen")
        self._maps[(layer, epoch)] = _Map(stats)  # the first block of the epoch: fit on all before it
        return None

    def absorb(self, layer: int, start: int, below_keys: torch.Tensor, keys: torch.Tensor) -> None:
        """Add a block's keys (and the layer below's) to the layer's sums, if it is the next one in order."""
        if keys.shape[-1] % 2:
            self._odd = True
        if layer > 0 and below_keys.shape[-1] != keys.shape[-1]:
            self._unmapped.add(layer)
        if layer == 0 or self._odd or layer in self._unmapped:
            return
        stats = self._stats.setdefault(layer, _Stats())
        if start != stats.covered:
            return
        if stats.gram is not None and stats.gram.shape[0] != keys.shape[0]:
            raise RuntimeError("self predictor: batch rows changed without the cache telling it")
        stats.add(_complex(below_keys), _complex(keys))
        stats.covered += keys.shape[2]

    def session(self, inputs: BlockInputs) -> SelfFitSession:
        start = int(inputs.positions[0])
        dim = (inputs.extras[BLOCK_MEAN] if BLOCK_MEAN in inputs.extras else inputs.extras[KIND_MEAN["k"]]).shape[-1]
        if inputs.below is not None and inputs.below.keys.shape[-1] != dim:
            self._unmapped.add(inputs.layer)  # no map between keys of two widths
        fitted = None
        if self._active(inputs.layer, start, dim) and inputs.below is not None:
            if self.history(inputs.layer, start) is not None:
                raise RuntimeError(f"self predictor: layer {inputs.layer} at {start} needs earlier blocks first")
            fitted = self._maps[(inputs.layer, epoch_of(start))]
        return SelfFitSession(self, inputs, fitted)

    def forget_state(self) -> None:
        """Drop maps and sums (the cache's blocks changed); they are refitted from the blocks in order."""
        self._stats.clear()
        self._maps.clear()
        self._unmapped.clear()

    def state_tensors(self) -> list[torch.Tensor]:
        out = []
        for stats in self._stats.values():
            out.extend(stats.tensors())
        for fitted in self._maps.values():
            out.extend(fitted.tensors())
        return out


__all__ = ["BLOCK_MEAN", "BLOCK_STD", "SelfFitPredictor", "SelfFitSession", "epoch_of"]
