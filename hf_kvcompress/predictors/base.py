"""The predictor interface: where each K/V element's mean and spread come from.

A block of one layer is coded as ``2 * kv_heads`` streams in a fixed order — every key head, then every
value head. For each stream the predictor gives a mean and a standard deviation per element, then
observes the stream's true values (the encoder's input, or what the decoder just decoded), so later
streams can lean on earlier ones. Encoder and decoder run the same session code on the same inputs,
which is what makes the means bit-identical on both sides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..codec.codec_config import DEFAULT_CODER
from ..validation import Validated

KINDS = ("k", "v")


# How far another CPU's float64 statistics of a `portable` session may lie from these (the bounds its `bounds`
# returns), relative to the magnitude of the terms that were rounded; a result computed exactly (no rounding:
# a bias alone, a rotation by angle 0, a neutral surprise) gets no tolerance. Each leaves a margin of 2^2-2^8 over
# the error it bounds, and they list ~1e-5 of the elements for the encoder to send (docs/lossless.md, "Where a saved
# file decodes"):
#: elementwise float64 maths (cos / sin / pow / sqrt within a few ulps, a handful of roundings: ~2^-50)
ROUNDING_TOLERANCE = 2.0**-44
#: a float64 dot product of n terms: at most n 2^-53 of the sum of their magnitudes (n <= 2^11 features: 2^-42;
#: a blocked BLAS sum is tighter), plus the features' own rounding (~2^-52 of the same sum); scaled by n / 2^11
#: for longer sums
MEAN_TOLERANCE = 2.0**-40
#: a std scaled by a surprise computed from errors (`linear.Surprise`), which carries the mean's error into the
#: std amplified by magnitude / (sigma * SURPRISE_RANGE[0])
STD_TOLERANCE = 2.0**-20


#: how many layers below a block the values stay reachable (``LayerValues.below`` chains)
MAX_BELOW = 2


@dataclass
class LayerValues:
    """A block's true keys and values at one layer (``[batch, kv_heads, tokens, head_dim]``, cached dtype),
    the per-token surprise its predictor saw (``[batch, tokens]``, float32, 1 = as expected) and the same
    block one layer further down (``MAX_BELOW - 1`` levels are kept)."""

    keys: torch.Tensor
    values: torch.Tensor
    surprise: torch.Tensor
    below: LayerValues | None = None

    @classmethod
    def on_top_of(cls, keys: torch.Tensor, values: torch.Tensor, surprise: torch.Tensor,
                  below: LayerValues | None) -> LayerValues:
        """Values of a layer whose own ``below`` input was ``below`` (the chain is cut at `MAX_BELOW`)."""
        return cls(keys, values, surprise, _trim(below, MAX_BELOW - 1))

    def chain(self, depth: int) -> list[LayerValues]:
        """This layer and up to ``depth - 1`` layers further down, nearest first."""
        out, node = [], self
        while node is not None and len(out) < depth:
            out.append(node)
            node = node.below
        return out


def _trim(values: LayerValues | None, depth: int) -> LayerValues | None:
    if values is None or depth <= 0:
        return None
    return LayerValues(values.keys, values.values, values.surprise, _trim(values.below, depth - 1))


@dataclass
class BlockInputs:
    """What both sides know before a block of layer ``layer`` is coded.

    ``batch`` rows; ``positions`` are the cache positions of its tokens; ``below`` is the same block one layer down (None
    at layer 0); ``extras`` are predictor-specific inputs computed from the model (probe hidden states,
    twin K/V, exactly recomputed K/V).
    """

    layer: int
    batch: int
    positions: torch.Tensor
    below: LayerValues | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def stream_order(kv_heads: int) -> list[tuple[str, int]]:
    """The order streams of a block are coded in."""
    return [(kind, head) for kind in KINDS for head in range(kv_heads)]


class PredictorSession(ABC):
    """Predicts the streams of one block, in `stream_order`."""

    #: True when no prediction depends on an earlier stream's values (`observe` is a no-op): the caller
    #: may then predict every stream first and code the whole block in one batch
    independent: bool = False

    #: True when no stream's prediction depends on another stream of its kind: the caller may predict every key
    #: stream, code them in one batch and observe them, then do the same for the values (two phases per block)
    kind_independent: bool = False

    #: True when `predict_kind` / `observe_kind` do every head of a kind in one pass, with dense statistics (a value
    #: per element): the block coder then decodes a kind of many blocks from stacked tensors, without Python per
    #: stream (`blockcoder.decode_blocks`)
    stacks_kind: bool = False

    #: True when `predict` gives float64 statistics whose last bits depend on the CPU (matrix products, libm):
    #: the cache then codes canonical float32 values (`codec.params.settle`, within `bounds`) so that a file
    #: decodes on every machine; False: float32 statistics that every machine computes bit for bit
    portable: bool = False

    @abstractmethod
    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std, each ``[batch, tokens, head_dim]``, for stream (kind, head): float32, or float64 for a
        `portable` session."""

    def bounds(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a `portable` session, right after `predict` (kind, head): how far (float64, per element) another
        machine's mean and std of that stream may lie from the ones predicted here. Asking a session that is not
        portable is a caller's error: its statistics are exact on every machine."""
        raise RuntimeError(f"{type(self).__name__} is not portable: its statistics have no bounds")

    def predict_all(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std of every stream of an `independent` session, ``[2 * heads, batch, tokens, head_dim]``
        in `stream_order` (a session may return size-1 dimensions where a statistic is broadcast)."""
        if not self.independent:
            raise RuntimeError(f"{type(self).__name__} predicts stream by stream (its streams depend on each other)")
        pairs = [self.predict(kind, head) for kind, head in stream_order(heads)]
        return torch.stack([m for m, _ in pairs]), torch.stack([s for _, s in pairs])

    @abstractmethod
    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        """The true values ``[batch, tokens, head_dim]`` of the stream just predicted."""

    def predict_kind(self, kind: str, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std of every stream of ``kind`` of a `kind_independent` session, ``[heads, batch, tokens,
        width]`` each, equal to its `predict` of each head (a session overrides it with one pass over the heads:
        the per-head Python of a decode step)."""
        pairs = [self.predict(kind, head) for head in range(heads)]
        return torch.stack([m for m, _ in pairs]), torch.stack([s.expand_as(m) for m, s in pairs])

    def observe_kind(self, kind: str, values: torch.Tensor) -> None:
        """`observe` of every stream of ``kind`` after `predict_kind`: ``values`` ``[batch, heads, tokens, width]``."""
        for head in range(values.shape[1]):
            self.observe(kind, head, values[:, head])

    @abstractmethod
    def finish(self, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        """The block's values at this layer, as the next layer's ``below`` input."""


class PlainSession(PredictorSession):
    """A session whose predictions never read the stream values it is shown: `observe` does nothing and every
    token's surprise is 1 (neutral) for the layer above. Needs ``self.inputs`` (its `BlockInputs`)."""

    inputs: BlockInputs

    def observe(self, kind: str, head: int, values: torch.Tensor) -> None:
        pass

    def finish(self, keys: torch.Tensor, values: torch.Tensor) -> LayerValues:
        return LayerValues.on_top_of(keys, values, torch.ones(keys.shape[0], keys.shape[2]), self.inputs.below)


@dataclass(frozen=True)
class PredictorSettings(Validated):
    """A predictor's own settings: a frozen dataclass whose fields declare their checks (`validation.checked`), run
    at construction, as `lossy.registry.MethodSettings` are a lossy method's. `Predictor.settings` names a
    predictor's class; `registry.settings_for` builds one from a `LosslessConfig`'s or a file header's values, so
    a field is named as the `LosslessConfig` field that sets it. Most predictors have none."""


class Predictor(ABC):
    """A source of means and spreads for sealed blocks.

    A predictor is one class with a `name`, decorated with `register` (its module is imported by `registry`); its class attributes say what it needs,
    and every list of predictor names (config choices, storage-only names, the names a calibration fits, the
    CLI's defaults) is derived from them."""

    #: registry name, as in ``LosslessConfig.predictor``
    name: ClassVar[str]
    #: False when decoding needs the model rerun (then it is for storage, not for use inside generate())
    practical_in_generation: ClassVar[bool] = True
    #: `registry.make_predictor` refuses to build it without ``model=``
    needs_model: ClassVar[bool] = False
    #: `registry.make_predictor` refuses to build it without ``calibration=`` (predictors that fall back to
    #: block statistics without one say False)
    needs_calibration: ClassVar[bool] = False
    #: `Calibration.fit` fits heads for it (see `linear.CalibratedLinearPredictor`)
    fitted_by_calibration: ClassVar[bool] = False
    #: the coder its blocks are coded with in generation when `LosslessConfig.coder` names none (one decision
    #: per predictor, from the measured frontier: docs/codec.md "The coders")
    coder: ClassVar[str] = DEFAULT_CODER
    #: the coder a file or a stored chunk codes its tokens with when they are coded again (not generation's
    #: blocks taken as they are): for size (docs/codec.md "The coders")
    storage_coder: ClassVar[str] = DEFAULT_CODER
    #: the name of another predictor whose calibration head set it codes with (None: its own name): a fit asked
    #: for it fits that head set, and a calibration with that head set serves it (`registry.head_set`)
    reads_heads_of: ClassVar[str | None] = None
    #: its own settings' class (`PredictorSettings`: none by default), which `build` receives an instance of
    settings: ClassVar[type[PredictorSettings]] = PredictorSettings

    def __init__(self, *, portable: bool = False):
        #: True: its sessions compute `PredictorSession.portable` statistics (float64 with bounds), which every
        #: CPU decodes alike: for bytes that leave the process (saved files, stored chunks, chunk payloads).
        #: False (generation): float32 statistics, faster, for blocks only this process decodes. Predictors whose
        #: statistics are exact on every CPU (side data) ignore it. A fact of construction, never set later.
        self.portable = bool(portable)

    @property
    def calibrated(self) -> bool:
        """Whether it codes with a calibration's fitted heads, and so with the calibration's per-layer marginals
        (`blockcodec.BlockCodec`): a fact of construction (`linear.CalibratedLinearPredictor` given a calibration)."""
        return False

    @classmethod
    def build(cls, *, calibration=None, model: torch.nn.Module | None = None, settings: PredictorSettings,
              portable: bool = False) -> Predictor:
        """The predictor `registry.make_predictor` returns, its requirements already checked and ``settings`` an
        instance of its `settings` class; a predictor that needs neither calibration nor model, nor settings, is
        built from ``portable`` alone."""
        return cls(portable=portable)

    @abstractmethod
    def session(self, inputs: BlockInputs) -> PredictorSession:
        """Start predicting one block of one layer."""

    def sessions(self, inputs: list[BlockInputs]) -> list[PredictorSession]:
        """Sessions of blocks of one layer that a decoder runs together (every `PredictorSession` call of a kind
        made for each block before the next kind's); a predictor may share work between them (one session per
        block by default)."""
        return [self.session(block) for block in inputs]

    def below_depth(self) -> int:
        """How many layers below a block its session reads (`BlockInputs.below`); 0 lets a cache decode
        each layer on its own."""
        return MAX_BELOW

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Small tensors the encoder computes from a block and stores with it; both sides then find them
        in `BlockInputs.extras`. Per batch row (dim 0), so blocks can be reordered by row."""
        return {}

    #: True when its statistics are exact float32 values every CPU computes alike whatever `portable` says (read
    #: from side data): a file or a stored chunk is then coded exactly as generation codes, and loads adopt its
    #: blocks without decoding them (`cache.persist`)
    exact_everywhere: ClassVar[bool] = False

    #: True when a session's block never needs another block of its layer: a cache may decode a layer's blocks
    #: in one call even when the sessions read the layer below
    independent_blocks: bool = False

    #: True when its sessions are `PredictorSession.kind_independent` and need no other block of their layer: a
    #: cache decodes a layer's blocks together, one codec call per kind
    kind_batched: bool = False

    #: True when the sessions `sessions` shares between a layer's blocks also take an encoder's calls (`predict` /
    #: `observe` head by head): a seal or a save of many blocks then computes them together
    encodes_together: ClassVar[bool] = False

    #: True when it fits on the cache's own blocks (`history`, `absorb`): the codec asks `history` before every
    #: session only then
    self_fitting: ClassVar[bool] = False

    def predict_blocks(self, side: dict[str, torch.Tensor], blocks: int,
                       heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and std of every stream of ``blocks`` same-shaped blocks of one layer in one call, for a
        predictor whose sessions read nothing but their block's side data (no positions, layers below or
        extras): ``side`` holds each side tensor of every block's rows, ``[blocks * batch, ...]`` (block-major);
        the result is ``[blocks, 2 * heads, batch, 1 or tokens, head_dim]``, equal to each block's
        `PredictorSession.predict_all`. None (the default): no batched form, the cache opens a session per
        block. It saves the per-block Python of a decode step, and lets the blocks decode straight into the
        tensors attention reads (docs/results/codec.md 12.5)."""
        return None

    def predict_blocks_per_kind(self, side: dict[str, torch.Tensor], blocks: int,
                                heads: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """`predict_blocks` for blocks whose keys and values differ in width: kind -> mean and std of its streams,
        ``[blocks, heads, batch, 1 or tokens, width]`` each, equal to each block's `PredictorSession.predict` of
        them. None (the default): the cache opens a session per block."""
        return None

    def history(self, layer: int, start: int) -> int | None:
        """For predictors fitted on the cache's own blocks: None when a block of ``layer`` at ``start`` can be
        coded now, else the start of the earlier block of ``layer`` it must see first (decoded, then
        passed to `absorb`). The cache asks before every session."""
        return None

    def absorb(self, layer: int, start: int, below_keys: torch.Tensor, keys: torch.Tensor) -> None:
        """See `history`: a block held decoded (not decoded again) that the predictor asked for."""
        return None

    def forget_state(self) -> None:
        """The cache's blocks changed (crop, row selection, reset): drop what was fitted on them."""
        return None

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors the predictor holds between steps (counted in ``held_bytes``)."""
        return []

    def block_side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                        start: int) -> dict[str, torch.Tensor]:
        """`side_data` of the block at positions ``start..``: what the cache calls (a predictor whose side data
        depends on the positions overrides this; `side_data` then gives the shapes)."""
        return self.side_data(layer, keys, values)

    def blocks_side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                         starts: list[int]) -> dict[str, torch.Tensor]:
        """`block_side_data` of ``len(starts)`` same-shaped blocks at once: ``keys`` / ``values`` their rows
        block-major (``[blocks * batch, heads, tokens, width]``), each side tensor likewise. Block by block here; a
        predictor whose side data is per row and position-free computes them in one pass."""
        batch = keys.shape[0] // len(starts)
        parts = [self.block_side_data(layer, keys[i * batch : (i + 1) * batch], values[i * batch : (i + 1) * batch],
                                      at) for i, at in enumerate(starts)]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    def model_extras(self, token_ids: torch.Tensor) -> ExtrasSource | None:
        """Inputs computed by rerunning (part of) the model on the cached tokens, or None if not needed."""
        return None


#: name -> predictor class, filled by `register` when a predictor module is imported (`registry` imports them all)
REGISTERED: dict[str, type[Predictor]] = {}


def register(cls: type[Predictor]) -> type[Predictor]:
    """Class decorator: list ``cls`` as predictor ``cls.name`` (`registry` derives every list of names from it)."""
    if cls.name in REGISTERED:
        raise ValueError(f"predictor {cls.name!r} is registered twice ({REGISTERED[cls.name].__qualname__}, "
                         f"{cls.__qualname__})")
    REGISTERED[cls.name] = cls
    return cls


class ExtrasSource(ABC):
    """Per-block slices of inputs computed once for a whole token sequence."""

    @abstractmethod
    def extras(self, layer: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Extras of tokens ``start:stop`` at ``layer``."""
