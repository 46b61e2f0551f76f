"""``generic``: per-block channel statistics, the model-free baseline every other predictor builds on.

The encoder sends each block's per (row, k/v, head, channel) mean and spread as a few bytes of bf16 side
data; both sides predict every element of a channel with them. Keys and values of one width share one tensor of
each (``block_mean`` / ``block_std``, ``[rows, 2, heads, dim]``); where they differ in width (an MLA latent and its
rotary part, a model with another value width) each kind has its own (``block_mean_k`` / ``block_std_k``,
``block_mean_v`` / ``block_std_v``, ``[rows, heads, width]``). It needs nothing but the block itself, and no
stream depends on another, so a cache decodes a layer's blocks in one codec call. `framed`, `self` and the
calibrated predictors without a calibration reuse `block_stats` and `BlockStatsSession`.
"""

from __future__ import annotations

import torch

from ..codec.codec_config import GENERATION_CODER
from .base import KINDS, BlockInputs, PlainSession, Predictor, PredictorSession, register

BLOCK_MEAN, BLOCK_STD = "block_mean", "block_std"
#: the side data of a block whose keys and values differ in width: a mean and a std per kind
KIND_MEAN = {"k": "block_mean_k", "v": "block_mean_v"}
KIND_STD = {"k": "block_std_k", "v": "block_std_v"}


def split_widths(extras: dict[str, torch.Tensor]) -> bool:
    """Whether ``extras`` hold `block_stats` per kind (keys and values of different widths)."""
    return BLOCK_MEAN not in extras and KIND_MEAN["k"] in extras


class BlockStatsSession(PlainSession):
    """Mean and std per (row, head, channel) of the block itself, sent as bf16 side data.

    ``means`` / ``stds``: kind -> ``[batch, heads, width]`` float32 (views of ``mean`` / ``std``, ``[batch, 2, heads,
    dim]``, when keys and values have one width; ``split`` says they do not, and ``mean`` / ``std`` are then None)."""

    independent = True

    def __init__(self, inputs: BlockInputs):
        self.inputs = inputs
        self.split = split_widths(inputs.extras)
        if self.split:
            self.mean = self.std = None
            self.means = {kind: inputs.extras[KIND_MEAN[kind]].to(torch.float32) for kind in KINDS}
            self.stds = {kind: inputs.extras[KIND_STD[kind]].to(torch.float32) for kind in KINDS}
        else:
            self.mean = inputs.extras[BLOCK_MEAN].to(torch.float32)  # [batch, 2, heads, dim]
            self.std = inputs.extras[BLOCK_STD].to(torch.float32)
            self.means = {"k": self.mean[:, 0], "v": self.mean[:, 1]}
            self.stds = {"k": self.std[:, 0], "v": self.std[:, 1]}
        self.tokens = inputs.positions.shape[0]

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.means[kind][:, head].unsqueeze(1).expand(-1, self.tokens, -1)
        std = self.stds[kind][:, head].unsqueeze(1).expand(-1, self.tokens, -1)
        return mean, std

    def predict_all(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.split:
            raise RuntimeError(f"layer {self.inputs.layer}: keys and values differ in width "
                               f"({self.means['k'].shape[-1]}, {self.means['v'].shape[-1]}): predict stream by stream")
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


def kind_stream_stats(mean: torch.Tensor, std: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One kind's block statistics ``[blocks * batch, heads, width]`` (float32) as per-stream statistics ``[blocks,
    heads, batch, 1, width]``: one value per channel, broadcast over tokens."""

    def streams(t: torch.Tensor) -> torch.Tensor:
        rows, heads, width = t.shape[0] // blocks, t.shape[1], t.shape[2]
        return t.view(blocks, rows, heads, width).transpose(1, 2).unsqueeze(3)

    return streams(mean), streams(std)


def block_stats(keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Side data of `BlockStatsSession`: per (row, k/v, head, channel) mean and std, rounded to bf16; one tensor
    of each for both kinds, or one per kind where keys and values differ in width (module docstring)."""
    if keys.shape[-1] != values.shape[-1]:
        out = {}
        for kind, x in zip(KINDS, (keys, values)):
            mean, std = _channel_stats(x.to(torch.float32), 2)  # [batch, heads, width]
            out[KIND_MEAN[kind]], out[KIND_STD[kind]] = mean, std
        return out
    both = torch.stack([keys, values], dim=1).to(torch.float32)  # [batch, 2, heads, tokens, dim]
    mean, std = _channel_stats(both, 3)
    return {BLOCK_MEAN: mean, BLOCK_STD: std}


def _channel_stats(x: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std (floored at 1e-6; 1 for a single token) over dim ``tokens`` of float32 ``x``, non-finite
    elements taken as 0, rounded to bf16. A channel of values near the largest finite ones overflows float32's sums
    (or bf16's range): its statistics come from float64 instead, bounded to bf16's largest finite value; only those
    channels, which the codec refused before, differ from the float32 statistics."""
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    mean = finite.mean(dim=tokens)
    std = finite.std(dim=tokens, correction=0) if x.shape[tokens] > 1 else torch.ones_like(mean)
    mean, std = mean.to(torch.bfloat16), std.clamp_min(1e-6).to(torch.bfloat16)
    overflow = ~(torch.isfinite(mean) & torch.isfinite(std))
    if overflow.any():
        wide = finite.to(torch.float64)
        top = torch.finfo(torch.bfloat16).max
        wide_mean = wide.mean(dim=tokens).clamp(-top, top).to(torch.bfloat16)
        wide_std = (wide.std(dim=tokens, correction=0) if x.shape[tokens] > 1 else torch.ones_like(wide_mean))
        wide_std = wide_std.clamp(1e-6, top).to(torch.bfloat16)
        mean, std = torch.where(overflow, wide_mean, mean), torch.where(overflow, wide_std, std)
    return mean, std


@register
class GenericPredictor(Predictor):
    """Per-block channel statistics sent as side data: needs nothing, and every stream of a block is
    independent, so a cache decodes a layer's blocks in one codec call. The in-generation default: the
    calibrated predictors read earlier streams (and `context` the layers below) stream by stream, which
    costs 3.3x (`none`) and 3-5x (`context`) its step time (docs/lossless.md, "Inside generate()")."""

    name = "generic"
    exact_everywhere = True
    coder = GENERATION_CODER  # per-channel statistics: the decode step takes the speed (docs/results/codec.md 13)

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return block_stats(keys, values)

    def session(self, inputs: BlockInputs) -> PredictorSession:
        return BlockStatsSession(inputs)

    def blocks_side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                         starts: list[int]) -> dict[str, torch.Tensor]:
        # per row and position-free: every block's rows in one pass (each row's statistics reduce its tokens
        # alone, as a block on its own does)
        return block_stats(keys, values)

    def below_depth(self) -> int:
        return 0

    def predict_blocks(self, side: dict[str, torch.Tensor], blocks: int,
                       heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if BLOCK_MEAN not in side:  # keys and values of different widths: no stacked form, a session per block
            return None
        return stream_stats(side[BLOCK_MEAN].to(torch.float32), side[BLOCK_STD].to(torch.float32), blocks, heads)

    def predict_blocks_per_kind(self, side: dict[str, torch.Tensor], blocks: int,
                                heads: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        if KIND_MEAN["k"] not in side:
            return None
        return {kind: kind_stream_stats(side[KIND_MEAN[kind]].to(torch.float32), side[KIND_STD[kind]].to(torch.float32),
                                        blocks) for kind in KINDS}
