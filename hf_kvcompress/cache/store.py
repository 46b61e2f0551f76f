"""`PrefixStore`: an embedded, compressed store of prompt prefixes' KV, shared by processes on one machine.

A prompt's tokens are cut into chunks of ``chunk_tokens``; chunk ``i`` is keyed by a chained hash (as vLLM and
LMCache key prefixes): ``key_0 = namespace``, ``key_{i+1} = sha256(key_i || ids of chunk i)``, where the
namespace hashes the model's fingerprint (weights, dtype, config), the library version, the chunk format, the
coding settings and the calibration's checksum, so another model, dtype, library version or calibration never
matches. A chunk file holds every layer's blocks of its tokens, coded as generation codes them (the cache's
block coder: `generic` statistics, the cache's codec settings), so a hit is adopted by a `CompressedCache`
without decoding: its blocks decode when attention first reads them. With ``predictor="context"`` (a
calibration) chunks are ~20 % smaller and are transcoded once on lookup (slower to the first token).

Safety: a chunk is written to a temporary file in its folder and renamed (atomic on POSIX), so readers never see
a partial chunk and a writer killed mid-put leaves only a temporary file that never loads as a hit. Every read
checks the whole file (SHA-256, header structure, streams, the chunk's own token ids); a damaged or truncated
chunk is a miss, logged in one warning line and removed. ``max_bytes`` bounds the folder: after a put the least
recently used chunks (file modification times, refreshed on every hit) go first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from ..calibration import Calibration, calibration_for
from ..config import CompressionConfig
from ..downloads import cache_dir
from ..errors import CacheFileError
from ..identity import model_identity
from ..layer import CompressedLayer
from ..predictors import make_predictor
from ..version import __version__
from .cache import CompressedCache
from .coded import CodedBlock, LosslessCoding
from .persist import DTYPES, _check_block, _check_blocks, _dict, _int, _layer_device, _read_row, _write_row

log = logging.getLogger(__name__)

MAGIC = b"\x89HFKVP\r\n"
FORMAT = "hf_kvcompress.prefix_chunk"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_DIGEST = 32  # trailing SHA-256 over everything before it
SUFFIX = ".kvp"
#: the default bound: 8 GiB (about 1.3 million tokens of SmolLM2-135M KV at the generic rate, 0.65 x 45 MiB per 2,048
#: tokens), or a quarter of the disk space free when the store is opened, whichever is smaller
DEFAULT_MAX_BYTES = 8 << 30
#: LMCache's and vLLM's default chunk size: a chunk of this store and one of an LMCache deployment cover the same
#: tokens
DEFAULT_CHUNK_TOKENS = 256
PREDICTORS = ("generic", "context", "below")
#: temporary files older than this are a killed writer's leftovers: an eviction pass removes them
STALE_SECONDS = 3600.0


@dataclass
class StoreStats:
    """What `PrefixStore.stats` reports: chunks and bytes on disk (this store's model only: ``raw_bytes`` is what
    they hold uncompressed), and this process's lookups (chunks hit and missed, bf16 bytes not recomputed)."""

    chunks: int
    bytes: int
    raw_bytes: int
    hits: int
    misses: int
    hit_tokens: int
    bytes_saved: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class PrefixStore:
    """Compressed KV of prompt prefixes on disk, for `generate()` to skip what it computed before.

    >>> store = PrefixStore(model)
    >>> cache = store.cache_for(ids)   # a CompressedCache holding the longest stored prefix of ids
    >>> out = model.generate(ids, cache=cache, max_new_tokens=64)
    >>> store.put(out, cache)          # stores the chunks it does not hold yet; returns the tokens stored

    Args:
        model: the model whose KV is stored (full-attention layers only: a sliding window drops tokens a prefix
            needs, and a recurrent state is not a sum of chunks).
        path: the folder (default ``$HF_KVCOMPRESS_CACHE/prefixes``); several models may share one.
        max_bytes: bound on the folder's chunk bytes (default `DEFAULT_MAX_BYTES` or a quarter of the free disk).
        chunk_tokens: tokens per chunk, a multiple of the cache's ``block_tokens`` (128).
        predictor: ``"generic"`` (per-block statistics: 0.65x raw, adopted without decoding), ``"below"`` (the
            layer below through the calibration's maps, a kind at a time: docs/results/lossless.md "Calibrated
            coding in batches (issue 34)") or ``"context"``
            (the model's calibration, found or fitted on first use: ~0.52x raw, transcoded on lookup).
        config: the lossless configuration of the caches `cache_for` returns (default ``CompressionConfig()``).
    """

    def __init__(self, model: torch.nn.Module, *, path: str | Path | None = None, max_bytes: int | None = None,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, predictor: str = "generic",
                 config: CompressionConfig | None = None, calibration: Calibration | None = None):
        config = config or CompressionConfig()
        if not isinstance(config, CompressionConfig) or config.mode != "lossless":
            raise ValueError("PrefixStore: config must be a lossless CompressionConfig")
        if config.lossless.predictor != "generic":
            raise ValueError("PrefixStore: the caches it returns code with predictor 'generic' in generation (the "
                             f"stored blocks are adopted as such), got {config.lossless.predictor!r}")
        if predictor not in PREDICTORS:
            raise ValueError(f"PrefixStore: predictor must be one of {list(PREDICTORS)}, got {predictor!r}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1 \
                or chunk_tokens % config.block_tokens:
            raise ValueError(f"PrefixStore: chunk_tokens must be a positive multiple of block_tokens="
                             f"{config.block_tokens}, got {chunk_tokens!r}")
        types = _layer_types(model)
        if set(types) != {"full_attention"}:
            raise ValueError(
                f"PrefixStore: {model.config.model_type} has {sorted(set(types) - {'full_attention'})} layers; the "
                "store holds full-attention KV only (a sliding window drops tokens a stored prefix needs, a recurrent "
                "state is not a sum of chunks)"
            )
        self.model = model
        self.config = config
        self.chunk_tokens = chunk_tokens
        self.predictor = predictor
        self.root = Path(path) if path is not None else cache_dir() / "prefixes"
        self.root.mkdir(parents=True, exist_ok=True)
        if max_bytes is None:
            max_bytes = min(DEFAULT_MAX_BYTES, shutil.disk_usage(self.root).free // 4)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"PrefixStore: max_bytes must be a non-negative int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._calibration = calibration
        self._identity = model_identity(model)
        self._namespace: bytes | None = None
        self.hits = self.misses = self.hit_tokens = self.bytes_saved = 0

    # ------------------------------------------------------------------ public API

    @property
    def calibration(self) -> Calibration | None:
        """The calibration chunks are coded with (a calibrated predictor: found or fitted on first use)."""
        if self.predictor != "generic" and self._calibration is None:
            self._calibration, _ = calibration_for(self.model, predictors=(self.predictor,))
        return self._calibration

    @property
    def folder(self) -> Path:
        """This model's (and settings') chunks."""
        return self.root / self.namespace.hex()[:32]

    @property
    def namespace(self) -> bytes:
        """The first link of every key: what a stored chunk must share to be used (module docstring)."""
        if self._namespace is None:
            calibration = self.calibration
            parts = {
                "format": [FORMAT, VERSION],
                "library_version": __version__,
                "model": self._identity.fingerprint,
                "dtype": self._identity.dtype,
                "predictor": self.predictor,
                "chunk_tokens": self.chunk_tokens,
                # what the chunks' bytes depend on; not workers, decoded_budget, save_predictor, residual_tokens
                "codec": {name: getattr(self.config.lossless, name) for name in self.config.lossless.CODEC_FIELDS},
                "block_tokens": self.config.block_tokens,
                "calibration": calibration.meta["tensors_sha256"] if calibration is not None else None,
            }
            self._namespace = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
        return self._namespace

    def keys(self, ids: torch.Tensor | list[int]) -> list[bytes]:
        """The chained key of every whole chunk of ``ids`` (one row)."""
        row = _one_row(ids)
        keys, key = [], self.namespace
        for at in range(0, len(row) - self.chunk_tokens + 1, self.chunk_tokens):
            key = hashlib.sha256(key + row[at : at + self.chunk_tokens].astype("<i8").tobytes()).digest()
            keys.append(key)
        return keys

    def cache_for(self, ids: torch.Tensor | list[int]) -> CompressedCache:
        """A `CompressedCache` holding the longest stored prefix of ``ids`` (whole chunks, at least one token left
        for the model to compute); an empty one on a miss. One row only: rows of a batch would hold prefixes of
        different lengths, which one cache of one sequence length cannot hold without padding every row's KV."""
        row = _one_row(ids)
        cache = CompressedCache(self.config, model=self.model, calibration=None)
        usable = (len(row) - 1) // self.chunk_tokens  # generate() needs at least one token to compute logits from
        chunks: list[dict[str, Any]] = []
        keys = self.keys(row)[:usable]
        for index, key in enumerate(keys):
            found = self._read_chunk(key, index, row)
            if found is None:
                self.misses += usable - index
                break
            chunks.append(found)
        if not chunks:
            return cache
        self._fill(cache, chunks)
        _touch_chain([self._path(key) for key in keys[: len(chunks)]])
        self.hits += len(chunks)
        self.hit_tokens += len(chunks) * self.chunk_tokens
        self.bytes_saved += sum(c["raw_bytes"] for c in chunks)
        tokens = len(chunks) * self.chunk_tokens
        cache.token_ids = torch.from_numpy(row[:tokens].copy()).unsqueeze(0)
        return cache

    def put(self, ids: torch.Tensor | list[int], cache: Cache) -> int:
        """Store the whole chunks of ``ids`` (one row: the prompt, or ``generate``'s output) that ``cache`` holds
        and the store does not; returns how many tokens were written. ``cache`` must hold the KV of ``ids``' first
        tokens (a `CompressedCache` that recorded other ids is refused)."""
        row = _one_row(ids)
        held = cache.get_seq_length()
        recorded = getattr(cache, "token_ids", None)
        if isinstance(recorded, torch.Tensor) and (recorded.shape[0] != 1 or recorded.shape[1] < held
                                                   or not np.array_equal(recorded[0, :held].numpy(), row[:held])):
            raise ValueError("PrefixStore.put: the cache holds the KV of other tokens than ids")
        self._check_kv(cache)
        written = 0
        paths = []
        whole: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layers read once per put, not once per chunk
        for index, key in enumerate(self.keys(row[: min(held, len(row))])):
            path = self._path(key)
            paths.append(path)
            if path.exists():
                continue
            blob = self._encode_chunk(cache, index, key, row, whole)
            try:
                _write_atomic(path, blob)
            except OSError as err:  # a full disk or a concurrent clear(): the store is a cache, generation goes on
                log.warning("prefix store: could not write %s (%s); stopped storing this prompt", path.name, err)
                paths.pop()
                break
            written += self.chunk_tokens
        _touch_chain(paths)
        if written:
            self.evict()
        return written

    def _check_kv(self, cache: Cache) -> None:
        """The cache's K/V must be this model's: its dtype, KV heads and head size (a cache of another model or
        dtype would be stored under this model's keys)."""
        dtype, heads, dim = self._kv_shape()
        for i, layer in enumerate(cache.layers):
            if not getattr(layer, "is_initialized", False):
                continue
            # a compressed layer's residual has the dtype and shape of its K/V (its .keys would decode every block)
            keys = layer.residual_keys if isinstance(layer, CompressedLayer) else layer.keys
            if keys is None:
                continue
            if keys.dtype != dtype or keys.shape[1] != heads or keys.shape[3] != dim:
                raise ValueError(f"PrefixStore.put: layer {i} holds {keys.dtype} K/V of {keys.shape[1]} heads x "
                                 f"{keys.shape[3]}, this store's model {dtype} of {heads} x {dim}")
            return  # one layer tells: the rest come from the same forward

    def stats(self) -> dict[str, int]:
        """Chunks and bytes on disk for this model and settings, raw bytes they hold, and this process's hits,
        misses (chunks), tokens hit and raw KV bytes served from the store."""
        files = list(self._chunk_files(self.folder))
        per_chunk = self._raw_chunk_bytes()
        return StoreStats(len(files), sum(_size(f) for f in files), len(files) * per_chunk, self.hits,
                          self.misses, self.hit_tokens, self.bytes_saved).as_dict()

    def evict(self) -> int:
        """Remove least recently used chunks (of every model in the folder) until at most ``max_bytes`` remain, and
        stale temporary files; returns the bytes removed."""
        entries = []
        removed = 0
        now = time.time()
        for path in self.root.rglob("*"):
            try:
                info = path.stat()
            except OSError:
                continue
            if path.name.endswith(".tmp") and now - info.st_mtime > STALE_SECONDS:
                removed += _unlink(path, info.st_size)
            elif path.suffix == SUFFIX:
                entries.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            removed += _unlink(path, size)
            total -= size
        return removed

    def clear(self) -> int:
        """Remove every chunk and temporary file under the store's folder; returns the bytes removed."""
        return clear(self.root)

    # ------------------------------------------------------------------ chunks

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def _chunk_files(self, folder: Path) -> Iterator[Path]:
        return folder.glob(f"*{SUFFIX}") if folder.is_dir() else iter(())

    def _raw_chunk_bytes(self) -> int:
        dtype, heads, dim = self._kv_shape()
        return 2 * len(_layer_types(self.model)) * heads * dim * self.chunk_tokens * dtype.itemsize

    def _kv_shape(self) -> tuple[torch.dtype, int, int]:
        """The model's K/V dtype, KV heads and head size (from its weights' dtype and its config)."""
        config = self.model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return next(self.model.parameters()).dtype, heads, dim

    def _coding(self, blocks: dict[tuple[int, int], CodedBlock], portable: bool = True) -> LosslessCoding:
        """A block coder of the store's settings over ``blocks`` (the layer-below lookup of `context`)."""
        calibration = self.calibration
        predictor = make_predictor(self.predictor, calibration=calibration)
        predictor.portable = portable  # chunks are read by other processes (and machines: LMCache tiers)
        settings = self.config.lossless
        marginals = calibration.marginal if calibration is not None and self.predictor != "generic" else None
        return LosslessCoding(predictor, settings.codec_config(), lambda layer, start: blocks.get((layer, start)),
                               marginals, settings.workers)

    def _encode_chunk(self, cache: Cache, index: int, key: bytes, row: np.ndarray,
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
                    whole[layer_idx] = _layer_kv(layer, stop)
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
                           "blocks": [{"start": b.start, "tokens": b.tokens,
                                       "rows": [_write_row(r, payload) for r in b.rows]} for b in taken]})
        dtype = taken[0].dtype
        header = {"format": FORMAT, "version": VERSION, "key": key.hex(), "namespace": self.namespace.hex(),
                  "first": first, "tokens": self.chunk_tokens, "token_ids": row[first:stop].tolist(),
                  "dtype": str(dtype).replace("torch.", ""), "layers": layers, "payload_bytes": len(payload)}
        return _pack(header, payload)

    def _held_blocks(self, cache: Cache, layer: object, first: int, stop: int) -> list[CodedBlock] | None:
        """``layer``'s coded blocks of tokens ``first..stop`` when they are coded exactly as the store codes them
        (a `CompressedCache` in generation with the store's predictor and codec settings), else None."""
        coding = getattr(cache, "lossless", None)
        if self.predictor != "generic" or not isinstance(layer, CompressedLayer) or coding is None \
                or coding.predictor.name != "generic" or coding.codec_config != self.config.lossless.codec_config() \
                or coding.marginals is not None:
            return None
        found = {start: block for start, block in zip(layer.block_starts, layer.blocks)}
        taken = [found.get(at) for at in range(first, stop, self.config.block_tokens)]
        if any(not isinstance(b, CodedBlock) or b.tokens != self.config.block_tokens or len(b.rows) != 1
               for b in taken):
            return None
        return taken  # type: ignore[return-value]

    def _read_chunk(self, key: bytes, index: int, row: np.ndarray) -> dict[str, Any] | None:
        """The checked chunk of ``key`` (header, payload), or None: missing, or damaged (then removed)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            chunk = self._check_chunk(data, key, index, row)
        except CacheFileError as err:
            log.warning("prefix store: %s is damaged (%s); removed, computing its tokens again", path.name, err)
            _unlink(path, 0)
            return None
        return chunk

    def _check_chunk(self, data: bytes, key: bytes, index: int, row: np.ndarray) -> dict[str, Any]:
        if len(data) < _PREFIX.size + _DIGEST or not data.startswith(MAGIC):
            raise CacheFileError(f"truncated or not a prefix chunk ({len(data)} bytes)")
        _magic, version, size = _PREFIX.unpack_from(data, 0)
        if version != VERSION:
            raise CacheFileError(f"chunk format version {version}, this library reads {VERSION}")
        if hashlib.sha256(memoryview(data)[:-_DIGEST]).digest() != data[-_DIGEST:]:
            raise CacheFileError("checksum mismatch: truncated or corrupt")
        end = _PREFIX.size + size
        if end > len(data) - _DIGEST:
            raise CacheFileError("header does not fit the file")
        try:
            header = json.loads(data[_PREFIX.size : end].decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise CacheFileError(f"corrupt header ({err})") from err
        payload = data[end : len(data) - _DIGEST]
        h = _dict(header, "chunk header", {"format", "version", "key", "namespace", "first", "tokens", "token_ids",
                                            "dtype", "layers", "payload_bytes"})
        first = index * self.chunk_tokens
        if (h["format"], h["version"], h["key"], h["namespace"]) != (FORMAT, VERSION, key.hex(), self.namespace.hex()):
            raise CacheFileError("the header names another format, key or namespace")
        if h["first"] != first or h["tokens"] != self.chunk_tokens or h["token_ids"] != row[first:first + self.chunk_tokens].tolist():
            raise CacheFileError("the chunk holds other tokens than its key")  # a hash collision or an edited file
        if h["dtype"] not in DTYPES or _int(h["payload_bytes"], "payload_bytes", 0) != len(payload):
            raise CacheFileError("bad dtype or payload length")
        layers = h["layers"]
        count = len(_layer_types(self.model))
        if not isinstance(layers, list) or len(layers) != count:
            raise CacheFileError(f"holds {len(layers) if isinstance(layers, list) else '?'} layers, the model {count}")
        cursor = [0]
        for i, entry in enumerate(layers):
            entry = _dict(entry, f"layer {i}", {"layer", "heads", "key_dim", "value_dim", "blocks"})
            if entry["layer"] != i:
                raise CacheFileError(f"layer entry {i} names layer {entry['layer']!r}")
            heads = _int(entry["heads"], f"layer {i} heads", 1, 1 << 16)
            _int(entry["key_dim"], f"layer {i} key_dim", 1, 1 << 16)
            _int(entry["value_dim"], f"layer {i} value_dim", 1, 1 << 16)
            _check_blocks(entry["blocks"], f"layer {i}", first, first + self.chunk_tokens, 1, heads,
                          max(entry["key_dim"], entry["value_dim"]), self.config, cursor)
            if any(b["tokens"] != self.config.block_tokens for b in entry["blocks"]):
                raise CacheFileError(f"layer {i}: blocks of another size than block_tokens")
        if cursor[0] != len(payload):
            raise CacheFileError(f"the header describes {cursor[0]} payload bytes, the file holds {len(payload)}")
        h["payload"] = payload
        h["raw_bytes"] = self._raw_chunk_bytes()
        return h

    def _fill(self, cache: CompressedCache, chunks: list[dict[str, Any]]) -> None:
        """Hold the chunks' tokens in ``cache``: their blocks adopted as they are (`generic`), or decoded once and
        coded as generation codes (`context`)."""
        dtype = DTYPES[chunks[0]["dtype"]]
        coding = cache.lossless
        checker: dict[tuple[int, int], CodedBlock] = {}
        source = self._coding(checker) if self.predictor != "generic" else None
        sides: dict[tuple, dict] = {}
        per_layer: dict[int, list[CodedBlock]] = {}
        for chunk in chunks:
            for entry in chunk["layers"]:
                i = entry["layer"]
                for b in entry["blocks"]:
                    rows = [_read_row(r, chunk["payload"]) for r in b["rows"]]
                    block = CodedBlock(source or coding, i, b["start"], b["tokens"], rows, entry["heads"],
                                       entry["key_dim"], dtype, _layer_device(self.model, i), value_dim=entry["value_dim"])
                    try:
                        _check_block(block, source or coding, (source or coding).predictor, sides)
                    except CacheFileError as err:
                        raise ValueError(f"prefix store: a chunk that passed its checksum does not decode: {err}") \
                            from err
                    checker[(i, b["start"])] = block
                    per_layer.setdefault(i, []).append(block)
        for i, blocks in sorted(per_layer.items()):
            layer = cache.layers[i]
            first = blocks[0]
            if source is None:
                layer.adopt(blocks)
            else:
                decoded = [source.decoded(block) for block in blocks]
                keys = torch.cat([d.keys for d in decoded], dim=2).to(first.device)
                values = torch.cat([d.values for d in decoded], dim=2).to(first.device)
                cache.update(keys, values, i)
        if coding is not None:
            cache._blocks_changed()


# ---------------------------------------------------------------------- folder-level tools (the CLI's)


def folder_usage(root: str | Path) -> list[dict[str, Any]]:
    """Per model folder under ``root``: chunks, bytes and the newest use (a Unix time)."""
    out = []
    root = Path(root)
    if not root.is_dir():
        return out
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = list(folder.glob(f"*{SUFFIX}"))
        temps = list(folder.glob("*.tmp"))
        out.append({"folder": folder.name, "chunks": len(files), "bytes": sum(_size(f) for f in files),
                    "temporary_files": len(temps), "last_used": max((_mtime(f) for f in files), default=None)})
    return out


def clear(root: str | Path) -> int:
    """Remove every chunk and temporary file under ``root`` (and the emptied folders); returns bytes removed."""
    removed = 0
    root = Path(root)
    if not root.is_dir():
        return 0
    for path in list(root.rglob("*")):
        if path.is_file() and (path.suffix == SUFFIX or path.name.endswith(".tmp")):
            removed += _unlink(path, _size(path))
    for folder in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed


# ---------------------------------------------------------------------- helpers


def _one_row(ids: torch.Tensor | list[int] | np.ndarray) -> np.ndarray:
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype == np.int64:  # already checked
        return ids
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"PrefixStore: one row at a time, got a batch of {ids.shape[0]} (rows of a batch hold "
                                 "prefixes of different lengths; look each row up on its own)")
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"PrefixStore: ids must be integer token ids [tokens] or [1, tokens], got {ids.dtype} "
                             f"{list(ids.shape)}")
        return ids.detach().cpu().numpy().astype(np.int64)
    if isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return np.asarray(ids, dtype=np.int64)
    raise ValueError(f"PrefixStore: ids must be a tensor or a list of ints, got {type(ids).__name__}")


def _layer_types(model: torch.nn.Module) -> list[str]:
    return get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]


def _layer_kv(layer: object, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values (one row, at least ``stop`` tokens), on the host."""
    keys, values = layer.keys, layer.values
    if keys is None or keys.shape[0] != 1 or keys.shape[2] < stop:
        raise ValueError("PrefixStore.put: the cache holds fewer tokens (or more rows) than asked for")
    if keys.shape[2] != layer.get_seq_length():  # checked before the first chunk is written
        raise ValueError(f"PrefixStore.put: a cache layer holds {keys.shape[2]} entries for {layer.get_seq_length()} "
                         "tokens (a lossy or sliding-window cache); the store takes the exact KV of every token")
    return keys.cpu(), values.cpu()


def _pack(header: dict[str, Any], payload: bytearray) -> bytes:
    blob = json.dumps(header, separators=(",", ":")).encode()
    head = _PREFIX.pack(MAGIC, VERSION, len(blob))
    body = head + blob + bytes(payload)
    return body + hashlib.sha256(body).digest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file: a temporary file in the same folder,
    then a rename (atomic on POSIX); another writer of the same chunk writes the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep other users' processes from reading a shared store
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(Path(tmp), 0)
        raise


def _touch_chain(paths: list[Path]) -> None:
    """Mark a prompt's chunks (in chain order) used now, each a microsecond older than the one before it: eviction
    takes the least recently used first, so a chain loses its tail before its head (a chunk is of no use without
    every chunk before it; same-time marks would leave the order to sizes and names)."""
    now = time.time_ns()
    for index, path in enumerate(paths):
        with contextlib.suppress(OSError):  # evicted meanwhile
            os.utime(path, ns=(now - 1000 * index, now - 1000 * index))


def _unlink(path: Path, size: int) -> int:
    try:
        path.unlink()
        return size
    except OSError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
