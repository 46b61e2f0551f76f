"""Lossless storage: a sealed block held only as codec streams, predicted from what the decoder knows.

A block of one layer is ``rows * 2 * kv_heads`` streams, coded by the block coder (`hf_kvcompress.blockcoder`:
predicted, scaled by one byte per stream, settled for `portable` predictors, coded channel-major). Keys and values
may differ in width (an MLA latent and its rotary part): such a block is coded in one codec call per kind, and a
layer's such blocks decode in one call per kind (`CodedBlock.split`). Decoding a block of layer ``l`` needs the
same block of the layers below when the predictor reads them; `LosslessCoding` keeps those only as long as a
layer above can need them (`pool`).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from ..blockcoder import (
    CodedStreams,
    DecodeItem,
    EncodeItem,
    compact,
    decode_blocks,
    decode_stacked,
    encode_blocks,
    one_thread,
    scale_factors,
)
from ..codec import (
    CodecConfig,
    CorruptStreamError,
    Marginal,
    ParameterMismatchError,
    PendingDecode,
    coder_of,
    decode_batch,
    start_decode_batch,
)
from ..errors import PredictorMismatchError
from ..layer.storage import Block, Storage, owned
from ..predictors import make_predictor
from ..predictors.base import KINDS, BlockInputs, ExtrasSource, LayerValues, Predictor, PredictorSession
from ..threads import available_cores, thread_plan
from .pool import DecodedPool, flat_values, values_tensors


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


@dataclass
class _Ahead:
    """A decode `LosslessCoding._start_ahead` began: ``blocks`` at positions ``indices`` of ``layer``'s block
    list, decoding into ``out`` (``[blocks, k/v, heads, rows, dim, tokens]``)."""

    layer: int
    indices: list[int]
    blocks: list[CodedBlock]
    out: torch.Tensor
    job: PendingDecode

    def fits(self, blocks: list[Block], coding: LosslessCoding) -> bool:
        """Whether ``blocks`` (a layer's list at its read) still hold these blocks at these places, none of
        them held decoded meanwhile."""
        return all(i < len(blocks) and blocks[i] is block and coding._held(block) is None
                   for i, block in zip(self.indices, self.blocks))


class CodedBlock(Block):
    """A sealed block held as codec streams (see module docstring): ``dim`` is the keys' width, ``value_dim`` the
    values' (``dim`` unless given)."""

    exact = True

    def __init__(self, coding: LosslessCoding, layer: int, start: int, tokens: int, rows: list[CodedRow],
                 heads: int, dim: int, dtype: torch.dtype, device: torch.device, *, value_dim: int | None = None):
        self.coding = coding
        self.layer = layer
        self.start = start
        self.tokens = self.entries = tokens
        self.rows = rows
        self.heads = heads
        self.dim = dim
        self.value_dim = dim if value_dim is None else value_dim
        #: keys and values differ in width: coded and decoded in one codec call per kind (one shape per call;
        #: `LosslessCoding._decode_together`), never straight into the layer's tensors or ahead of its read
        self.split = self.value_dim != dim
        self.dtype = dtype
        self.device = device
        # set once a decode has checked every stream's hash: the blobs are immutable bytes, so later decodes
        # (every step) skip that check and keep the structural ones (`codec.decode_batch`'s ``verify``)
        self.verified = False

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.coding.decoded(self)
        return values.keys.to(self.device), values.values.to(self.device)

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)

    def select_rows(self, indices: torch.Tensor) -> CodedBlock:
        rows = [self.rows[i] for i in indices.tolist()]
        return CodedBlock(self.coding, self.layer, self.start, self.tokens, rows, self.heads, self.dim,
                          self.dtype, self.device, value_dim=self.value_dim)

    def to(self, device: torch.device | str) -> CodedBlock:
        return self  # bytes live on the host; decoded tensors go to self.device


