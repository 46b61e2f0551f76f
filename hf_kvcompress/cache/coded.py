"""Lossless storage: a sealed block held only as codec streams, predicted from what the decoder knows.

A block of one layer is ``rows * 2 * kv_heads`` streams (one per batch row, kind and head, coded in
`stream_order`). Each stream's mean and std come from the predictor; the encoder adds one byte per stream
that scales the std by ``2^(s/4)`` to fit the block's actual spread (cheap protection against text unlike
the calibration text). Decoding a block of layer ``l`` needs the same block of layer ``l - 1`` when the
predictor reads the layer below, so `LosslessContext` keeps the last two layers' decoded blocks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..codec import CodecConfig, Marginal, ParameterMismatchError, decode, encode
from ..predictors.base import BlockInputs, ExtrasSource, LayerValues, Predictor, stream_order
from .storage import Block, Storage

SCALE_MIN, SCALE_MAX = -32, 63  # std scale exponents (quarter octaves) one byte can hold


@contextlib.contextmanager
def one_thread():
    """Predictor maths on one thread: its matrices are small (intra-op threads only add synchronisation,
    badly so on a busy machine: 30x measured here), and the means then do not depend on the caller's thread
    setting, so encoder and decoder agree whatever ``torch.set_num_threads`` says."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class PredictorMismatchError(ValueError):
    """Decoding found means that differ from the ones used to encode: the predictor did not reproduce
    (other thread count, CPU, library version or calibration)."""


@dataclass
class CodedRow:
    """One batch row of a coded block: a blob and a std-scale code per stream, plus side data."""

    blobs: list[bytes]
    scales: list[int]
    side: dict[str, torch.Tensor]

    def nbytes(self) -> int:
        side = sum(t.numel() * t.element_size() for t in self.side.values())
        return sum(len(b) for b in self.blobs) + len(self.scales) + side


class CodedBlock(Block):
    """A sealed block held as codec streams (see module docstring)."""

    exact = True

    def __init__(self, context: LosslessContext, layer: int, start: int, tokens: int, rows: list[CodedRow],
                 heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.context = context
        self.layer = layer
        self.start = start
        self.tokens = self.entries = tokens
        self.rows = rows
        self.heads = heads
        self.dim = dim
        self.dtype = dtype
        self.device = device

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.context.decoded(self)
        return values.keys.to(self.device), values.values.to(self.device)

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)

    def select_rows(self, indices: torch.Tensor) -> CodedBlock:
        rows = [self.rows[i] for i in indices.tolist()]
        return CodedBlock(self.context, self.layer, self.start, self.tokens, rows, self.heads, self.dim,
                          self.dtype, self.device)

    def to(self, device: torch.device | str) -> CodedBlock:
        return self  # bytes live on the host; decoded tensors go to self.device


