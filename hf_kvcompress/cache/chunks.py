"""The chunk files of a `PrefixStore`: what a chunk of its model holds, coding one from a cache (its blocks taken
as generation coded them where they are the store's, else coded here), checking one read back against the store,
and filling a cache from checked chunks (adopted as they are, or decoded once). The frame and the block table are
`container`'s; the folder the files live in is `store_folder`'s."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from ..blockcodec import BlockCodec, CodedBlock
from ..calibration import Calibration, calibration_for
from ..config import CompressionConfig, LosslessConfig
from ..errors import CacheFileError
from ..identity import kv_shape, layer_types
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
from .cache import CompressedCache
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

    @property
    def predictor(self) -> str:
        """The predictor chunks are coded with: the store's, `predictors.registry.AUTO` resolved
        (`storage_predictor`: calibrated storage where the model's calibration, given or found, allows it)."""
        if self._predictor is None:
            if self._requested == AUTO:
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
        """The K/V bytes a chunk holds uncompressed (every layer, keys and values)."""
        dtype, heads, dim = self.kv_shape()
        return 2 * len(layer_types(self.model.config)) * heads * dim * self.chunk_tokens * dtype.itemsize

    def max_bytes(self) -> int:
        """The most a chunk file of this model may hold: twice its raw K/V (coded streams of incompressible
        values hold a little more than raw; side data are ~1 %) and 1 MiB of header (its JSON: ~20 KiB for 30
        layers)."""
        return 2 * self.raw_bytes() + (1 << 20)

    def kv_shape(self) -> tuple[torch.dtype, int, int]:
        """The model's K/V dtype, KV heads and head size (from its weights' dtype and its config)."""
        heads, dim = kv_shape(self.model.config)
        return next(self.model.parameters()).dtype, heads, dim

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
               whole: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> bytes:
        """One chunk's file: every layer's blocks of tokens ``index * chunk_tokens ..``, taken from ``cache`` where
        it holds them coded as the store codes (no re-encoding), else coded from its keys and values (``whole``:
        each layer's, read on first need)."""
        first = index * self.chunk_tokens
        stop = first + self.chunk_tokens
        block_tokens = self.config.block_tokens
        blocks: dict[tuple[int, int], CodedBlock] = {}
        coding = None
        payload = bytearray()
        layers = []
        for layer_idx, layer in enumerate(cache.layers):
            taken = self._held_blocks(cache, layer, first, stop)
            if taken is None:
                if layer_idx not in whole:
                    whole[layer_idx] = layer_kv(layer, stop)
                keys, values = (t[:, :, first:stop] for t in whole[layer_idx])
                coding = coding or self._coding(blocks)
                taken = []
                for at in range(first, stop, block_tokens):
                    block = coding.encode_block(layer_idx, keys[:, :, at - first : at - first + block_tokens],
                                                 values[:, :, at - first : at - first + block_tokens], at)
                    blocks[(layer_idx, at)] = block
                    taken.append(block)
            head = taken[0]
            layers.append({"layer": layer_idx, "heads": head.heads, "key_dim": head.dim, "value_dim": head.value_dim,
                           "blocks": write_blocks(taken, payload)})
        dtype = taken[0].dtype
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
        dtype, heads, dim = self.kv_shape()
        if DTYPES.get(h["dtype"]) != dtype or check_int(h["payload_bytes"], "payload_bytes", 0) != len(payload):
            raise CacheFileError(f"dtype {h['dtype']!r} (the model's K/V: {dtype}) or payload length")
        layers = h["layers"]
        count = len(layer_types(self.model.config))
        if not isinstance(layers, list) or len(layers) != count:
            raise CacheFileError(f"holds {len(layers) if isinstance(layers, list) else '?'} layers, the model {count}")
        cursor = [0]
        for i, entry in enumerate(layers):
            entry = check_object(entry, f"layer {i}", {"layer", "heads", "key_dim", "value_dim", "blocks"})
            if (entry["layer"], entry["heads"], entry["key_dim"]) != (i, heads, dim):  # as `_check_kv` checks puts
                raise CacheFileError(f"layer entry {i} names layer {entry['layer']!r} of {entry['heads']!r} heads x "
                                     f"{entry['key_dim']!r}, the model {heads} x {dim}")
            value_dim = check_int(entry["value_dim"], f"layer {i} value_dim", 1, 1 << 16)
            check_blocks(entry["blocks"], f"layer {i}", first, first + self.chunk_tokens, 1, heads,
                          max(dim, value_dim), self.config, cursor)
            if any(b["tokens"] != self.config.block_tokens for b in entry["blocks"]):
                raise CacheFileError(f"layer {i}: blocks of another size than block_tokens")
        if cursor[0] != len(payload):
            raise CacheFileError(f"the header describes {cursor[0]} payload bytes, the file holds {len(payload)}")
        h["payload"] = payload
        h["raw_bytes"] = self.raw_bytes()
        return h

    def fill(self, cache: CompressedCache,
             chunks: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hold the chunks' tokens in ``cache``: their blocks adopted as they are (`generic`), or decoded once and
        coded as generation codes (`context`: layer 0's keys and values, decoded here, returned). A failure that
        one chunk causes raises `BadChunk` naming it."""
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
                with _blame(number):
                    read = read_blocks(entry, chunk["payload"], source or coding, i, dtype,
                                       layer_device(self.model, i), (source or coding).predictor, sides)
                for block in read:
                    checker[(i, block.start)] = block
                    per_layer.setdefault(i, []).append(block)
        kv0 = None
        for i, blocks in sorted(per_layer.items()):
            if source is None:
                cache.layers[i].adopt(blocks)
                continue
            decoded = []
            for block in blocks:
                with _blame(block.start // self.chunk_tokens):
                    decoded.append(source.decoded(block))
            keys = torch.cat([d.keys for d in decoded], dim=2).to(blocks[0].device)
            values = torch.cat([d.values for d in decoded], dim=2).to(blocks[0].device)
            kv0 = (keys, values) if i == 0 else kv0
            cache.update(keys, values, i)
        if coding is not None:
            cache._blocks_changed()
        return kv0

    def first_bad(self, cache: CompressedCache, row: np.ndarray, count: int,
                   kv0: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, str] | None:
        """The first of the ``count`` chunks ``cache`` holds that does not decode or whose layer-0 keys or values
        are not the model's for ``row``'s tokens, with why; None if all are sound. Adopted blocks (``kv0`` None)
        are decoded here once (verifying each stream), so that no stored stream first fails inside `generate`."""
        if kv0 is None:
            coding = cache.lossless
            layers = [layer.blocks for layer in cache.kv_layers()]
            try:  # every layer at once where the codec may (`read_layers`); a failure is found layer by layer
                decoded = coding.read_layers(layers)
            except Exception:
                for blocks in layers:
                    try:
                        coding.read_all(blocks)
                    except Exception:
                        return self._failing_chunk(coding, blocks, count)
                raise
            if not decoded:
                raise BadChunk(0, "holds no K/V layer")
            kv0 = (torch.cat([k for k, _ in decoded[0]], dim=2), torch.cat([v for _, v in decoded[0]], dim=2))
        tokens = count * self.chunk_tokens
        found = binding_problem(self.model, torch.from_numpy(row[:tokens].copy()).unsqueeze(0), 0, *kv0)
        return None if found is None else (min(found[0] // self.chunk_tokens, count - 1), found[1])

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
    layers, KV heads x key width, from its header alone (read-only, unchecked: for listings), or None without a
    readable one. ``folder`` is opened under its parent without following a link, as the store opens it."""
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
            shape = f"{header['dtype']}, {len(layers)} layers, {layers[0]['heads']} KV heads x {layers[0]['key_dim']}"
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


def layer_kv(layer: object, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values (one row, at least ``stop`` tokens), on the host."""
    keys, values = layer.keys, layer.values
    if keys is not None and keys.shape[2] != layer.get_seq_length():  # checked before the first chunk is written
        raise ValueError(f"PrefixStore.put: a cache layer holds {keys.shape[2]} entries for {layer.get_seq_length()} "
                         "tokens (a lossy or sliding-window cache); the store takes the exact KV of every token")
    if keys is None or keys.shape[0] != 1 or keys.shape[2] < stop:
        raise ValueError("PrefixStore.put: the cache holds fewer tokens (or more rows) than asked for")
    return keys.cpu(), values.cpu()