class LosslessCoding:
    """What every layer of one lossless cache shares: predictor, codec settings, decoded tensors.

    ``find_block(layer, start)`` returns the block of ``layer`` that starts at ``start`` (the layer-below
    lookup); ``marginals(layer)`` the calibrated p_hat of a layer, or None for the codec's default;
    ``layer_count()`` how many layers the model has (None while unknown). Decoded tensors live in the
    `DecodedPool` (``decoded_budget``: a fraction of the sealed blocks' raw bytes) and, for predictors that
    read the layers below, in a chain memo that holds a block only until no layer above can need it
    (see `pool`). ``decodes`` counts block decodes, so tests and benchmarks can see the work per step.
    """

    def __init__(
        self,
        predictor: Predictor,
        codec_config: CodecConfig,
        find_block: Callable[[int, int], Block | None],
        marginals: Callable[[int], Marginal | None] | None = None,
        workers: int | None = 1,
        *,
        decoded_budget: float = 0.0,
        layer_count: Callable[[], int | None] | None = None,
    ):
        self.predictor = predictor
        self.codec_config = codec_config
        self.find_block = find_block
        self.marginals = marginals
        self.workers = workers if workers is not None else thread_plan().codec  # LosslessConfig.workers=None
        self.extras_source: ExtrasSource | None = None
        self.layer_count = layer_count or (lambda: None)
        self.depth = predictor.below_depth()
        self.pool = DecodedPool(decoded_budget)
        #: raw bytes of every sealed block (the pool's budget is a fraction of it); refreshed by the cache
        self.sealed_raw_bytes = 0
        self.decodes = 0
        #: the blocks of a layer (set by the cache): lets a layer's read start the next layer's decode ahead
        self.blocks_of: Callable[[int], list[Block]] | None = None
        self._ahead: _Ahead | None = None
        self._chain: dict[tuple[int, int], tuple[Block, LayerValues]] = {}
        self._highest = 0  # the highest layer kept so far, and the layer count it implies once a pass ends
        self._passed_layers: int | None = None
        self._codecs: dict[int, tuple[Marginal, CodecConfig]] = {}  # `codec_for`'s memo

    # ------------------------------------------------------------------ coding

    def codec_for(self, layer: int) -> CodecConfig:
        marginal = self.marginals(layer) if self.marginals is not None else None
        if marginal is None:
            return self.codec_config
        # one object per layer: the block coder groups a call's streams by their setting's identity
        if self._codecs.get(layer, (None,))[0] is not marginal:
            self._codecs[layer] = (marginal, _with_marginal(self.codec_config, marginal))
        return self._codecs[layer][1]

    def encode_block(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> CodedBlock:
        with one_thread():
            return self._encode_block(layer, keys, values, start)

    def _encode_block(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> CodedBlock:
        batch, heads, tokens, dim = keys.shape
        device = keys.device  # where the block's decoded tensors go (the codec works on host copies)
        keys, values = owned(keys.cpu()), owned(values.cpu())  # never pin the residual the block came from
        side = self.predictor.block_side_data(layer, keys, values, start)
        session = self.predictor.session(self._inputs(layer, start, tokens, batch, side))
        [coded] = encode_blocks([EncodeItem(session, keys, values, self.codec_for(layer))], self.workers)
        rows = [CodedRow(coded.blobs[b], coded.codes[b], {name: t[b].clone() for name, t in side.items()},
                         _listing(coded, b)) for b in range(batch)]
        self.sealed_raw_bytes += (keys.numel() + values.numel()) * keys.element_size()
        block = CodedBlock(self, layer, start, tokens, rows, heads, dim, keys.dtype, device, value_dim=values.shape[-1])
        self._keep(block, session.finish(keys, values))
        return block

    def decoded(self, block: CodedBlock) -> LayerValues:
        """The block's exact keys and values (and surprise), decoding it (and what it needs) if not held."""
        found = self._held(block)
        if found is None:
            with one_thread():
                found = self._decode_block(block)
        else:
            self._keep(block, found)  # advances the chain memo as a decode would
        return found

    def read_all(self, blocks: list[Block]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of one layer's ``blocks`` on their device. Blocks not held decoded are decoded
        together in one codec call when the predictor's sessions are independent (per-block statistics:
        no block needs another's values), else one by one in layer order."""
        found: list[LayerValues | None] = [
            self._held(b) if isinstance(b, CodedBlock) else None for b in blocks
        ]
        for block, values in zip(blocks, found):
            if values is not None:
                self._keep(block, values)  # a held block advances the chain memo as a decode would
        missing = [i for i, (b, v) in enumerate(zip(blocks, found)) if v is None and isinstance(b, CodedBlock)]
        if self.predictor.kind_batched and len(missing) > 1:
            with one_thread():
                for i, values in zip(missing, self._decode_blocks([blocks[i] for i in missing])):
                    found[i] = values
        elif (self.depth == 0 or self.predictor.independent_blocks) and missing:
            groups: dict[tuple, list[int]] = {}
            for i in missing:
                b = blocks[i]
                groups.setdefault((b.tokens, len(b.rows), b.heads, b.dim, b.value_dim, b.dtype), []).append(i)
            with one_thread():
                for members in groups.values():
                    decoded = self._decode_together([blocks[i] for i in members])
                    if decoded is not None:
                        for i, values in zip(members, decoded):
                            found[i] = values
        out = []
        for block, values in zip(blocks, found):
            if not isinstance(block, CodedBlock):
                out.append(block.read())
                continue
            if values is None:
                values = self.decoded(block)
            out.append((values.keys.to(block.device), values.values.to(block.device)))
        return out

    def read_into(self, blocks: list[Block], keys: torch.Tensor, values: torch.Tensor) -> None:
        """`Storage.read_into`. When ``keys`` / ``values`` are CPU views of one buffer (as the layer hands them),
        adjacent blocks that are not held decoded go to `_decode_together` with their place in it: blocks the
        predictor predicts in one batch decode straight there, other independent ones are copied there once.
        Everything else is read as by `read_all` and copied."""
        at, direct = [], [False] * len(blocks)
        position = 0
        for block in blocks:
            at.append(position)
            position += block.entries
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead.fits(blocks, self):
                self._take_ahead(ahead, blocks, keys, values, at, direct)
            else:  # blocks changed since (rows selected, cropped, a structural change): not needed any more
                ahead.job.cancel()
            del ahead  # its buffers go before the next layer's are allocated (peak RSS: docs/results/codec.md 12.5)
        runs: list[list[int]] = []  # same-shaped blocks not held decoded, in runs of adjacent positions
        for i, block in enumerate(blocks):
            if direct[i] or not isinstance(block, CodedBlock) or self.depth != 0 or block.split or \
                    self._held(block) is not None:
                continue
            if runs and runs[-1][-1] == i - 1 and _same_shape(blocks[i - 1], block):
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            into = _destination(keys, values, at[run[0]], len(run), blocks[run[0]])
            if into is None:
                continue
            with one_thread():
                if self._decode_together([blocks[i] for i in run], into=into) is not None:
                    for i in run:
                        direct[i] = True
        rest = [i for i in range(len(blocks)) if not direct[i]]
        if rest:
            for i, (k, v) in zip(rest, self.read_all([blocks[i] for i in rest])):
                n = k.shape[-2]
                keys[..., at[i] : at[i] + n, :].copy_(k)
                values[..., at[i] : at[i] + n, :].copy_(v)
        if blocks and isinstance(blocks[0], CodedBlock):
            self._start_ahead(blocks[0].layer + 1)

    def _start_ahead(self, layer: int) -> None:
        """Start decoding ``layer``'s blocks on the other codec threads while the model computes the layer below
        (their decode needs nothing from it when the predictor reads no layer below): a `DecodeJob` in chunks,
        which the layer's read finishes on its own thread (`_take_ahead`). Only for predictors that predict a
        layer's blocks in one batch, on the CPU, with ``workers`` >= 2 and torch's own threads leaving a core free:
        beside torch on every core its OpenMP threads spin on the others between operations, and a step with the
        decode ahead measured 8.3x DynamicCache's against 7.7x without (docs/results/codec.md 12.5)."""
        count = self.layer_count() or self._passed_layers
        if self.workers < 2 or self.depth != 0 or self.blocks_of is None or count is None or layer >= count:
            return
        if torch.get_num_threads() >= available_cores():
            return
        blocks = self.blocks_of(layer)
        run: list[int] = []
        for i, block in enumerate(blocks):  # the first run of adjacent same-shaped blocks not held decoded
            if isinstance(block, CodedBlock) and not block.split and self._held(block) is None and (
                    not run or (run[-1] == i - 1 and _same_shape(blocks[run[-1]], block))):
                run.append(i)
            elif run:
                break
        if not run or blocks[run[0]].device.type != "cpu":
            return
        chosen = [blocks[i] for i in run]
        first = chosen[0]
        with one_thread():
            predicted = self._predict_together(chosen)
        config = self.codec_for(layer)
        if predicted is None or predicted[0] is not None or not coder_of(config).batched:
            return
        means, stds = predicted[1]["kv"]
        blobs, verify = _batch_streams(chosen)
        out = torch.empty((len(chosen), 2, first.heads, len(first.rows), first.dim, first.tokens), dtype=first.dtype)
        # chunks of ~3 streams at 2,048 tokens: 32 chunks a layer beat 8 by 2-6 % in an A/B (the last chunk one
        # thread waits for is shorter)
        try:
            job = start_decode_batch(blobs, means.flatten(0, 2), stds.flatten(0, 2), config, out,
                                     threads=self.workers - 1, verify=verify, chunks=16 * self.workers)
        except (CorruptStreamError, ParameterMismatchError):
            return  # the layer's own read decodes these blocks and raises this error where it belongs
        if job is not None:  # None: these blocks decode on a device (Triton), where the layer's read decodes them
            self._ahead = _Ahead(layer, run, chosen, out, job)

    def _take_ahead(self, ahead: _Ahead, blocks: list[Block], keys: torch.Tensor, values: torch.Tensor,
                    at: list[int], direct: list[bool]) -> None:
        """Finish the decode `_start_ahead` began for these blocks and put them where attention reads them."""
        try:
            ahead.job.finish()
        except ParameterMismatchError as err:
            raise self._mismatch(ahead.layer, err) from err
        into = _destination(keys, values, at[ahead.indices[0]], len(ahead.blocks), ahead.blocks[0])
        if into is not None:
            into.copy_(ahead.out)
        for i, block, decoded in zip(ahead.indices, ahead.blocks, self._record_decoded(ahead.blocks, _views(ahead.out))):
            if into is None:
                keys[..., at[i] : at[i] + block.tokens, :].copy_(decoded.keys)
                values[..., at[i] : at[i] + block.tokens, :].copy_(decoded.values)
            direct[i] = True

    def _decode_together(self, blocks: list[CodedBlock], into: torch.Tensor | None = None) -> list[LayerValues] | None:
        """Decode same-shaped blocks whose sessions are independent in one codec call per part of their streams
        (`_predict_together`; None if they are not independent), also into ``into`` when given (`_destination`):
        in place when the predictor predicted them in one batch.

        When the predictor reads no layer below (``depth == 0``: its sessions never look at decoded values),
        the blocks decode into tensors on their own device: on a CUDA model with Triton the codec's decoder
        runs there (`codec.decode_batch`), and the decoded blocks (the pool's included) stay there. Other
        predictors compute on host values, so their blocks decode on the host."""
        first = blocks[0]
        predicted = self._predict_together(blocks)
        if predicted is None:
            return None
        sessions, parts = predicted
        config = self.codec_for(first.layer)
        if into is not None and sessions is None and coder_of(config).batched:  # (`into` is None for split blocks)
            return self._decode_in_place(blocks, *parts["kv"], config, into)
        device = first.device if self.depth == 0 else torch.device("cpu")
        count, batch, heads, tokens = len(blocks), len(first.rows), first.heads, first.tokens
        verify = [not block.verified for block in blocks]
        decoded = {}
        try:
            for part, (means, stds) in parts.items():
                lo, hi, width = {"kv": (0, 2 * heads, first.dim), "k": (0, heads, first.dim),
                                 "v": (heads, 2 * heads, first.value_dim)}[part]
                blobs = [row.blobs[index] for block in blocks for index in range(lo, hi) for row in block.rows]
                x = decode_stacked(blobs, means, stds, config, shape=(width, tokens), dtype=first.dtype, device=device,
                                   threads=self.workers, verify=verify)
                decoded[part] = x.view(count, hi - lo, batch, width, tokens)  # blob order: block, stream, row
        except ParameterMismatchError as err:
            raise self._mismatch(first.layer, err) from err
        if "kv" in decoded:
            # [blocks, k/v, heads, rows, dim, tokens] -> [blocks, k/v, rows, heads, tokens, dim]
            x = decoded["kv"].view(count, 2, heads, batch, first.dim, tokens).permute(0, 1, 3, 2, 5, 4).contiguous()
            if into is not None:  # sessions keep what `finish` gets, so they get x, and the destination a copy
                into.copy_(x.permute(0, 1, 3, 2, 5, 4))
            pairs = [(x[i, 0], x[i, 1]) for i in range(count)]
        else:  # [blocks, heads, rows, width, tokens] -> [blocks, rows, heads, tokens, width], per kind
            keys, values = (decoded[kind].permute(0, 2, 1, 4, 3).contiguous() for kind in KINDS)
            pairs = [(keys[i], values[i]) for i in range(count)]
        return self._record_decoded(blocks, pairs, sessions)

    def _decode_in_place(self, blocks: list[CodedBlock], means: torch.Tensor, stds: torch.Tensor,
                         config: CodecConfig, into: torch.Tensor) -> list[LayerValues]:
        """Blocks predicted in one batch, decoded in one codec call into ``into`` (`_destination`)."""
        blobs, verify = _batch_streams(blocks)
        try:
            decode_batch(blobs, means.flatten(0, 2), stds.flatten(0, 2), config, out=into, threads=self.workers,
                         verify=verify)
        except ParameterMismatchError as err:
            raise self._mismatch(blocks[0].layer, err) from err
        return self._record_decoded(blocks, _views(into))

    def _record_decoded(self, blocks: list[CodedBlock], decoded: list[tuple[torch.Tensor, torch.Tensor]],
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

    def _mismatch(self, layer: int, err: ParameterMismatchError) -> PredictorMismatchError:
        return PredictorMismatchError(
            f"layer {layer}: the '{self.predictor.name}' predictor did not reproduce the statistics the blocks "
            f"were encoded with: {err}"
        )

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

    def _predict_together(self, blocks: list[CodedBlock]) -> tuple[list[PredictorSession] | None, dict] | None:
        """Sessions and statistics of same-shaped blocks decoded together, or None if a session is not
        independent (or `portable`: `_decode_block` settles its statistics). The statistics come per part of a
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

    def _held(self, block: Block) -> LayerValues | None:
        found = self.pool.get(block)
        if found is not None:
            return found
        hit = self._chain.get((block.layer, block.start))
        return hit[1] if hit is not None and hit[0] is block else None

    def _decode_block(self, block: CodedBlock) -> LayerValues:
        return self._decode_blocks([block])[0]

    def _decode_blocks(self, blocks: list[CodedBlock]) -> list[LayerValues]:
        """Decode ``blocks`` (of one layer when more than one: a `Predictor.kind_batched` predictor's, one codec
        call per kind and shape) through their sessions."""
        items = []
        for block in blocks:
            side = {name: torch.stack([row.side[name] for row in block.rows]) for name in block.rows[0].side}
            session = self.predictor.session(self._inputs(block.layer, block.start, block.tokens, len(block.rows),
                                                          side))
            streams = 2 * block.heads
            listed = [[_listed_of(row, index) for index in range(streams)] for row in block.rows] \
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
        out = []
        for block, item, (keys, values) in zip(blocks, items, decoded):
            self.decodes += 1
            block.verified = True
            found = item.session.finish(keys, values)
            self._keep(block, found)
            out.append(found)
        return out

    # ------------------------------------------------------------------ decoded tensors

    def _catch_up(self, layer: int, start: int) -> None:
        """Show a self-fitting predictor the earlier blocks of ``layer`` it has not seen (after a structural
        change or a load), in position order, so that it fits the same maps the encoder did."""
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

    def _keep(self, block: Block, values: LayerValues) -> None:
        """Store what the next layers and steps may need; drop what no layer above can need any more."""
        layer, start = block.layer, block.start
        if self.pool.wants(block, values, self.sealed_raw_bytes):
            self.pool.offer(block, flat_values(values), self.sealed_raw_bytes)
        if self.depth == 0:
            return
        flat = flat_values(values)
        count = self.layer_count() or self._passed_layers
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

    def decoded_tensors(self) -> list[torch.Tensor]:
        """Every decoded tensor held between reads (pool and chain memo; shared tensors appear twice)."""
        out = self.pool.tensors()
        for _, values in self._chain.values():
            out.extend(values_tensors(values))
        out.extend(self.predictor.state_tensors())
        if self._ahead is not None:  # between two layers' reads of a step
            out.append(self._ahead.out)
        return out

    def ahead_bytes(self) -> int:
        """Bytes a decode started ahead holds beside its output tensor (its copy of the streams), 0 if none."""
        return 0 if self._ahead is None else self._ahead.job.nbytes()

    def forget(self) -> None:
        if self._ahead is not None:
            self._ahead.job.cancel()
            self._ahead = None
        self.pool.clear()
        self._chain.clear()
        self.predictor.forget_state()
        self.sealed_raw_bytes = 0


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


class CodedStorage(Storage):
    """`Storage` of lossless mode: one per layer, sharing a `LosslessCoding`."""

    name = "lossless"

    def __init__(self, coding: LosslessCoding, layer: int):
        self.coding = coding
        self.layer = layer

    def hold(self, keys: torch.Tensor, values: torch.Tensor, *, start: int) -> CodedBlock:
        return self.coding.encode_block(self.layer, keys, values, start)

    def read_all(self, blocks: list[Block]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.coding.read_all(blocks)

    def read_into(self, blocks: list[Block], keys: torch.Tensor, values: torch.Tensor) -> None:
        self.coding.read_into(blocks, keys, values)


def _views(decoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each block's keys and values ``[rows, heads, tokens, dim]`` as views of ``decoded`` (``[blocks, k/v, heads,
    rows, dim, tokens]``, the order of a block's streams in a codec call)."""
    return [(block[0].permute(1, 0, 3, 2), block[1].permute(1, 0, 3, 2)) for block in decoded]


def _batch_streams(blocks: list[CodedBlock]) -> tuple[list[bytes], list[bool]]:
    """The streams of same-shaped blocks in codec-call order (block, k/v and head, row), and whether each still
    needs its hash checked (`CodedBlock.verified`)."""
    first = blocks[0]
    per_block = 2 * first.heads * len(first.rows)
    blobs = [row.blobs[index] for block in blocks for index in range(2 * first.heads) for row in block.rows]
    return blobs, [not block.verified for block in blocks for _ in range(per_block)]


def _same_shape(a: CodedBlock, b: CodedBlock) -> bool:
    return (a.tokens, len(a.rows), a.heads, a.dim, a.value_dim, a.dtype) == \
        (b.tokens, len(b.rows), b.heads, b.dim, b.value_dim, b.dtype)


def _destination(keys: torch.Tensor, values: torch.Tensor, start: int, count: int,
                 block: CodedBlock) -> torch.Tensor | None:
    """``count`` blocks shaped like ``block`` at entries ``start..`` of ``keys`` / ``values`` as one
    ``[blocks, k/v, heads, rows, dim, tokens]`` view, the order of a block's streams in a codec call; None
    unless keys and values are CPU views of one buffer, values after keys, in the block's dtype."""
    if keys.device.type != "cpu" or keys.dtype != block.dtype or values.dtype != block.dtype:
        return None
    if keys.untyped_storage().data_ptr() != values.untyped_storage().data_ptr() or keys.stride() != values.stride():
        return None
    offset = values.storage_offset() - keys.storage_offset()
    rows, heads, _, dim = keys.shape
    if offset <= 0 or block.split or (rows, heads, dim) != (len(block.rows), block.heads, block.dim):
        return None
    s_row, s_head, s_token, s_dim = keys.stride()
    return torch.as_strided(keys, (count, 2, heads, rows, dim, block.tokens),
                            (block.tokens * s_token, offset, s_head, s_row, s_dim, s_token),
                            keys.storage_offset() + start * s_token)


def _with_marginal(config: CodecConfig, marginal: Marginal) -> CodecConfig:
    return replace(config, marginal=marginal)


# ------------------------------------------------------------------ assembling a cache's lossless coding

def coding_for(cache) -> LosslessCoding:
    """The `LosslessCoding` of ``cache`` (a `CompressedCache` in lossless mode)."""
    settings = cache.config.lossless
    predictor = make_predictor(
        settings.predictor, calibration=cache.calibration, model=cache.model, probe_layer=settings.probe_layer
    )
    # model-running predictors (probe, twin) never get here: LosslessConfig refuses them for generation
    _check_layer_chain(cache, predictor)
    coding = coding_over(settings, predictor, cache.calibration, functools.partial(find_block, cache),
                         decoded_budget=settings.decoded_budget, layer_count=lambda: cache.kv_layer_count)
    coding.blocks_of = functools.partial(layer_blocks, cache)
    return coding


def coding_over(settings, predictor: Predictor, calibration, find: Callable[[int, int], Block | None],
                **kwargs) -> LosslessCoding:
    """A `LosslessCoding` with ``predictor`` and the codec and workers of ``settings`` (a `LosslessConfig`), finding
    blocks with ``find``: the cache's own (`coding_for`) or a file's (save / load). Only a calibrated predictor
    codes with ``calibration``'s marginals, in generation and in files alike, so that a file of the blocks
    generation coded loads without decoding (the marginals gain 0.001 bit/scalar for ``generic``: not worth
    holding)."""
    marginals = None
    if calibration is not None and getattr(predictor, "calibrated", False):
        marginals = functools.lru_cache(maxsize=None)(calibration.marginal)
    return LosslessCoding(predictor, settings.codec_config(), find, marginals, settings.workers, **kwargs)


def layer_blocks(cache, layer: int) -> list:
    """The sealed blocks of ``cache``'s layer ``layer`` (empty if it holds none or does not exist)."""
    if layer < 0 or layer >= len(cache.layers):
        return []
    return list(getattr(cache.layers[layer], "blocks", ()))


def find_block(cache, layer: int, start: int):
    """The sealed block of ``cache``'s layer ``layer`` that starts at text position ``start``, if any."""
    if layer < 0 or layer >= len(cache.layers):
        return None
    held = cache.layers[layer]
    for block, block_start in zip(getattr(held, "blocks", ()), getattr(held, "block_starts", ())):
        if block_start == start:
            return block
    return None


def _check_layer_chain(cache, predictor) -> None:
    """Predictors that read the layer below need every layer to keep its blocks (no sliding windows)."""
    uses_below = predictor.below_depth() > 0
    config = cache.model_config
    if not uses_below or config is None:
        return
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"lossless predictor '{predictor.name}' reads the layer below, but this model has "
            f"{sorted(set(layer_types) - {'full_attention'})} layers that drop old tokens; use predictor 'none' "
            "or no calibration (per-block statistics) for it"
        )


def sealed_raw_bytes(cache) -> int:
    """Raw (uncompressed) bytes of every sealed block of ``cache``: what the decoded pool's budget scales."""
    total = 0
    for layer in cache.kv_layers():
        for block in layer.blocks:
            if isinstance(block, CodedBlock):
                total += len(block.rows) * block.heads * block.tokens * (block.dim + block.value_dim) * \
                    block.dtype.itemsize
    return total
