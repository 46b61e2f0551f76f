"""The chunk files of a `PrefixStore`: what a chunk of its model holds, coding one from a cache (its blocks taken
as generation coded them where they are the store's, else coded here), checking one read back against the store,
and filling a cache from checked chunks (adopted as they are, or decoded once). The frame and the block table are
`container`'s; the folder the files live in is `store_folder`'s."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicCache

from ..blockcodec import BlockCodec, CodedBlock
from ..calibration import Calibration, calibration_for
from ..config import CompressionConfig, LosslessConfig
from ..errors import CacheFileError
from ..identity import kv_shape
from ..layer import CompressedLayer
from ..layer.hybrid import states_outside_cache
from ..layer.layer import holds_as_generated
from ..predictors import make_predictor
from ..predictors.registry import (
    AUTO,
    CALIBRATED_STORAGE,
    head_set,
    predictor_class,
    reads_calibration,
    storage_predictor,
)
from ..predictors.rerun import layer_device
from .binding import binding_problem
from .cache import CompressedCache, _supported_layer_types
from .coded import LosslessCoding
from .container import (
    DTYPES,
    PREFIX,
    check_blocks,
    check_int,
    check_object,
    frame,
    open_regular,
    read_blocks,
    read_exactly,
    unframe,
    write_blocks,
)
from .store_folder import open_folder, open_root, opened, own_files

MAGIC = b"\x89HFKVP\r\n"
FORMAT = "hf_kvcompress.prefix_chunk"
VERSION = 1
#: the fields of a chunk's header; "model", the model's name for listings (`folder_model`), may be absent too
_HEADER_FIELDS = {"format", "version", "key", "namespace", "first", "tokens", "token_ids", "dtype", "layers",
                  "payload_bytes"}
#: a layer entry's fields; a window layer's adds "first", the first token it holds (`Chunks.window_first`)
_LAYER_FIELDS = {"layer", "heads", "key_dim", "value_dim", "blocks"}
#: transformers' layer types whose K/V a window holds (the last ``sliding_window - 1`` tokens, as the cache's
#: `SlidingWindowLayer` and transformers' `DynamicSlidingWindowLayer` hold both)
WINDOW_TYPES = ("sliding_attention", "chunked_attention")
#: layer types holding a recurrent / convolution state (beside K/V for the hybrid ones)
STATE_TYPES = ("conv", "linear_attention", "hybrid", "hybrid_sliding")
#: the layer type of a layer that shares another's K/V (KV sharing: Gemma 3n, Gemma 4), whose cache layer holds none
SHARED_TYPE = "dummy"


def store_layers(model: torch.nn.Module) -> tuple[list[int | None], frozenset[int]]:
    """Each layer's sliding window (None: full attention, which a chunk holds every token of) and the layers that
    share another's K/V (KV sharing, transformers' ``"dummy"`` layers: their cache layer holds nothing, their
    attention reads the K/V its producing layer's update returns in the same forward, so a chunk holds nothing of
    theirs), or a ``ValueError`` naming the layer types a store cannot hold and why."""
    try:  # what the caches `cache_for` returns refuse (a model-specific layer, a cache per loop), with their reason
        types, kwargs = _supported_layer_types(model.config)
    except ValueError as err:
        raise ValueError(f"PrefixStore: {err}") from None
    windows: list[int | None] = []
    refused: dict[str, int] = {}
    shared = frozenset(index for index, kind in enumerate(types) if kind == SHARED_TYPE)
    for index, (kind, extra) in enumerate(zip(types, kwargs)):
        window = extra.get("sliding_window") if kind in WINDOW_TYPES else None  # no window: attends to everything
        if kind not in ("full_attention", SHARED_TYPE, *WINDOW_TYPES) or (window is not None and window < 2):
            refused.setdefault(kind if window is None or window >= 2 else f"{kind} (window {window})", index)
        windows.append(window)
    if refused:
        if any(kind in STATE_TYPES for kind in refused):
            _refuse_states_outside_cache(model)
        why = "; ".join(f"{kind} (layer {index}): {_refused_why(kind)}" for kind, index in refused.items())
        raise ValueError(f"PrefixStore: {model.config.model_type} has layers the store cannot hold: {why}")
    if len(shared) == len(types):
        raise ValueError(f"PrefixStore: {model.config.model_type} has no layer holding K/V of its own")
    return windows, shared


def _refuse_states_outside_cache(model: torch.nn.Module) -> None:
    """Refuse, with `CompressedCache.save`'s reason, a model that keeps a linear-attention layer's state in its own
    modules (RecurrentGemma): only a forward tells (its cache layers stay empty), so one token is run; a forward
    that fails leaves the general refusal of recurrent states to the caller."""
    try:
        probe = one_token_forward(model)
    except Exception:  # the model is refused either way; this only picks the reason given
        return
    outside = states_outside_cache(probe.layers, model)
    if outside:
        raise ValueError(f"PrefixStore: {outside}: a chunk cannot hold it, so a hit would continue from a wrong "
                         "state")


def one_token_forward(model: torch.nn.Module) -> DynamicCache:
    """transformers' own cache of the model's layer kinds after a forward of one token (token id 1)."""
    probe = DynamicCache(config=model.config)
    embeddings = model.get_input_embeddings()
    token = torch.tensor([[1]], device=embeddings.weight.device if embeddings is not None else "cpu")
    with torch.no_grad():
        model(token, cache=probe, use_cache=True)
    return probe


def _refused_why(kind: str) -> str:
    if kind in STATE_TYPES:
        return ("a recurrent / convolution state, which is not a sum of chunks: a chunk would need a snapshot of "
                "it at its boundary, which the store does not hold yet")
    if kind.startswith(WINDOW_TYPES):
        return "a window of one token holds no K/V, which transformers' window layer does not honour either"
    return "a layer type whose cache layer is specific to the model"


def _ceil(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Chunks:
    """The chunk files of one store's model and settings (``predictor``, ``config``, ``chunk_tokens``, ``secret``):
    their size bounds, coding, checks and adoption. ``calibration``: the one the store was given, else found or
    fitted on first use (a calibrated predictor)."""

    def __init__(self, model: torch.nn.Module, config: CompressionConfig, chunk_tokens: int, predictor: str,
                 secret: bytes | None, calibration: Calibration | None):
        self.model = model
        self.config = config
        self.chunk_tokens = chunk_tokens
        self._requested = predictor
        self._secret = secret
        self._calibration = calibration
        self._predictor: str | None = None
        #: each layer's sliding window, None for full attention, and the layers sharing another's K/V (a chunk
        #: holds none of theirs) (`store_layers`: raises for the rest)
        self.windows, self.shared = store_layers(model)
        if any(w is not None for w in self.windows) and predictor not in (AUTO, "generic"):
            raise ValueError(f"PrefixStore: predictor {predictor!r} needs a calibration, and calibrations cover "
                             "full-attention models only; this one has sliding-window layers (use 'generic')")
        if self.windowed:
            self.layer_shapes  # noqa: B018 - its forward refuses here, at construction, a model it cannot run

    @property
    def windowed(self) -> bool:
        """Whether some layer holds a sliding window (then chunks are `generic`: calibrations cover full-attention
        models only)."""
        return any(w is not None for w in self.windows)

    @property
    def held(self) -> list[int]:
        """The layers a chunk holds K/V of, in order: all but those sharing another's (`shared`)."""
        return [i for i in range(len(self.windows)) if i not in self.shared]

    def window_first(self, index: int, window: int) -> int:
        """The first token of chunk ``index`` a layer of ``window`` needs at any boundary from the chunk's end on:
        the window at the chunk's own end reaches furthest back (transformers keeps the last ``window - 1``
        tokens)."""
        stop = (index + 1) * self.chunk_tokens
        return max(index * self.chunk_tokens, stop - (window - 1))

    def _window_blocks(self, start: int, stop: int) -> list[tuple[int, int]]:
        """A window entry's blocks of tokens ``start .. stop``: a shorter first one up to the next block boundary
        (the window's oldest tokens), then whole blocks."""
        block_tokens = self.config.block_tokens
        edges = [start, *range(_ceil(start, block_tokens) if start % block_tokens else start + block_tokens,
                               stop, block_tokens), stop]
        return [(a, b) for a, b in itertools.pairwise(edges) if b > a]

    def first_needed(self, last: int) -> int:
        """The first chunk a cache at the end of chunk ``last`` reads: 0 where a layer holds every token, else the
        first chunk the widest window reaches."""
        if not self.windowed or any(self.windows[i] is None for i in self.held):
            return 0
        reach = (last + 1) * self.chunk_tokens - (max(self.windows) - 1)
        return max(0, reach // self.chunk_tokens)

    def restorable(self, chunks: list[dict[str, Any]], base: int) -> bool:
        """Whether checked ``chunks`` (chunk ``base`` on) hold every window layer's tokens its window needs at the
        end of the last one (a put from a cache whose window had moved on stores fewer: `encode`)."""
        stop = (base + len(chunks)) * self.chunk_tokens
        for number, chunk in enumerate(chunks):
            end = (base + number + 1) * self.chunk_tokens
            for entry in chunk["layers"]:  # checked: the held layers, in order
                window = self.windows[entry["layer"]]
                if window is not None:
                    needed = max(end - self.chunk_tokens, stop - (window - 1))
                    if needed < end and entry["first"] > needed:
                        return False
        return True

    @property
    def predictor(self) -> str:
        """The predictor chunks are coded with: the store's, `predictors.registry.AUTO` resolved
        (`storage_predictor`: calibrated storage where the model's calibration, given or found, allows it)."""
        if self._predictor is None:
            if self._requested == AUTO and self.windowed:  # calibrations cover full-attention models only
                self._predictor = "generic"
            elif self._requested == AUTO:
                if self._calibration is None:  # found, never fitted: a store's first put must not wait for a fit
                    self._calibration, _ = calibration_for(self.model, predictors=(head_set(CALIBRATED_STORAGE),),
                                                           fit=False)
                self._predictor = storage_predictor(AUTO, self._calibration)
            else:
                self._predictor = self._requested
        return self._predictor

    @property
    def calibration(self) -> Calibration | None:
        """The calibration chunks are coded with (a calibrated predictor: given, found, or fitted on first use
        where the store names the predictor)."""
        if reads_calibration(self.predictor) and self._calibration is None:
            self._calibration, _ = calibration_for(self.model, predictors=(self.predictor,))
        return self._calibration

    def raw_bytes(self) -> int:
        """The K/V bytes a chunk holds uncompressed (every layer, keys and values; at most, for a window layer:
        the tokens its window needs at the chunk's end, `window_first`)."""
        dtype, shapes = self.layer_shapes
        return sum(2 * (self.chunk_tokens - (self.window_first(0, w) if w is not None else 0)) * heads * dim
                   for i, (w, (heads, dim)) in enumerate(zip(self.windows, shapes))
                   if i not in self.shared) * dtype.itemsize

    def max_bytes(self) -> int:
        """The most a chunk file of this model may hold: twice its raw K/V (coded streams of incompressible
        values hold a little more than raw; side data are ~1 %) and 1 MiB of header (its JSON: ~20 KiB for 30
        layers)."""
        return 2 * self.raw_bytes() + (1 << 20)

    def kv_shape(self) -> tuple[torch.dtype, int, int]:
        """The model's K/V dtype, KV heads and head size of its first layer (`layer_shapes`)."""
        dtype, shapes = self.layer_shapes
        return dtype, *shapes[0]

    @functools.cached_property
    def layer_shapes(self) -> tuple[torch.dtype, list[tuple[int, int]]]:
        """The model's K/V dtype and each layer's KV heads and key width: of a full-attention model from its
        weights' dtype and its config; of a window model from one forward of one token, since window layers
        may have other heads or widths than full ones (MiMo-V2-Flash, Gemma 4) and some models keep weights in
        float32 beside bfloat16 K/V (ERGO). A model whose forward fails there is refused (a ``ValueError``)."""
        if not self.windowed:
            heads, dim = kv_shape(self.model.config)
            return next(self.model.parameters()).dtype, [(heads, dim)] * len(self.windows)
        try:
            probe = one_token_forward(self.model)
            keys = [layer.keys for layer in probe.layers]  # None for a layer sharing another's K/V
            dtype = next(k.dtype for k in keys if k is not None)
            return dtype, [(k.shape[1], k.shape[3]) if k is not None else (0, 0) for k in keys]
        except Exception as err:
            raise ValueError(f"PrefixStore: a forward of one token, which tells each layer's K/V shape, failed "
                             f"({type(err).__name__}: {err})") from err

    @functools.cached_property
    def _codec(self) -> BlockCodec:
        """The store's block codec without blocks, built once: what `BlockCodec.codes_like` compares."""
        return self._coding({})

    def _coding(self, blocks: dict[tuple[int, int], CodedBlock]) -> BlockCodec:
        """A block codec of the store's settings over ``blocks`` (the layer-below lookup of `context`); portable:
        chunks are read by other processes (and machines: LMCache tiers)."""
        predictor = make_predictor(self.predictor, calibration=self.calibration, portable=True)
        return BlockCodec.over(self.settings, predictor, self.calibration,
                               lambda layer, start: blocks.get((layer, start)))

    @property
    def settings(self) -> LosslessConfig:
        """The lossless settings chunks are coded with: the caches' (generation's blocks, adopted as they are), with
        the predictor's `Predictor.storage_coder` where chunks code with another predictor than generation."""
        settings = self.config.lossless
        if self.predictor == settings.predictor:
            return settings
        return dataclasses.replace(settings, coder=predictor_class(self.predictor).storage_coder)

    def encode(self, cache: Cache, index: int, key: bytes, namespace: bytes, row: np.ndarray,
               whole: dict[int, tuple[torch.Tensor, torch.Tensor, int]]) -> bytes:
        """One chunk's file: every layer's blocks of tokens ``index * chunk_tokens ..``, taken from ``cache`` where
        it holds them coded as the store codes (no re-encoding), else coded from its keys and values (``whole``:
        each layer's and the position of its first, read on first need). A window layer's entry holds the blocks
        its window needs at the chunk's end (`window_first`) that the cache still holds: none where its window
        had moved past them (a put after generation), so that chunk's end cannot be restored from it."""
        first = index * self.chunk_tokens
        stop = first + self.chunk_tokens
        block_tokens = self.config.block_tokens
        blocks: dict[tuple[int, int], CodedBlock] = {}
        coding = None
        payload = bytearray()
        layers = []
        dtype = None
        for layer_idx, layer in enumerate(cache.layers):
            if layer_idx in self.shared:  # its K/V are another layer's
                continue
            window = self.windows[layer_idx]
            if window is not None:
                if layer_idx not in whole:
                    whole[layer_idx] = layer_kv(layer, stop, window)
                keys, values, held = whole[layer_idx]
                start = min(stop, max(self.window_first(index, window), held))
                coding = coding or self._coding(blocks)
                taken = [coding.encode_block(layer_idx, keys[:, :, a - held : b - held],
                                             values[:, :, a - held : b - held], a)
                         for a, b in self._window_blocks(start, stop)]
                dtype = dtype or (taken[0].dtype if taken else None)
                layers.append({"layer": layer_idx, "heads": keys.shape[1], "key_dim": keys.shape[3],
                               "value_dim": values.shape[3], "first": start, "blocks": write_blocks(taken, payload)})
                continue
            taken = self._held_blocks(cache, layer, first, stop)
            if taken is None:
                if layer_idx not in whole:
                    whole[layer_idx] = layer_kv(layer, stop)
                keys, values = (t[:, :, first:stop] for t in whole[layer_idx][:2])
                coding = coding or self._coding(blocks)
                taken = []
                for at in range(first, stop, block_tokens):
                    block = coding.encode_block(layer_idx, keys[:, :, at - first : at - first + block_tokens],
                                                 values[:, :, at - first : at - first + block_tokens], at)
                    blocks[(layer_idx, at)] = block
                    taken.append(block)
            head = taken[0]
            dtype = dtype or head.dtype
            layers.append({"layer": layer_idx, "heads": head.heads, "key_dim": head.dim, "value_dim": head.value_dim,
                           "blocks": write_blocks(taken, payload)})
        dtype = dtype or self.kv_shape()[0]
        header = {"format": FORMAT, "version": VERSION, "key": key.hex(), "namespace": namespace.hex(),
                  "first": first, "tokens": self.chunk_tokens, "token_ids": row[first:stop].tolist(),
                  "dtype": str(dtype).replace("torch.", ""), "layers": layers, "payload_bytes": len(payload),
                  "model": _model_name(self.model)}
        return b"".join(frame(MAGIC, VERSION, header, payload, self._secret))

    def _held_blocks(self, cache: Cache, layer: object, first: int, stop: int) -> list[CodedBlock] | None:
        """``layer``'s coded blocks of tokens ``first..stop`` when they are coded exactly as the store codes them
        (a `CompressedCache` in generation with the store's predictor and codec settings), else None."""
        coding = getattr(cache, "lossless", None)
        if not holds_as_generated(layer) or coding is None or not self._codec.codes_like(coding):
            return None
        found = {start: block for start, block in zip(layer.block_starts, layer.blocks)}
        taken = [found.get(at) for at in range(first, stop, self.config.block_tokens)]
        if any(not isinstance(b, CodedBlock) or b.tokens != self.config.block_tokens or len(b.rows) != 1
               for b in taken):
            return None
        return taken  # type: ignore[return-value]

    def check(self, data: bytes, key: bytes, namespace: bytes, index: int, row: np.ndarray) -> dict[str, Any]:
        """The chunk ``data`` read at ``key`` (chunk ``index`` of ``row``) as a dict of its header, ``payload`` and
        ``raw_bytes``, every field checked against the store (namespace, tokens, the model's K/V shape)."""
        framed = unframe(data, MAGIC, (VERSION,), "prefix chunk", key=self._secret)
        header, payload = framed.header, framed.payload
        h = check_object(header, "chunk header", None)
        if set(h) - {"model"} != _HEADER_FIELDS or not isinstance(h.get("model", ""), str):
            raise CacheFileError("the chunk header's fields are not a chunk's")  # "model" (a label) is optional
        first = index * self.chunk_tokens
        if (h["format"], h["version"], h["key"], h["namespace"]) != (FORMAT, VERSION, key.hex(), namespace.hex()):
            raise CacheFileError("the header names another format, key or namespace")
        if h["first"] != first or h["tokens"] != self.chunk_tokens or h["token_ids"] != row[first:first + self.chunk_tokens].tolist():
            raise CacheFileError("the chunk holds other tokens than its key")  # a hash collision or an edited file
        dtype, shapes = self.layer_shapes
        if DTYPES.get(h["dtype"]) != dtype or check_int(h["payload_bytes"], "payload_bytes", 0) != len(payload):
            raise CacheFileError(f"dtype {h['dtype']!r} (the model's K/V: {dtype}) or payload length")
        layers = h["layers"]
        held = self.held
        if not isinstance(layers, list) or len(layers) != len(held):
            raise CacheFileError(f"holds {len(layers) if isinstance(layers, list) else '?'} layers, the model "
                                 f"{len(held)} holding K/V")
        cursor = [0]
        stop = first + self.chunk_tokens
        raw = 0
        for entry, i in zip(layers, held):
            window, (heads, dim) = self.windows[i], shapes[i]
            entry = check_object(entry, f"layer {i}", _LAYER_FIELDS | ({"first"} if window is not None else set()))
            if (entry["layer"], entry["heads"], entry["key_dim"]) != (i, heads, dim):  # as `_check_kv` checks puts
                raise CacheFileError(f"layer entry {i} names layer {entry['layer']!r} of {entry['heads']!r} heads x "
                                     f"{entry['key_dim']!r}, the model {heads} x {dim}")
            value_dim = check_int(entry["value_dim"], f"layer {i} value_dim", 1, 1 << 16)
            start = first
            if window is not None:  # the tokens its window needs at the chunk's end, or fewer (`encode`)
                start = check_int(entry["first"], f"layer {i} first", self.window_first(index, window), stop)
                spans = self._window_blocks(start, stop)
                if not isinstance(entry["blocks"], list) or len(entry["blocks"]) != len(spans):
                    raise CacheFileError(f"layer {i}: {len(spans)} blocks from token {start} expected")
                for b, (a, end) in enumerate(spans):  # each tiles its span: a block list of its own
                    check_blocks(entry["blocks"][b : b + 1], f"layer {i}", a, end, 1, heads, max(dim, value_dim),
                                  self.config, cursor)
            else:
                check_blocks(entry["blocks"], f"layer {i}", start, stop, 1, heads, max(dim, value_dim), self.config,
                              cursor)
                if any(b["tokens"] != self.config.block_tokens for b in entry["blocks"]):
                    raise CacheFileError(f"layer {i}: blocks of another size than block_tokens")
            raw += (stop - start) * heads * (dim + value_dim) * dtype.itemsize
        if cursor[0] != len(payload):
            raise CacheFileError(f"the header describes {cursor[0]} payload bytes, the file holds {len(payload)}")
        h["payload"] = payload
        h["raw_bytes"] = raw
        return h

    def fill(self, cache: CompressedCache, chunks: list[dict[str, Any]],
             base: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor, int] | None, bool]:
        """Hold the chunks' tokens (chunks ``base`` on) in ``cache``: full layers' blocks adopted as they are
        (`generic`), or decoded once and coded as generation codes (`context`); a window layer's blocks decoded and
        its window restored (`SlidingWindowLayer.restore`: what transformers' window holds at the last chunk's end).
        Returns the first layer's keys, values and first position where decoded here (else None: adopted blocks
        decode in `first_bad`) and whether full layers adopted their blocks. A failure that one chunk causes raises
        `BadChunk` naming it (an index into ``chunks``)."""
        coding = cache.lossless
        checker: dict[tuple[int, int], CodedBlock] = {}
        mine = self._coding(checker)
        source = None if mine.codes_like(coding) else mine  # else adopted: coded as the cache codes in generation
        sides: dict[tuple, dict] = {}
        per_layer: dict[int, list[CodedBlock]] = {}
        for number, chunk in enumerate(chunks):
            dtype = DTYPES[chunk["dtype"]]
            for entry in chunk["layers"]:
                i = entry["layer"]
                if not entry["blocks"]:  # a window layer holding none of this chunk (`encode`)
                    continue
                with _blame(number):
                    read = read_blocks(entry, chunk["payload"], source or coding, i, dtype,
                                       layer_device(self.model, i), (source or coding).predictor, sides)
                for block in read:
                    checker[(i, block.start)] = block
                    per_layer.setdefault(i, []).append(block)
        stop = (base + len(chunks)) * self.chunk_tokens
        kv0 = None
        for i, blocks in sorted(per_layer.items()):
            window = self.windows[i]
            if window is not None:
                low = max(0, stop - (window - 1))  # transformers' window after `stop` tokens: the last window - 1
                decoded = []
                for block in blocks:
                    if block.start + block.tokens > low:
                        with _blame(block.start // self.chunk_tokens - base):
                            decoded.append(mine.decoded(block))
                skip = low - (stop - sum(d.keys.shape[2] for d in decoded))
                keys = torch.cat([d.keys for d in decoded], dim=2)[:, :, skip:].to(blocks[0].device)
                values = torch.cat([d.values for d in decoded], dim=2)[:, :, skip:].to(blocks[0].device)
                kv0 = (keys, values, low) if i == 0 else kv0
                cache.layers[i].restore(keys, values, stop)
                continue
            if source is None:
                cache.layers[i].adopt(blocks)
                continue
            decoded = []
            for block in blocks:
                with _blame(block.start // self.chunk_tokens):
                    decoded.append(source.decoded(block))
            keys = torch.cat([d.keys for d in decoded], dim=2).to(blocks[0].device)
            values = torch.cat([d.values for d in decoded], dim=2).to(blocks[0].device)
            kv0 = (keys, values, 0) if i == 0 else kv0
            cache.update(keys, values, i)
        if coding is not None:
            cache._blocks_changed()
        return kv0, source is None

    def first_bad(self, cache: CompressedCache, row: np.ndarray, count: int,
                   filled: tuple[tuple[torch.Tensor, torch.Tensor, int] | None, bool],
                   base: int = 0) -> tuple[int, str] | None:
        """The first of the ``count`` chunks (chunk ``base`` on) ``cache`` holds that does not decode or whose
        layer-0 keys or values are not the model's for ``row``'s tokens, with why (an index into the chunks);
        None if all are sound. Adopted blocks (``filled``, what `fill` returned, says so) are decoded here once
        (verifying each stream), so that no stored stream first fails inside `generate`."""
        kv0, adopted = filled
        full = [layer.blocks for layer, window in zip(cache.layers, self.windows)
                if window is None and isinstance(layer, CompressedLayer)]
        if adopted and full:
            coding = cache.lossless
            try:  # every layer at once where the codec may (`read_layers`); a failure is found layer by layer
                decoded = coding.read_layers(full)
            except Exception:
                for blocks in full:
                    try:
                        coding.read_all(blocks)
                    except Exception:
                        return self._failing_chunk(coding, blocks, count)
                raise
            if kv0 is None:
                kv0 = (torch.cat([k for k, _ in decoded[0]], dim=2), torch.cat([v for _, v in decoded[0]], dim=2), 0)
        if kv0 is None:
            raise BadChunk(0, "holds no K/V layer")
        tokens = (base + count) * self.chunk_tokens
        keys, values, start = kv0
        found = binding_problem(self.model, torch.from_numpy(row[:tokens].copy()).unsqueeze(0), 0, keys, values,
                                start)
        if found is None:
            return None
        return min(max(found[0] // self.chunk_tokens - base, 0), count - 1), found[1]

    def _failing_chunk(self, coding: LosslessCoding, blocks: list, count: int) -> tuple[int, str]:
        """Which chunk's blocks of a layer whose blocks did not decode together fail on their own."""
        per = self.chunk_tokens // self.config.block_tokens
        for index in range(count):
            try:
                coding.read_all(blocks[index * per : (index + 1) * per])
            except Exception as err:
                return index, f"does not decode: {type(err).__name__}: {err}"
        return 0, "the chunks do not decode together"


class BadChunk(Exception):
    """Chunk ``index`` of a hit failed (``why``)."""

    def __init__(self, index: int, why: str):
        super().__init__(why)
        self.index, self.why = index, why


@contextlib.contextmanager
def _blame(index: int) -> Iterator[None]:
    """Whatever fails inside is chunk ``index``'s fault: a `BadChunk`."""
    try:
        yield
    except BadChunk:
        raise
    except Exception as err:
        raise BadChunk(index, f"does not decode: {type(err).__name__}: {err}") from err


def folder_model(folder: str | Path) -> str | None:
    """What the newest chunk in ``folder`` says of its model: its name (chunks written since 2026-12-04), dtype,
    layers (and how many are sliding windows), KV heads x key width, from its header alone (read-only, unchecked:
    for listings), or None without a readable one. ``folder`` is opened under its parent without following a
    link, as the store opens it."""
    folder = Path(folder)
    with opened(open_root(folder.parent)) as parent:
        try:
            folder_fd = None if parent is None else open_folder(parent, folder.name, create=False)
        except OSError:
            return None
        with opened(folder_fd):
            return None if folder_fd is None else _newest_header(folder_fd)


def _newest_header(folder_fd: int) -> str | None:
    """`folder_model` of the folder ``folder_fd``."""
    chunks = [(info.st_mtime, name) for name, info, chunk in own_files(folder_fd) if chunk]
    for _, name in sorted(chunks, reverse=True)[:1]:
        try:
            fd, _size = open_regular(name, follow_links=False, dir_fd=folder_fd)  # no link, no FIFO to block on
            try:
                magic, _version, size = PREFIX.unpack(read_exactly(fd, PREFIX.size))
                if magic != MAGIC or size > 1 << 24:  # a header holds ids and block entries: far below 16 MiB
                    return None
                header = json.loads(read_exactly(fd, size))
            finally:
                os.close(fd)
            layers = header["layers"]
            windows = sum(isinstance(entry, dict) and "first" in entry for entry in layers)  # `encode`'s window entries
            kinds = f" ({windows} sliding-window)" if windows else ""
            shape = (f"{header['dtype']}, {len(layers)} layers{kinds}, {layers[0]['heads']} KV heads x "
                     f"{layers[0]['key_dim']}")
            name = header.get("model")
            return f"{name[:80]} ({shape})" if isinstance(name, str) and name else shape
        except (CacheFileError, OSError, struct.error, ValueError, KeyError, TypeError, IndexError, RecursionError):
            return None
    return None


def _model_name(model: torch.nn.Module) -> str:
    """The model's name for listings (its config's ``name_or_path``, else its class), bounded: a label that no
    check reads (the namespace binds chunks to the model's fingerprint)."""
    name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    return str(name)[-200:]


def layer_kv(layer: object, stop: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A cache layer's keys and values (one row, at least ``stop`` tokens seen), on the host, and the position of
    the first: 0 for a full layer (which must hold every token), the first one a window layer still holds."""
    keys, values = layer.keys, layer.values
    seen = layer.get_seq_length()
    if window is None and keys is not None and keys.shape[2] != seen:  # checked before the first chunk is written
        raise ValueError(f"PrefixStore.put: a cache layer holds {keys.shape[2]} entries for {seen} tokens (a lossy "
                         "or sliding-window cache); the store takes the exact KV of every token")
    if keys is None or keys.shape[0] != 1 or seen < stop:
        raise ValueError("PrefixStore.put: the cache holds fewer tokens (or more rows) than asked for")
    return keys.cpu(), values.cpu(), seen - keys.shape[2]
