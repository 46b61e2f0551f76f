"""The block codec: one lossless coding of a layer's sealed blocks, for every writer and reader of them.

A `CodedBlock` of one layer is ``rows * 2 * kv_heads`` streams, coded by the block coder (`blockcoder`: predicted,
scaled by one byte per stream, settled for `portable` predictors, coded channel-major); it is plain data (bytes,
side data, shape), with no reference to the codec that made it, so a cache adopts a file's or a stored chunk's
block by taking it. `BlockCodec` holds what coding them needs: the predictor, the codec settings of each layer
(with the calibration's marginals or not: `BlockCodec.marginals`, the one place that decides) and the lookup of
other blocks (a predictor may read the same block of the layers below). Generation (`cache.coded`, whose reader
adds the decoded pool, decode-ahead and decoding into attention's buffer on top), save, load, the prefix store
and the LMCache chunk coder code through it; `BlockCodec.codes_like` is the one rule for whether blocks one codec
coded are what another would code (adopted without decoding them).

Decoding a block of layer ``l`` needs the same block of the layers below when the predictor reads them: the codec
keeps those in a chain memo only as long as a layer above can need them (`cache.pool` says who holds what).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from .blockcoder import (
    CodedStreams,
    DecodeItem,
    EncodeItem,
    compact,
    decode_blocks,
    encode_blocks,
    encode_stacked,
    one_thread,
    scale_factors,
)
from .codec import CodecConfig, Marginal, ParameterMismatchError, coder_of
from .errors import PredictorMismatchError
from .layer.storage import Block, owned
from .predictors.base import KINDS, BlockInputs, ExtrasSource, LayerValues, Predictor, PredictorSession
from .threads import thread_plan


@dataclass
class CodedRow:
    """One batch row of a coded block: a blob and a std-scale code per stream, plus side data and, for a
    `portable` predictor, the elements whose canonical statistics the encoder lists (`blockcoder.settle_stream`)."""

    blobs: list[bytes]
    scales: array  # signed bytes ("b"): the one byte per stream that `nbytes` counts, not a list of Python ints
    side: dict[str, torch.Tensor]
    listed: torch.Tensor | None = None  # int32 [n, 4]: stream, element, mean bits, std bits (`settle_stream`); or None

    def nbytes(self) -> int:
        side = sum(t.numel() * t.element_size() for t in self.side.values())
        listed = 0 if self.listed is None else self.listed.numel() * self.listed.element_size()
        return sum(len(b) for b in self.blobs) + len(self.scales) + side + listed


class CodedBlock(Block):
    """A sealed block held as codec streams (see module docstring): ``dim`` is the keys' width, ``value_dim`` the
    values' (``dim`` unless given); ``device`` is where its decoded tensors go. Plain data: it is read through the
    codec of the layer that holds it (`cache.coded.CodedStorage`), never on its own."""

    exact = True

    def __init__(self, layer: int, start: int, tokens: int, rows: list[CodedRow], heads: int, dim: int,
                 dtype: torch.dtype, device: torch.device, *, value_dim: int | None = None):
        self.layer = layer
        self.start = start
        self.tokens = self.entries = tokens
        self.rows = rows
        self.heads = heads
        self.dim = dim
        self.value_dim = dim if value_dim is None else value_dim
        #: keys and values differ in width: coded and decoded in one codec call per kind (one shape per call),
        #: never straight into the layer's tensors or ahead of its read
        self.split = self.value_dim != dim
        self.dtype = dtype
        self.device = device
        # set once a decode has checked every stream's hash: the blobs are immutable bytes, so later decodes
        # (every step) skip that check and keep the structural ones (`codec.decode_batch`'s ``verify``)
        self.verified = False

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a CodedBlock is bytes: read it through its layer's storage (`Storage.read_all`)")

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)

    def select_rows(self, indices: torch.Tensor) -> CodedBlock:
        rows = [self.rows[i] for i in indices.tolist()]
        return CodedBlock(self.layer, self.start, self.tokens, rows, self.heads, self.dim, self.dtype, self.device,
                          value_dim=self.value_dim)

    def to(self, device: torch.device | str) -> CodedBlock:
        return self  # bytes live on the host; decoded tensors go to self.device


class BlockCodec:
    """Encode and decode one cache's (or file's, or chunk's) blocks: ``predictor``, ``codec_config`` (its
    ``marginal`` per layer from ``calibration`` when the predictor is calibrated: `marginals`), ``find_block(layer,
    start)`` the block of ``layer`` that starts at ``start`` (the layer-below lookup), ``workers`` codec threads.
    ``decodes`` counts block decodes, so tests and benchmarks can see the work."""

    def __init__(self, predictor: Predictor, codec_config: CodecConfig, calibration=None,
                 find_block: Callable[[int, int], Block | None] | None = None, workers: int | None = 1):
        self.predictor = predictor
        self.codec_config = codec_config
        self.calibration = calibration
        #: the calibrated p_hat of a layer, or None for the codec's default: only a calibrated predictor codes
        #: with the calibration's marginals, in generation, files, the store and chunk payloads alike, so that a
        #: file of the blocks generation coded loads without decoding (the marginals gain 0.001 bit/scalar for
        #: ``generic``: not worth holding); and only where the coder reads them (`Coder.reads_marginal`: ``huff``
        #: does not, so its streams are the same bytes without them and nothing holds them for it)
        self.marginals: Callable[[int], Marginal] | None = None
        if calibration is not None and predictor.calibrated and coder_of(codec_config).reads_marginal:
            self.marginals = self._marginal
        self._marginals: dict[int, tuple[torch.Tensor, Marginal]] = {}  # the calibration's tensor and its view
        self.find_block = find_block or (lambda layer, start: None)
        self.workers = workers if workers is not None else thread_plan().codec  # LosslessConfig.workers=None
        self.extras_source: ExtrasSource | None = None
        #: decoded blocks kept across reads (a cache's `cache.pool.DecodedPool`: ``holds``, ``get``, ``wants``,
        #: ``offer``), consulted before the chain memo; None: only the memo
        self.pool = None
        #: layers of the model (None while unknown): the top layer's blocks need no chain memo entry
        self.layer_count: int | None = None
        self.depth = predictor.below_depth()
        self.decodes = 0
        self._chain: dict[tuple[int, int], tuple[Block, LayerValues]] = {}
        self._highest = 0  # the highest layer kept so far, and the layer count it implies once a pass ends
        self._passed_layers: int | None = None
        self._codecs: dict[int, tuple[Marginal, CodecConfig]] = {}  # `codec_for`'s memo

    @classmethod
    def over(cls, settings, predictor: Predictor, calibration, find: Callable[[int, int], Block | None],
             **kwargs) -> BlockCodec:
        """A codec with ``predictor`` and the codec and workers of ``settings`` (a `LosslessConfig`), finding
        blocks with ``find``: a cache's own or a file's."""
        return cls(predictor, settings.codec_config(), calibration, find, settings.workers, **kwargs)

    # ------------------------------------------------------------------ coding

    def codec_for(self, layer: int) -> CodecConfig:
        marginal = self.marginals(layer) if self.marginals is not None else None
        if marginal is None:
            return self.codec_config
        # one object per layer: the block coder groups a call's streams by their setting's identity
        if self._codecs.get(layer, (None,))[0] is not marginal:
            self._codecs[layer] = (marginal, replace(self.codec_config, marginal=marginal))
        return self._codecs[layer][1]

    def _marginal(self, layer: int) -> Marginal:
        if layer not in self._marginals:
            tensor = self.calibration.marginal_tensor(layer)
            self._marginals[layer] = (tensor, Marginal.from_tensor(tensor))
        return self._marginals[layer][1]

    def marginal_tensors(self) -> list[torch.Tensor]:
        """The calibration's marginal tensors this codec's marginals view: held while it holds them, whether or
        not the calibration still does (`cache.report` counts them once)."""
        return [tensor for tensor, _ in self._marginals.values()]

    def codes_like(self, other: BlockCodec) -> bool:
        """Whether blocks ``other`` coded are byte for byte what this codec codes, so that they are taken as they
        are (a load adopting a file's blocks, a save or a store put taking generation's): the same predictor, one
        whose statistics every CPU computes alike whatever `Predictor.portable` says, the same codec settings and
        the same marginals for every layer."""
        return (self.predictor.name == other.predictor.name and self.predictor.exact_everywhere
                and other.predictor.exact_everywhere and self.codec_config == other.codec_config
                and self._marginal_source() == other._marginal_source())

    def _marginal_source(self) -> object:
        """What `codec_for`'s marginals come from: None (the codec's default) or the calibration's tensors."""
        if self.marginals is None:
            return None
        return self.calibration.meta.get("tensors_sha256") or id(self.calibration)

    def encode_block(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> CodedBlock:
        """Code ``keys`` / ``values`` (``[rows, heads, tokens, width]``) of ``layer`` starting at text position
        ``start``; the block's decoded tensors will go to ``keys``' device."""
        return self.encode_blocks(layer, keys, values, start, keys.shape[-2])[0]

    def encode_blocks(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int,
                      tokens: int) -> list[CodedBlock]:
        """`encode_block` of consecutive blocks of ``tokens`` each: ``keys`` / ``values`` ``[rows, heads, count *
        tokens, width]`` from text position ``start`` (a prefill or a load seals many at once). Coded in one pass:
        their side data in one call (`Predictor.blocks_side_data`), their statistics in one call where the
        predictor predicts blocks together (`Predictor.predict_blocks`: `blockcoder.encode_stacked`, every stream
        scaled at once), else a session per block; every block's streams in one codec call per shape. A
        self-fitting predictor codes them one by one (a block's session reads what the earlier ones fitted)."""
        total = keys.shape[-2]
        if tokens <= 0 or total % tokens or not total:
            raise ValueError(f"layer {layer}: {total} tokens are not whole blocks of {tokens}")
        if self.predictor.self_fitting and total > tokens:
            return [self.encode_blocks(layer, keys[..., at : at + tokens, :], values[..., at : at + tokens, :],
                                       start + at, tokens)[0] for at in range(0, total, tokens)]
        with one_thread():
            batch, heads, _, dim = keys.shape
            count, device = total // tokens, keys.device  # where the blocks' decoded tensors go
            starts = [start + i * tokens for i in range(count)]
            # block-major host copies [blocks, rows, heads, tokens, width] (never pinning the residual they came
            # from), each block's tensors contiguous
            kb, vb = (t.cpu().unflatten(2, (count, tokens)).permute(2, 0, 1, 3, 4).contiguous() for t in (keys, values))
            side = self.predictor.blocks_side_data(layer, kb.flatten(0, 1), vb.flatten(0, 1), starts)
            # each block's own tensors (what its session finishes with): the pool and the chain memo then share
            # them (`owned`) instead of copying a view of all of them each
            own = [(k.clone(), v.clone()) for k, v in zip(kb, vb)]
            stacked = None
            if self.extras_source is None and self.depth == 0 and kb.shape[-1] == vb.shape[-1]:
                stacked = self.predictor.predict_blocks(side, count, heads)
            if stacked is not None:  # sessions that are `PlainSession`s with nothing below (`record_decoded`)
                coded = encode_stacked(kb, vb, *stacked, self.codec_for(layer), self.workers)
                finished = [LayerValues(k, v, torch.ones(batch, tokens)) for k, v in own]
            else:
                inputs = [self._inputs(layer, at, tokens, batch, _rows(side, i, batch)) for i, at in enumerate(starts)]
                sessions = self.predictor.sessions(inputs) if self.predictor.encodes_together \
                    else [self.predictor.session(block) for block in inputs]
                # the marginals after the sessions: a predictor's first session may release the calibration's
                # tensors (`BelowPredictor.layer_heads`), which a marginal read before would then hold twice
                config = self.codec_for(layer)
                coded = encode_blocks([EncodeItem(session, *own[i], config) for i, session in enumerate(sessions)],
                                      self.workers)
                finished = [session.finish(*own[i]) for i, session in enumerate(sessions)]
            blocks = []
            for i, at in enumerate(starts):
                rows = [CodedRow(coded[i].blobs[b], coded[i].codes[b],
                                 {name: t[i * batch + b].clone() for name, t in side.items()}, _listing(coded[i], b))
                        for b in range(batch)]
                block = CodedBlock(layer, at, tokens, rows, heads, dim, kb.dtype, device, value_dim=vb.shape[-1])
                self._sealed(block, *own[i], finished[i])
                blocks.append(block)
        return blocks

    def _sealed(self, block: CodedBlock, keys: torch.Tensor, values: torch.Tensor, finished: LayerValues) -> None:
        """Bookkeeping of a block just coded from ``keys`` / ``values``: what its session finished is kept as a
        decode's would be (a cache's coding counts its raw bytes first)."""
        self._keep(block, finished)

    def decoded(self, block: CodedBlock) -> LayerValues:
        """The block's exact keys and values (and surprise) on the host, decoding it (and what it needs) if not
        held."""
        found = self._held(block)
        if found is None:
            with one_thread():
                found = self.decode_blocks([block])[0]
        else:
            self._keep(block, found)  # advances the chain memo as a decode would
        return found

    def decoded_layer(self, blocks: list[CodedBlock]) -> list[LayerValues]:
        """`decoded` of several blocks of one layer, in position order: those not held decoded in one
        `decode_blocks` call when no block's session depends on another's decode (a `Predictor.kind_batched`
        predictor, or one that reads no layer below and is not `Predictor.self_fitting`: sessions that change the
        predictor as they finish), else one by one."""
        found = self.held_of(blocks, keep=True)
        missing = [b for b, v in zip(blocks, found) if v is None]
        if len(missing) > 1 and (self.predictor.kind_batched or self.depth == 0) and not self.predictor.self_fitting:
            with one_thread():
                decoded = iter(self.decode_blocks(missing))
            return [next(decoded) if v is None else v for v in found]
        return [self.decoded(b) if v is None else v for b, v in zip(blocks, found)]

    def decode_blocks(self, blocks: list[CodedBlock]) -> list[LayerValues]:
        """Decode ``blocks`` (of one layer when more than one, under `decoded_layer`'s rule; one codec call per
        kind and shape) through their sessions."""
        items, inputs = [], []
        for block in blocks:
            side = {name: torch.stack([row.side[name] for row in block.rows]) for name in block.rows[0].side}
            inputs.append(self._inputs(block.layer, block.start, block.tokens, len(block.rows), side))
        for block, session in zip(blocks, self.predictor.sessions(inputs)):
            listed = [[_listed_of(row, index) for index in range(2 * block.heads)] for row in block.rows] \
                if session.portable else None
            coded = CodedStreams([row.scales for row in block.rows], [row.blobs for row in block.rows], listed)
            items.append(DecodeItem(session, coded, block.heads, block.tokens, block.dim, block.value_dim, block.dtype,
                                    self.codec_for(block.layer), verify=not block.verified))
        try:
            decoded = decode_blocks(items, self.workers)
        except ParameterMismatchError as err:
            first = blocks[0]
            raise PredictorMismatchError(
                f"layer {first.layer}, tokens {first.start}..{blocks[-1].start + blocks[-1].tokens}: the "
                f"'{self.predictor.name}' predictor did not reproduce the means it was encoded with "
                f"(different thread count, CPU, library version or calibration?): {err}"
            ) from err
        return self.record_decoded(blocks, decoded, [item.session for item in items])

    def predict_together(self, blocks: list[CodedBlock]) -> tuple[list[PredictorSession] | None, dict] | None:
        """Sessions and statistics of same-shaped blocks decoded together, or None if a session is not
        independent (or `portable`: `decode_blocks` settles its statistics). The statistics come per part of a
        block's streams, each part a codec call: ``"kv"``, all ``2 * heads`` streams (keys and values of one
        width), else ``"k"`` and ``"v"``: means and stds ``[streams, batch, width, 1 or tokens]`` per block, the
        std scaled by the block's per-stream codes. A predictor with a batched form (`Predictor.predict_blocks`,
        `Predictor.predict_blocks_per_kind`) predicts them all at once: sessions None, one ``[blocks, ...]``
        tensor each."""
        first = blocks[0]
        batch, heads, tokens = len(first.rows), first.heads, first.tokens
        factors, side = self._factors_and_side(blocks)
        scales = {"k": factors[:, :heads], "v": factors[:, heads:]} if first.split else {"kv": factors}
        if side is not None:
            if first.split:
                batched = self.predictor.predict_blocks_per_kind(side, len(blocks), heads)
            else:
                together = self.predictor.predict_blocks(side, len(blocks), heads)
                batched = None if together is None else {"kv": together}
            if batched is not None:
                return None, {part: (mean.transpose(-1, -2), std.transpose(-1, -2) * scales[part])
                              for part, (mean, std) in batched.items()}
        sessions: list[PredictorSession] = []
        parts: dict[str, tuple[list, list]] = {part: ([], []) for part in scales}
        for i, block in enumerate(blocks):
            side = {name: torch.stack([row.side[name] for row in block.rows]) for name in block.rows[0].side}
            session = self.predictor.session(self._inputs(block.layer, block.start, tokens, batch, side))
            if not session.independent or session.portable:
                return None
            sessions.append(session)
            if not first.split:
                mean, std = session.predict_all(heads)  # [2 * heads, batch, tokens or 1, dim]
                parts["kv"][0].append(mean.transpose(-1, -2))
                parts["kv"][1].append(std.transpose(-1, -2) * factors[i])
                continue
            for kind in KINDS:
                pairs = [session.predict(kind, head) for head in range(heads)]  # [batch, tokens, width] each
                # broadcast (stride-0) token dimensions stay size 1, as the encoder's `compact` statistics
                parts[kind][0].append(torch.stack([compact(m) for m, _ in pairs]).transpose(-1, -2))
                parts[kind][1].append(torch.stack([compact(s) for _, s in pairs]).transpose(-1, -2) * scales[kind][i])
        return sessions, parts

    def _factors_and_side(self, blocks: list[CodedBlock]) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """What predicting ``blocks`` together starts from: each stream's std factor ``[blocks, 2 * heads, batch,
        1, 1]`` (the float32 factors `scale_factor` gives the encoder), and the blocks' side data stacked over
        blocks and rows where the predictor may predict them in one call (nothing from the model, no layer below;
        else None). Self-fitting predictors see the earlier blocks first (`_catch_up`)."""
        codes = np.array([[row.scales for row in block.rows] for block in blocks], dtype=np.int64)
        factors = scale_factors(codes).transpose(1, 2)[..., None, None]
        for block in blocks:
            self._catch_up(block.layer, block.start)
        if self.extras_source is not None or self.depth != 0:
            return factors, None
        side = {name: torch.stack([row.side[name] for block in blocks for row in block.rows])
                for name in blocks[0].rows[0].side}
        return factors, side

    def record_decoded(self, blocks: list[CodedBlock], decoded: list[tuple[torch.Tensor, torch.Tensor]],
                       sessions: list[PredictorSession] | None = None) -> list[LayerValues]:
        """Bookkeeping of blocks just decoded (each block's keys and values ``[rows, heads, tokens, width]``):
        shown to their sessions (None: predicted without one, a `PlainSession` with nothing below), checked,
        counted, offered to the pool (which copies what it keeps)."""
        out = []
        for i, (block, (keys, values)) in enumerate(zip(blocks, decoded)):
            if sessions is None:  # PlainSession.finish of a block with nothing below
                found = LayerValues(keys, values, torch.ones(len(block.rows), block.tokens))
            else:
                found = sessions[i].finish(keys, values)
            block.verified = True
            self.decodes += 1
            self._keep(block, found)
            out.append(found)
        return out

    def held_of(self, blocks: list[Block], *, keep: bool = False) -> list[LayerValues | None]:
        """Each coded block's values where held decoded (None for the others); ``keep``: a held block advances the
        chain memo as a decode would."""
        found = [self._held(b) if isinstance(b, CodedBlock) else None for b in blocks]
        if keep:
            for block, values in zip(blocks, found):
                if values is not None:
                    self._keep(block, values)
        return found

    def mismatch(self, layer: int, err: ParameterMismatchError) -> PredictorMismatchError:
        return PredictorMismatchError(
            f"layer {layer}: the '{self.predictor.name}' predictor did not reproduce the statistics the blocks "
            f"were encoded with: {err}"
        )

    # ------------------------------------------------------------------ what a block's session reads

    def _catch_up(self, layer: int, start: int) -> None:
        """Show a self-fitting predictor the earlier blocks of ``layer`` it has not seen (after a structural
        change or a load), in position order, so that it fits the same maps the encoder did."""
        if not self.predictor.self_fitting:
            return
        while (wanted := self.predictor.history(layer, start)) is not None:
            block = self.find_block(layer, wanted)
            if block is None:
                raise RuntimeError(f"lossless: the '{self.predictor.name}' predictor needs layer {layer}'s block at "
                                   f"{wanted}, which is gone")
            held = self._held(block) if isinstance(block, CodedBlock) else None
            if held is None and isinstance(block, CodedBlock):
                self.decoded(block)  # its session's finish() shows it to the predictor
                continue
            keys = held.keys if held is not None else block.read()[0].cpu()
            below = self._below(layer, wanted, 1)
            self.predictor.absorb(layer, wanted, below.keys, keys)
            if self.predictor.history(layer, start) == wanted:
                raise RuntimeError(f"lossless: the '{self.predictor.name}' predictor did not take block {wanted}")

    def _inputs(self, layer: int, start: int, tokens: int, batch: int, side: dict) -> BlockInputs:
        self._catch_up(layer, start)
        extras = dict(side)
        if self.extras_source is not None:
            extras.update(self.extras_source.extras(layer, start, start + tokens))
        below = self._below(layer, start, self.depth) if layer > 0 and self.depth > 0 else None
        return BlockInputs(layer, batch, torch.arange(start, start + tokens), below, extras)

    def _below(self, layer: int, start: int, depth: int) -> LayerValues | None:
        """Layer ``layer - 1``'s block at ``start`` with ``depth - 1`` further layers chained below it."""
        if depth <= 0 or layer <= 0:
            return None
        current = self.find_block(layer - 1, start)
        if current is None:
            # unsealed a moment ago (crop goes up the layers); the memo still has its exact values, and every
            # structural change of the cache clears the memo (`forget`), so the entry is of these tokens
            hit = self._chain.get((layer - 1, start))
            if hit is None:
                raise RuntimeError(f"lossless: layer {layer} needs layer {layer - 1}'s block at {start}, which is gone")
            found = hit[1]
        elif isinstance(current, CodedBlock):
            found = self._held(current)
            if found is None:
                found = self.decoded(current)
        else:  # a raw block below (mode mix): its values are exact
            k, v = current.read()
            found = LayerValues(k.cpu(), v.cpu(), torch.ones(k.shape[0], k.shape[2]))
        return LayerValues(found.keys, found.values, found.surprise, self._below(layer - 1, start, depth - 1))

    def _held(self, block: Block) -> LayerValues | None:
        """The block's values if held decoded (in the pool or the chain memo)."""
        found = self.pool.get(block) if self.pool is not None and self.pool.holds else None
        if found is not None:
            return found
        hit = self._chain.get((block.layer, block.start))
        return hit[1] if hit is not None and hit[0] is block else None

    def _keep(self, block: Block, values: LayerValues) -> None:
        """Store what the next layers and steps may need; drop what no layer above can need any more."""
        if self.pool is not None and self.pool.holds and self.pool.wants(block, values):
            self.pool.offer(block, flat_values(values))
        if self.depth == 0:
            return
        layer, start = block.layer, block.start
        flat = flat_values(values)
        count = self.layer_count or self._passed_layers
        if count is None:
            # without a model the top layer is unknown until a pass up the layers ends: a layer-0 block after
            # higher layers starts the next pass, so the memo's entries above layer 0 are the last pass's
            if layer == 0 and self._highest > 0:
                self._passed_layers = count = self._highest + 1
                for key in [key for key in self._chain if key[0] > 0]:
                    del self._chain[key]
            self._highest = max(self._highest, layer)
        # layer + 1 reads layers layer .. layer + 1 - depth: anything below that is done for this step
        for old in range(layer - self.depth, -1, -1):
            if self._chain.pop((old, start), None) is None:
                break
        if count is not None and layer >= count - 1:  # the top layer: nobody above reads this block
            for old in range(layer - 1, layer - self.depth, -1):
                self._chain.pop((old, start), None)
            return
        self._chain[(layer, start)] = (block, flat)

    def chain_tensors(self) -> list[torch.Tensor]:
        """Every decoded tensor the chain memo holds."""
        return [t for _, values in self._chain.values() for t in (values.keys, values.values, values.surprise)]

    def forget(self) -> None:
        """The blocks changed (crop, row selection, reset): drop the memo and what the predictor fitted."""
        self._chain.clear()
        self.predictor.forget_state()


def flat_values(values: LayerValues) -> LayerValues:
    """``values`` without its ``below`` chain, every tensor owned (what the chain memo and the cache's pool keep)."""
    return LayerValues(owned(values.keys), owned(values.values), owned(values.surprise), None)


def _rows(side: dict[str, torch.Tensor], block: int, batch: int) -> dict[str, torch.Tensor]:
    """Block ``block``'s rows of side data stacked block-major (``[blocks * batch, ...]``)."""
    return {name: t[block * batch : (block + 1) * batch] for name, t in side.items()}


def _listing(coded: CodedStreams, row: int) -> torch.Tensor | None:
    """`CodedRow.listed` of ``coded``'s batch row ``row``: its streams' listed elements as one int32 ``[n, 4]``
    (stream, element, mean bits, std bits), or None when nothing is listed."""
    if coded.listed is None:
        return None
    parts = [np.concatenate([np.full((entries.shape[0], 1), stream, np.int32), entries], 1)
             for stream, entries in enumerate(coded.listed[row]) if entries.shape[0]]
    return torch.from_numpy(np.concatenate(parts)) if parts else None


def _listed_of(row: CodedRow, stream: int) -> np.ndarray:
    """The entries of ``row``'s list for ``stream``, int32 ``[n, 3]`` (element, mean bits, std bits)."""
    if row.listed is None or not row.listed.shape[0]:
        return np.zeros((0, 3), np.int32)
    entries = row.listed.numpy()
    return entries[entries[:, 0] == stream, 1:]
