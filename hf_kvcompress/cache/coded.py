"""Lossless storage in a cache: `CodedStorage` seals a layer's blocks through the cache's `LosslessCoding`, the
`blockcodec.BlockCodec` with what only a cache reading every block at every step needs on top (the decoded pool,
decode-ahead, a layer's blocks decoded together straight into the tensors attention reads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..blockcodec import BlockCodec, CodedBlock
from ..blockcoder import decode_stacked, one_thread
from ..codec import (
    CodecConfig,
    CorruptStreamError,
    ParameterMismatchError,
    PendingDecode,
    decode_streams,
    start_decode_batch,
)
from ..identity import not_full_attention
from ..layer.storage import Block, Storage
from ..predictors import make_predictor
from ..predictors.base import KINDS, LayerValues, Predictor
from ..threads import available_cores
from .pool import DecodedPool


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
        return all(i < len(blocks) and blocks[i] is block for i, block in zip(self.indices, self.blocks)) and \
            all(held is None for held in coding.held_of(self.blocks))


class LosslessCoding(BlockCodec):
    """The cache's reader: its `BlockCodec` plus what only a cache reading every block each step needs.

    Decoded tensors live in the `DecodedPool` (``decoded_budget``: a fraction of the sealed blocks' raw bytes)
    beside the codec's chain memo (see `pool`); a layer's blocks not held decoded are decoded together in one
    codec call where the predictor allows, straight into the tensors attention reads (`read_into`), and the next
    layer's decode may start ahead on the other codec threads (`_start_ahead`). The cache sets ``layer_count``
    and ``blocks_of`` (a layer's block list) as it learns them.
    """

    def __init__(self, predictor: Predictor, codec_config: CodecConfig, calibration=None,
                 find_block: Callable[[int, int], Block | None] | None = None, workers: int | None = 1, *,
                 decoded_budget: float = 0.0):
        super().__init__(predictor, codec_config, calibration, find_block, workers)
        self.pool = DecodedPool(decoded_budget)
        #: the blocks of a layer (set by the cache): lets a layer's read start the next layer's decode ahead
        self.blocks_of: Callable[[int], list[Block]] | None = None
        self._ahead: _Ahead | None = None

    @property
    def sealed_raw_bytes(self) -> int:
        """Raw bytes of every sealed block (the pool's budget is a fraction of it); refreshed by the cache."""
        return self.pool.sealed_raw_bytes

    @sealed_raw_bytes.setter
    def sealed_raw_bytes(self, value: int) -> None:
        self.pool.sealed_raw_bytes = value

    def _sealed(self, block: CodedBlock, keys: torch.Tensor, values: torch.Tensor, finished: LayerValues) -> None:
        self.pool.sealed_raw_bytes += (keys.numel() + values.numel()) * keys.element_size()  # before the pool sees it
        super()._sealed(block, keys, values, finished)

    def read_layers(self, layers: list[list[Block]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """`read_all` of several layers' blocks, bottom layer first. When the predictor reads no layer below and is
        not `Predictor.self_fitting` (nor `kind_batched`: its batch is one layer's), no block's decode needs another
        layer's, so all of them go to one `read_all` (one codec call per shape, device and layer codec setting);
        else layer by layer."""
        if self.depth != 0 or self.predictor.self_fitting or self.predictor.kind_batched:
            return [self.read_all(blocks) for blocks in layers]
        read = iter(self.read_all([block for blocks in layers for block in blocks]))
        return [[next(read) for _ in blocks] for blocks in layers]

    def read_all(self, blocks: list[Block]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of one layer's ``blocks`` (or several layers', from `read_layers`) on their device.
        Blocks not held decoded are decoded together in one codec call when the predictor's sessions are
        independent (per-block statistics: no block needs another's values), else one by one in layer order."""
        found = self.held_of(blocks, keep=True)
        missing = [i for i, (b, v) in enumerate(zip(blocks, found)) if v is None and isinstance(b, CodedBlock)]
        if self.predictor.kind_batched and len(missing) > 1:
            with one_thread():
                for i, values in zip(missing, self.decode_blocks([blocks[i] for i in missing])):
                    found[i] = values
        elif (self.depth == 0 or self.predictor.independent_blocks) and missing:
            groups: dict[tuple, list[int]] = {}
            for i in missing:
                b = blocks[i]
                # one codec setting per call: per layer only with the calibration's marginals (`codec_for`)
                layer = b.layer if self.marginals is not None else None
                groups.setdefault((b.tokens, len(b.rows), b.heads, b.dim, b.value_dim, b.dtype, b.device, layer),
                                  []).append(i)
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
        candidates = [i for i, block in enumerate(blocks)
                      if not direct[i] and isinstance(block, CodedBlock) and self.depth == 0 and not block.split]
        for i, held in zip(candidates, self.held_of([blocks[i] for i in candidates])):
            if held is not None:
                continue
            block = blocks[i]
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
        count = self.layer_count or self._passed_layers
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
            predicted = self.predict_together(chosen)
        config = self.codec_for(layer)
        if predicted is None or predicted[0] is not None:
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
            raise self.mismatch(ahead.layer, err) from err
        into = _destination(keys, values, at[ahead.indices[0]], len(ahead.blocks), ahead.blocks[0])
        if into is not None:
            into.copy_(ahead.out)
        for i, block, decoded in zip(ahead.indices, ahead.blocks, self.record_decoded(ahead.blocks, _views(ahead.out))):
            if into is None:
                keys[..., at[i] : at[i] + block.tokens, :].copy_(decoded.keys)
                values[..., at[i] : at[i] + block.tokens, :].copy_(decoded.values)
            direct[i] = True

    def _decode_together(self, blocks: list[CodedBlock], into: torch.Tensor | None = None) -> list[LayerValues] | None:
        """Decode same-shaped blocks whose sessions are independent in one codec call per part of their streams
        (`BlockCodec.predict_together`; None if they are not independent), also into ``into`` when given (`_destination`):
        in place when the predictor predicted them in one batch.

        When the predictor reads no layer below (``depth == 0``: its sessions never look at decoded values),
        the blocks decode into tensors on their own device: on a CUDA model with Triton the codec's decoder
        runs there (`codec.decode_batch`), and the decoded blocks (the pool's included) stay there. Other
        predictors compute on host values, so their blocks decode on the host."""
        first = blocks[0]
        predicted = self.predict_together(blocks)
        if predicted is None:
            return None
        sessions, parts = predicted
        config = self.codec_for(first.layer)
        if into is not None and sessions is None:  # (`into` is None for split blocks)
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
            raise self.mismatch(first.layer, err) from err
        if "kv" in decoded:
            # [blocks, k/v, heads, rows, dim, tokens] -> [blocks, k/v, rows, heads, tokens, dim]
            x = decoded["kv"].view(count, 2, heads, batch, first.dim, tokens).permute(0, 1, 3, 2, 5, 4).contiguous()
            if into is not None:  # sessions keep what `finish` gets, so they get x, and the destination a copy
                into.copy_(x.permute(0, 1, 3, 2, 5, 4))
            pairs = [(x[i, 0], x[i, 1]) for i in range(count)]
        else:  # [blocks, heads, rows, width, tokens] -> [blocks, rows, heads, tokens, width], per kind
            keys, values = (decoded[kind].permute(0, 2, 1, 4, 3).contiguous() for kind in KINDS)
            pairs = [(keys[i], values[i]) for i in range(count)]
        return self.record_decoded(blocks, pairs, sessions)

    def _decode_in_place(self, blocks: list[CodedBlock], means: torch.Tensor, stds: torch.Tensor,
                         config: CodecConfig, into: torch.Tensor) -> list[LayerValues]:
        """Blocks predicted in one batch, decoded in one codec call into ``into`` (`_destination`)."""
        blobs, verify = _batch_streams(blocks)
        try:
            decode_streams(blobs, means.flatten(0, 2), stds.flatten(0, 2), config, out=into, threads=self.workers,
                           verify=verify)
        except ParameterMismatchError as err:
            raise self.mismatch(blocks[0].layer, err) from err
        return self.record_decoded(blocks, _views(into))

    def decoded_tensors(self) -> list[torch.Tensor]:
        """Every decoded tensor held between reads (pool and chain memo; shared tensors appear twice)."""
        out = self.pool.tensors() + self.chain_tensors()
        out.extend(self.predictor.state_tensors())
        if self._ahead is not None:  # between two layers' reads of a step
            out.append(self._ahead.out)
        return out

    def ahead_bytes(self) -> int:
        """Bytes a decode started ahead holds beside its output tensor (its copy of the streams), 0 if none."""
        return 0 if self._ahead is None else self._ahead.job.nbytes()

    def checkpoint(self) -> tuple:
        """The decoded pool and the chain memo as they are now, for `rollback` (a failed step): their entries
        name blocks by identity, which a rolled-back cache holds again."""
        return dict(self.pool.entries), self.pool.nbytes, self.pool.sealed_raw_bytes, dict(self._chain), \
            self._highest, self._passed_layers

    def rollback(self, state: tuple) -> None:
        """Back to `checkpoint`'s pool and memo, a decode started ahead cancelled; the predictor forgets what it
        fitted (it may have fitted on blocks the failed step sealed) and catches up from the blocks held."""
        if self._ahead is not None:
            self._ahead.job.cancel()
            self._ahead = None
        # the checkpoint's own copies: a step that fails again takes a new checkpoint first
        self.pool.entries, self.pool.nbytes, self.pool.sealed_raw_bytes, self._chain, self._highest, \
            self._passed_layers = state
        self.predictor.forget_state()

    def forget(self) -> None:
        if self._ahead is not None:
            self._ahead.job.cancel()
            self._ahead = None
        self.pool.clear()
        super().forget()
        self.pool.sealed_raw_bytes = 0


class CodedStorage(Storage):
    """`Storage` of lossless mode: one per layer, sharing a `LosslessCoding`."""

    name = "lossless"

    def __init__(self, coding: LosslessCoding, layer: int):
        self.coding = coding
        self.layer = layer

    def hold(self, keys: torch.Tensor, values: torch.Tensor, *, start: int) -> CodedBlock:
        return self.coding.encode_block(self.layer, keys, values, start)

    def hold_blocks(self, keys: torch.Tensor, values: torch.Tensor, *, start: int, tokens: int) -> list[CodedBlock]:
        return self.coding.encode_blocks(self.layer, keys, values, start, tokens)

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


# ------------------------------------------------------------------ assembling a cache's lossless coding

def coding_for(cache) -> LosslessCoding:
    """The `LosslessCoding` of ``cache`` (a `CompressedCache` in lossless mode); the cache sets its
    ``layer_count`` once it knows the model's layers."""
    settings = cache.config.lossless
    predictor = make_predictor(settings.predictor, calibration=cache.calibration, model=cache.model,
                               settings=settings.predictor_settings())
    # model-running predictors (probe, twin) never get here: LosslessConfig refuses them for generation
    _check_layer_chain(cache, predictor)
    coding = LosslessCoding(predictor, settings.codec_config(), cache.calibration, functools.partial(find_block, cache),
                            settings.workers, decoded_budget=settings.decoded_budget)
    coding.blocks_of = functools.partial(layer_blocks, cache)
    return coding


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
    others = not_full_attention(config)
    if others:
        raise ValueError(
            f"lossless predictor '{predictor.name}' reads the layer below, but this model has "
            f"{others} layers that drop old tokens; use predictor 'none' "
            "or no calibration (per-block statistics) for it"
        )


def sealed_raw_bytes(layers: list) -> int:
    """Raw (uncompressed) bytes of every sealed block of a cache's K/V ``layers``: what the decoded pool's budget
    scales."""
    total = 0
    for layer in layers:
        for block in layer.blocks:
            if isinstance(block, CodedBlock):
                total += len(block.rows) * block.heads * block.tokens * (block.dim + block.value_dim) * \
                    block.dtype.itemsize
    return total
