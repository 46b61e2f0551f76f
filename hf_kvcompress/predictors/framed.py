"""``framed``: generic's per-block statistics, with keys summarised in their pre-RoPE frame.

Cached keys are rotated by position (RoPE), so a key channel's mean, constant in the pre-RoPE frame, spins
through a 128-token block and generic's per-block channel mean misses it. Without a model the cache does not
know the rotary base, so the encoder tries a few common ones (`BASES`, ``rotate_half`` layout and the default
frequencies ``base^(-2i/d)``) and the identity, keeps for each batch row the frame whose un-rotated keys have
the most mean energy (the most energy in the mean is the least left in the spread: a pair's total energy does
not depend on the rotation), and sends the block's key means and spreads in that frame plus the frame's index
(a bf16 integer) as side data. Both sides rotate the means back; a channel pair's two spreads are averaged, so the
std stays per channel. Values as generic. No state, nothing fitted across blocks.

Measured on SmolLM2 held-out text: docs/results/lossless.md, "`self` and `framed`".
"""

from __future__ import annotations

import torch

from .base import BlockInputs, Predictor, PredictorSession, register
from .generic import BlockStatsSession, block_stats
from .rope import RopeFrame

FRAME = "rope_frame"
#: candidate rotary bases (index 0 is the identity frame: keys as cached)
BASES = (None, 10000.0, 50000.0, 100000.0, 500000.0, 1000000.0)

_frames: dict[int, list[RopeFrame]] = {}


def frames(dim: int) -> list[RopeFrame]:
    """The candidate frames for ``head_dim`` ``dim`` (identity only for odd dims)."""
    if dim not in _frames:
        out = []
        for base in BASES:
            out.append(RopeFrame(None) if base is None or dim % 2 else RopeFrame.standard(base, dim))
        _frames[dim] = out
    return _frames[dim]


def framed_stats(keys: torch.Tensor, values: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
    """Side data: `block_stats` with keys in the chosen frame of each row, and the frame's index."""
    _, _, tokens, dim = keys.shape
    positions = torch.arange(start, start + tokens)
    candidates = frames(dim)
    unrotated = [frame.unrotate(keys, positions) for frame in candidates] if dim % 2 == 0 else [keys.float()]
    finite = [torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0) for k in unrotated]
    energy = torch.stack([k.to(torch.float64).mean(dim=2).square().sum(dim=(1, 2)) for k in finite])  # [C, rows]
    choice = energy.argmax(dim=0)  # [rows]
    chosen = torch.stack([unrotated[int(c)][r] for r, c in enumerate(choice)])
    stats = block_stats(chosen, values)
    stats[FRAME] = choice.to(torch.bfloat16)[:, None]  # [rows, 1]: small integers, exact; a dtype files hold
    return stats


def _pair_spread(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``sqrt((first^2 + second^2) / 2)`` (float32 stds): a pair's spread for both its channels. Where the squares
    overflow float32 (stds near bf16's largest value, which the codec refused before) the same formula in float64,
    whose result fits float32; every other element is the float32 formula's, so other blocks code as before."""
    pair = (first.square() + second.square()).mul(0.5).sqrt()
    overflow = ~torch.isfinite(pair)
    if overflow.any():
        wide = (first.double().square() + second.double().square()).mul(0.5).sqrt().to(torch.float32)
        pair = torch.where(overflow, wide, pair)
    return pair


class FramedStatsSession(BlockStatsSession):
    """Block statistics, key means rotated back from each row's frame (see module docstring)."""

    independent = True

    def __init__(self, inputs: BlockInputs):
        super().__init__(inputs)
        self.frame = inputs.extras[FRAME].reshape(-1).to(torch.long)  # [rows]
        if self.frame.numel() and (int(self.frame.min()) < 0 or int(self.frame.max()) >= len(BASES)):
            raise ValueError(f"framed predictor: frame index {self.frame.tolist()} outside 0..{len(BASES) - 1}")
        key_std = self.stds["k"]  # [rows, heads, dim]
        half = key_std.shape[-1] // 2
        if key_std.shape[-1] % 2 == 0:  # a pair's spread for both its channels: rotation-free, per channel
            pair = _pair_spread(key_std[..., :half], key_std[..., half:])
            self.stds = {"k": torch.cat([pair, pair], dim=-1), "v": self.stds["v"]}
            if not self.split:
                self.std = torch.stack([self.stds["k"], self.stds["v"]], dim=1)
        self._keys: torch.Tensor | None = None
        self._streams: tuple[torch.Tensor, torch.Tensor] | None = None

    def key_means(self) -> torch.Tensor:
        """``[rows, heads, tokens, dim]``: each row's key means rotated back from its frame."""
        if self._keys is None:
            rows, _, dim = self.means["k"].shape
            positions = self.inputs.positions
            tokens = positions.shape[0]
            candidates = frames(dim)
            self._keys = torch.stack([
                candidates[int(self.frame[r])].rotate(self.means["k"][r].unsqueeze(1).expand(-1, tokens, -1), positions)
                for r in range(rows)
            ])
            # a pair of means near float32's largest values rotates past it: the largest finite mean instead
            # (a no-op on every finite mean, so other blocks code as before)
            top = torch.finfo(torch.float32).max
            self._keys = self._keys.clamp(-top, top)
        return self._keys

    def predict_all(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.split:
            return super().predict_all(heads)  # refuses: keys and values of two widths have no stacked form
        if self._streams is None:
            rows, _, _, dim = self.mean.shape
            tokens = self.inputs.positions.shape[0]
            value_mean = self.mean[:, 1].unsqueeze(2).expand(-1, -1, tokens, -1)
            means = torch.cat([self.key_means(), value_mean], dim=1).transpose(0, 1).contiguous()  # [2H, rows, T, dim]
            stds = self.std.permute(1, 2, 0, 3).reshape(2 * heads, rows, 1, dim).contiguous()  # [2H, rows, 1, dim]
            self._streams = (means, stds)
        return self._streams

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.split:
            if kind == "v":
                return super().predict(kind, head)
            std = self.stds["k"][:, head].unsqueeze(1).expand(-1, self.tokens, -1)
            return self.key_means()[:, head], std
        heads = self.mean.shape[2]
        means, stds = self.predict_all(heads)
        index = head if kind == "k" else heads + head
        return means[index], stds[index].expand(-1, self.inputs.positions.shape[0], -1)


@register
class FramedStatsPredictor(Predictor):
    """Per-block statistics with keys in an estimated pre-RoPE frame: needs nothing, holds nothing."""

    name = "framed"
    independent_blocks = True

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return framed_stats(keys, values, 0)

    def block_side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                        start: int) -> dict[str, torch.Tensor]:
        return framed_stats(keys, values, start)

    def session(self, inputs: BlockInputs) -> PredictorSession:
        return FramedStatsSession(inputs)

    def below_depth(self) -> int:
        return 0