class LosslessContext:
    """What every layer of one lossless cache shares: predictor, codec settings, decoded-block memo.

    ``find_block(layer, start)`` returns the block of ``layer`` that starts at ``start`` (the layer-below
    lookup); ``marginals(layer)`` the calibrated p_hat of a layer, or None for the codec's default.
    """

    def __init__(
        self,
        predictor: Predictor,
        codec_config: CodecConfig,
        find_block: Callable[[int, int], Block | None],
        marginals: Callable[[int], Marginal | None] | None = None,
        workers: int = 1,
    ):
        self.predictor = predictor
        self.codec_config = codec_config
        self.find_block = find_block
        self.marginals = marginals
        self.workers = workers
        self.extras_source: ExtrasSource | None = None
        self._memo: dict[tuple[int, int], tuple[Block, LayerValues]] = {}

    # ------------------------------------------------------------------ coding

    def codec_for(self, layer: int) -> CodecConfig:
        marginal = self.marginals(layer) if self.marginals is not None else None
        if marginal is None:
            return self.codec_config
        return _with_marginal(self.codec_config, marginal)

    def encode_block(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> CodedBlock:
        with one_thread():
            return self._encode_block(layer, keys, values, start)

    def _encode_block(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> CodedBlock:
        batch, heads, tokens, dim = keys.shape
        side = self.predictor.side_data(layer, keys, values)
        inputs = self._inputs(layer, start, tokens, batch, side)
        session = self.predictor.session(inputs)
        config = self.codec_for(layer)
        rows = [CodedRow([], [], {name: t[b].clone() for name, t in side.items()}) for b in range(batch)]
        for kind, head in stream_order(heads):
            mean, std = session.predict(kind, head)
            x = (keys if kind == "k" else values)[:, head].cpu()
            for b, row in enumerate(rows):
                code = choose_scale(x[b], mean[b], std[b])
                row.scales.append(code)
                # channel-major: a channel's elements share its sigma, so the coder switches tables less often
                row.blobs.append(encode(x[b].T, mean[b].T, (std[b] * scale_factor(code)).T, config))
            session.observe(kind, head, x)
        keys_cpu, values_cpu = keys.cpu(), values.cpu()
        block = CodedBlock(self, layer, start, tokens, rows, heads, dim, keys.dtype, keys.device)
        self._remember(block, session.finish(keys_cpu, values_cpu))
        return block

    def decoded(self, block: CodedBlock) -> LayerValues:
        """The block's exact keys and values (and surprise), decoding it (and what it needs) if not known."""
        hit = self._memo.get((block.layer, block.start))
        if hit is not None and hit[0] is block:
            return hit[1]
        with one_thread():
            return self._decode_block(block)

    def _decode_block(self, block: CodedBlock) -> LayerValues:
        side = {name: torch.stack([row.side[name] for row in block.rows]) for name in block.rows[0].side}
        inputs = self._inputs(block.layer, block.start, block.tokens, len(block.rows), side)
        session = self.predictor.session(inputs)
        config = self.codec_for(block.layer)
        shape = (len(block.rows), block.heads, block.tokens, block.dim)
        keys = torch.empty(shape, dtype=block.dtype)
        values = torch.empty(shape, dtype=block.dtype)
        for index, (kind, head) in enumerate(stream_order(block.heads)):
            mean, std = session.predict(kind, head)
            target = keys if kind == "k" else values
            for b, row in enumerate(block.rows):
                try:
                    target[b, head] = decode(row.blobs[index], mean[b].T, (std[b] * scale_factor(row.scales[index])).T,
                                             config=config, workers=self.workers).T
                except ParameterMismatchError as err:
                    raise PredictorMismatchError(
                        f"layer {block.layer}, tokens {block.start}..{block.start + block.tokens}: the "
                        f"'{self.predictor.name}' predictor did not reproduce the means it was encoded with "
                        f"(different thread count, CPU, library version or calibration?): {err}"
                    ) from err
            session.observe(kind, head, target[:, head])
        values_out = session.finish(keys, values)
        self._remember(block, values_out)
        return values_out

    # ------------------------------------------------------------------ internals

    def _inputs(self, layer: int, start: int, tokens: int, batch: int, side: dict) -> BlockInputs:
        extras = dict(side)
        if self.extras_source is not None:
            extras.update(self.extras_source.extras(layer, start, start + tokens))
        below = self._below(layer, start) if layer > 0 else None
        return BlockInputs(layer, batch, torch.arange(start, start + tokens), below, extras)

    def _below(self, layer: int, start: int) -> LayerValues | None:
        hit = self._memo.get((layer - 1, start))
        current = self.find_block(layer - 1, start)
        if hit is not None and (current is None or hit[0] is current):
            return hit[1]
        if isinstance(current, CodedBlock):
            return self.decoded(current)
        if current is not None:  # a raw block below (mode mix): its values are exact
            k, v = current.read()
            return LayerValues(k.cpu(), v.cpu(), torch.ones(k.shape[0], k.shape[2]),
                               self._below(layer - 1, start) if layer > 1 else None)
        raise RuntimeError(f"lossless: layer {layer} needs layer {layer - 1}'s block at {start}, which is gone")

    def _remember(self, block: Block, values: LayerValues) -> None:
        layer = block.layer
        for key in [key for key in self._memo if key[0] not in (layer - 1, layer)]:
            del self._memo[key]
        self._memo[(layer, block.start)] = (block, values)

    def forget(self) -> None:
        self._memo.clear()


class CodedStorage(Storage):
    """`Storage` of lossless mode: one per layer, sharing a `LosslessContext`."""

    name = "lossless"

    def __init__(self, context: LosslessContext, layer: int):
        self.context = context
        self.layer = layer

    def hold(self, keys: torch.Tensor, values: torch.Tensor, *, start: int) -> CodedBlock:
        return self.context.encode_block(self.layer, keys, values, start)


def scale_factor(code: int) -> float:
    return math.pow(2.0, code / 4.0)


def choose_scale(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> int:
    """The quarter-octave std scale that fits this stream's residuals (outliers clipped at 5 sigma, which
    the mixture's wide component and escape pay for anyway)."""
    z = (x.to(torch.float32) - mean) / std.clamp_min(1e-30)
    z2 = torch.nan_to_num(z.square(), nan=25.0, posinf=25.0).clamp(max=25.0)
    ms = float(z2.mean()) if z2.numel() else 1.0
    if ms <= 0.0:
        return SCALE_MIN
    return int(min(SCALE_MAX, max(SCALE_MIN, round(2.0 * math.log2(ms)))))


def _with_marginal(config: CodecConfig, marginal: Marginal) -> CodecConfig:
    from dataclasses import replace

    return replace(config, marginal=marginal)
