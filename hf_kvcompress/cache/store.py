"""`PrefixStore`: an embedded, compressed store of prompt prefixes' KV, shared by processes on one machine.

A prompt's tokens are cut into chunks of ``chunk_tokens``; chunk ``i`` is keyed by a chained hash (as vLLM and
LMCache key prefixes): ``key_0 = namespace``, ``key_{i+1} = sha256(key_i || ids of chunk i)``, where the
namespace hashes the model's fingerprint (weights, dtype, config), the library version, the chunk format, the
coding settings and the calibration's checksum, so another model, dtype, library version or calibration never
matches. A chunk file holds every layer's blocks of its tokens, coded as generation codes them (the cache's
block coder: `generic` statistics, the cache's codec settings), so a hit is adopted by a `CompressedCache`
without decoding: its blocks decode when attention first reads them. With ``predictor="context"`` (a
calibration) chunks are ~20 % smaller and are transcoded once on lookup (slower to the first token).

Safety (docs/prefix_store.md "Trust"): a chunk is written to a temporary file in its folder and renamed (atomic
on POSIX), so readers never see a partial chunk; a writer holds a lock on its temporary file, so one killed
mid-put leaves a file that the next eviction reclaims (and counts toward ``max_bytes`` until then). Every read
takes regular files only (no FIFO, device, folder or link), bounded by what a chunk of this model can hold, and
checks the whole file (SHA-256, or a keyed HMAC with ``secret``; header structure against the model's K/V shape,
streams, the chunk's own token ids); a hit is then decoded once and layer 0's keys compared with the model's
keys of the prompt's tokens (`binding`). Any chunk that fails is a miss, logged in one warning line and removed.
The store owns its folder (a marker file in it) and only touches names it produces there. ``max_bytes`` bounds
the folder: after a put the least recently used chunks (file modification times, refreshed on every hit) go
first.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import stat
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

from ..blockcodec import BlockCodec, CodedBlock
from ..calibration import Calibration, calibration_for
from ..config import CompressionConfig
from ..downloads import cache_dir
from ..errors import CacheFileError
from ..identity import model_identity
from ..layer import CompressedLayer
from ..predictors import make_predictor
from ..version import __version__
from .binding import bindable, binding_problem
from .cache import CompressedCache
from .coded import LosslessCoding
from .persist import (
    DTYPES,
    _check_block,
    _check_blocks,
    _dict,
    _int,
    _layer_device,
    _read_row,
    _write_row,
    open_regular,
    read_exactly,
)

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
#: a temporary file older than this whose writer holds no lock on it is a killed writer's leftover (younger: its
#: writer may be between creating and locking it, microseconds apart)
TEMP_GRACE_SECONDS = 10.0
#: where locks do not work (some network file systems), temporary files older than this are leftovers
STALE_SECONDS = 3600.0
#: the file that marks a folder as a store's: the store refuses to take over a non-empty folder without it
MARKER = ".hf_kvcompress-prefix-store"
#: the names the store creates: one folder per namespace, chunk files and temporary files in it (mkstemp's)
_FOLDER = re.compile(r"[0-9a-f]{32}")
#: the fields of a chunk's header; "model", the model's name for listings (`folder_model`), may be absent too
_HEADER_FIELDS = {"format", "version", "key", "namespace", "first", "tokens", "token_ids", "dtype", "layers",
                  "payload_bytes"}
_CHUNK = re.compile(r"[0-9a-f]{64}\.kvp")
_TEMP = re.compile(r"\.[0-9a-f]{16}\.[a-z0-9_]+\.tmp")


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
        path: the folder (default ``$HF_KVCOMPRESS_CACHE/prefixes``): new, empty or a store's (it holds the
            `MARKER` file); several models may share one.
        max_bytes: bound on the folder's chunk bytes (default `DEFAULT_MAX_BYTES` or a quarter of the free disk).
        chunk_tokens: tokens per chunk, a multiple of the cache's ``block_tokens`` (128).
        predictor: ``"generic"`` (per-block statistics: 0.65x raw, adopted without decoding), ``"below"`` (the
            layer below through the calibration's maps, a kind at a time: docs/results/lossless.md "Calibrated
            coding in batches (issue 34)") or ``"context"``
            (the model's calibration, found or fitted on first use: ~0.52x raw, transcoded on lookup).
        config: the lossless configuration of the caches `cache_for` returns (default ``CompressionConfig()``).
        secret: bytes that key an HMAC-SHA256 over every chunk instead of the plain SHA-256, for a folder that
            others can write (docs/prefix_store.md "Trust"); stores with other secrets never share chunks.
    """

    def __init__(self, model: torch.nn.Module, *, path: str | os.PathLike | None = None,
                 max_bytes: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, predictor: str = "generic",
                 config: CompressionConfig | None = None, calibration: Calibration | None = None,
                 secret: bytes | None = None):
        if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "get_text_config"):
            raise TypeError(f"PrefixStore: model must be a transformers model, got {type(model).__name__}")
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
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise TypeError(f"PrefixStore: secret must be non-empty bytes or None, got {type(secret).__name__}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"PrefixStore: max_bytes must be a positive int (bytes), got {max_bytes!r}")
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
        self._secret = secret
        _check_bindable(model)
        self.root = _claim(path)
        if max_bytes is None:
            max_bytes = max(1, min(DEFAULT_MAX_BYTES, shutil.disk_usage(self.root).free // 4))
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
            if self._secret is not None:  # a value only the secret's holders compute: their own folder
                parts["keyed"] = hmac.new(self._secret, b"hf_kvcompress.prefix_store", hashlib.sha256).hexdigest()
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
        different lengths, which one cache of one sequence length cannot hold without padding every row's KV.
        A stored chunk that fails any check, decodes wrongly or holds keys the model does not compute for these
        tokens is a miss (one warning, the chunk removed): this never raises for what is on disk."""
        row = _one_row(ids)
        usable = (len(row) - 1) // self.chunk_tokens  # generate() needs at least one token to compute logits from
        keys = self.keys(row)[:usable]
        chunks: list[dict[str, Any]] = []
        if keys and _own_folder(self.folder, create=False):
            for index, key in enumerate(keys):
                found = self._read_chunk(key, index, row)
                if found is None:
                    break
                chunks.append(found)
        cache, chunks = self._adopt(row, chunks)
        self.misses += usable - len(chunks)
        if not chunks:
            return cache
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
        tokens (and may hold more): a `CompressedCache` that recorded other ids, or a cache whose layer-0 keys are
        not what the model computes for ``ids``, is refused with a ``ValueError`` before anything is written."""
        row = _one_row(ids)
        held = cache.get_seq_length()
        recorded = getattr(cache, "token_ids", None)
        common = min(held, len(row))
        if isinstance(recorded, torch.Tensor) and (recorded.shape[0] != 1 or recorded.shape[1] < held
                                                   or not np.array_equal(recorded[0, :common].numpy(), row[:common])):
            raise ValueError("PrefixStore.put: the cache holds the KV of other tokens than ids")
        self._check_kv(cache)
        keys = self.keys(row[:common])
        paths = [self._path(key) for key in keys]
        todo = [i for i, path in enumerate(paths) if not _is_regular(path)]
        if not todo:  # all held: marked used
            _touch_chain(paths)
            return 0
        if not _own_folder(self.folder, create=True):
            return 0
        stop = (todo[-1] + 1) * self.chunk_tokens
        whole: dict[int, tuple[torch.Tensor, torch.Tensor]] = {0: _layer_kv(cache.layers[0], stop)}
        problem = binding_problem(self.model, torch.from_numpy(row[:stop].copy()).unsqueeze(0), 0,
                                  whole[0][0][:, :, :stop])
        if problem is not None:
            raise ValueError(f"PrefixStore.put: {problem[1]}; nothing stored")
        written = 0
        for index in todo:
            blob = self._encode_chunk(cache, index, keys[index], row, whole)
            try:
                _write_atomic(paths[index], blob)
            except OSError as err:  # a full disk or a concurrent clear(): the store is a cache, generation goes on
                log.warning("prefix store: could not write %s (%s); stopped storing this prompt", paths[index].name,
                            err)
                paths = paths[:index]
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
        files = [(path, info) for path, info, chunk in _own_files(self.folder) if chunk]
        per_chunk = self._raw_chunk_bytes()
        return StoreStats(len(files), sum(info.st_size for _, info in files), len(files) * per_chunk, self.hits,
                          self.misses, self.hit_tokens, self.bytes_saved).as_dict()

    def evict(self) -> int:
        """Remove least recently used chunks (of every model in the folder) until at most ``max_bytes`` remain,
        counting the temporary files of writers still at work, and reclaim those of writers gone; returns the
        bytes removed."""
        entries = []
        removed = writing = 0
        for folder in _namespace_folders(self.root):
            for path, info, chunk in _own_files(folder):
                if chunk:
                    entries.append((info.st_mtime, info.st_size, path))
                elif _writer_gone(path, info):
                    removed += _unlink(path, info.st_size)
                else:
                    writing += info.st_size
        total = writing + sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            removed += _unlink(path, size)
            total -= size
        return removed

    def clear(self) -> int:
        """Remove every chunk and temporary file of the store's folder; returns the bytes removed."""
        return clear(self.root)

    # ------------------------------------------------------------------ chunks

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def _raw_chunk_bytes(self) -> int:
        dtype, heads, dim = self._kv_shape()
        return 2 * len(_layer_types(self.model)) * heads * dim * self.chunk_tokens * dtype.itemsize

    def _max_chunk_bytes(self) -> int:
        """The most a chunk file of this model may hold: twice its raw K/V (coded streams of incompressible
        values hold a little more than raw; side data are ~1 %) and 1 MiB of header (its JSON: ~20 KiB for 30
        layers)."""
        return 2 * self._raw_chunk_bytes() + (1 << 20)

    def _kv_shape(self) -> tuple[torch.dtype, int, int]:
        """The model's K/V dtype, KV heads and head size (from its weights' dtype and its config)."""
        config = self.model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return next(self.model.parameters()).dtype, heads, dim

    def _digest(self, body: bytes | memoryview) -> bytes:
        """A chunk's trailing digest: SHA-256, or HMAC-SHA256 keyed by ``secret``."""
        if self._secret is not None:
            return hmac.new(self._secret, body, hashlib.sha256).digest()
        return hashlib.sha256(body).digest()

    @functools.cached_property
    def _codec(self) -> BlockCodec:
        """The store's block codec without blocks, built once: what `BlockCodec.codes_like` compares."""
        return self._coding({})

    def _coding(self, blocks: dict[tuple[int, int], CodedBlock]) -> BlockCodec:
        """A block codec of the store's settings over ``blocks`` (the layer-below lookup of `context`); portable:
        chunks are read by other processes (and machines: LMCache tiers)."""
        predictor = make_predictor(self.predictor, calibration=self.calibration, portable=True)
        return BlockCodec.over(self.config.lossless, predictor, self.calibration,
                               lambda layer, start: blocks.get((layer, start)))

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
                  "dtype": str(dtype).replace("torch.", ""), "layers": layers, "payload_bytes": len(payload),
                  "model": _model_name(self.model)}
        blob = json.dumps(header, separators=(",", ":")).encode()
        body = _PREFIX.pack(MAGIC, VERSION, len(blob)) + blob + bytes(payload)
        return body + self._digest(body)

    def _held_blocks(self, cache: Cache, layer: object, first: int, stop: int) -> list[CodedBlock] | None:
        """``layer``'s coded blocks of tokens ``first..stop`` when they are coded exactly as the store codes them
        (a `CompressedCache` in generation with the store's predictor and codec settings), else None."""
        coding = getattr(cache, "lossless", None)
        if not isinstance(layer, CompressedLayer) or coding is None or not self._codec.codes_like(coding):
            return None
        found = {start: block for start, block in zip(layer.block_starts, layer.blocks)}
        taken = [found.get(at) for at in range(first, stop, self.config.block_tokens)]
        if any(not isinstance(b, CodedBlock) or b.tokens != self.config.block_tokens or len(b.rows) != 1
               for b in taken):
            return None
        return taken  # type: ignore[return-value]

    def _read_chunk(self, key: bytes, index: int, row: np.ndarray) -> dict[str, Any] | None:
        """The checked chunk of ``key`` (header, payload), or None: missing, or anything else than a chunk of this
        store (then removed: a damaged file, a FIFO, a link, a file larger than a chunk can be)."""
        path = self._path(key)
        try:
            fd, size = open_regular(path, follow_links=False)
        except CacheFileError as err:
            if not isinstance(err.__cause__, FileNotFoundError):
                self._drop(path, err)
            return None
        try:
            cap = self._max_chunk_bytes()
            if size > cap:  # a sparse or planted file: never read
                raise CacheFileError(f"{size} bytes, more than a chunk of this model can hold ({cap})")
            return self._check_chunk(read_exactly(fd, size), key, index, row)
        except Exception as err:  # any parse failure (a 4,300-digit integer is a ValueError of its own)
            self._drop(path, err)
            return None
        finally:
            os.close(fd)

    def _drop(self, path: Path, why: object) -> None:
        log.warning("prefix store: %s is damaged (%s); removed, computing its tokens again", path.name, why)
        _unlink(path, 0)  # never follows a link: a link planted at a chunk's name is removed, not its target

    def _check_chunk(self, data: bytes, key: bytes, index: int, row: np.ndarray) -> dict[str, Any]:
        if len(data) < _PREFIX.size + _DIGEST or not data.startswith(MAGIC):
            raise CacheFileError(f"truncated or not a prefix chunk ({len(data)} bytes)")
        _magic, version, size = _PREFIX.unpack_from(data, 0)
        if version != VERSION:
            raise CacheFileError(f"chunk format version {version}, this library reads {VERSION}")
        if not hmac.compare_digest(self._digest(memoryview(data)[:-_DIGEST]), data[-_DIGEST:]):
            keyed = " or written without this store's secret" if self._secret is not None else ""
            raise CacheFileError(f"checksum mismatch: truncated or corrupt{keyed}")
        end = _PREFIX.size + size
        if end > len(data) - _DIGEST:
            raise CacheFileError("header does not fit the file")
        try:
            header = json.loads(data[_PREFIX.size : end].decode())
        except Exception as err:
            raise CacheFileError(f"corrupt header ({type(err).__name__}: {err})") from err
        payload = data[end : len(data) - _DIGEST]
        h = _dict(header, "chunk header", None)
        if set(h) - {"model"} != _HEADER_FIELDS or not isinstance(h.get("model", ""), str):
            raise CacheFileError("the chunk header's fields are not a chunk's")  # "model" (a label) is optional
        first = index * self.chunk_tokens
        if (h["format"], h["version"], h["key"], h["namespace"]) != (FORMAT, VERSION, key.hex(), self.namespace.hex()):
            raise CacheFileError("the header names another format, key or namespace")
        if h["first"] != first or h["tokens"] != self.chunk_tokens or h["token_ids"] != row[first:first + self.chunk_tokens].tolist():
            raise CacheFileError("the chunk holds other tokens than its key")  # a hash collision or an edited file
        dtype, heads, dim = self._kv_shape()
        if DTYPES.get(h["dtype"]) != dtype or _int(h["payload_bytes"], "payload_bytes", 0) != len(payload):
            raise CacheFileError(f"dtype {h['dtype']!r} (the model's K/V: {dtype}) or payload length")
        layers = h["layers"]
        count = len(_layer_types(self.model))
        if not isinstance(layers, list) or len(layers) != count:
            raise CacheFileError(f"holds {len(layers) if isinstance(layers, list) else '?'} layers, the model {count}")
        cursor = [0]
        for i, entry in enumerate(layers):
            entry = _dict(entry, f"layer {i}", {"layer", "heads", "key_dim", "value_dim", "blocks"})
            if (entry["layer"], entry["heads"], entry["key_dim"]) != (i, heads, dim):  # as `_check_kv` checks puts
                raise CacheFileError(f"layer entry {i} names layer {entry['layer']!r} of {entry['heads']!r} heads x "
                                     f"{entry['key_dim']!r}, the model {heads} x {dim}")
            value_dim = _int(entry["value_dim"], f"layer {i} value_dim", 1, 1 << 16)
            _check_blocks(entry["blocks"], f"layer {i}", first, first + self.chunk_tokens, 1, heads,
                          max(dim, value_dim), self.config, cursor)
            if any(b["tokens"] != self.config.block_tokens for b in entry["blocks"]):
                raise CacheFileError(f"layer {i}: blocks of another size than block_tokens")
        if cursor[0] != len(payload):
            raise CacheFileError(f"the header describes {cursor[0]} payload bytes, the file holds {len(payload)}")
        h["payload"] = payload
        h["raw_bytes"] = self._raw_chunk_bytes()
        return h

    def _adopt(self, row: np.ndarray, chunks: list[dict[str, Any]]) -> tuple[CompressedCache, list[dict[str, Any]]]:
        """A cache holding the longest run of ``chunks`` that fills, decodes and binds to ``row``'s tokens (each
        chunk that fails removed with a warning), and that run."""
        while True:
            cache = CompressedCache(self.config, model=self.model, calibration=None)
            if not chunks:
                return cache, chunks
            try:
                bad = self._first_bad(cache, row, len(chunks), self._fill(cache, chunks))
            except _BadChunk as err:
                bad = (err.index, err.why)
            except Exception as err:  # not attributable to one chunk: a miss, nothing removed
                log.warning("prefix store: a hit of %d chunks could not be adopted (%s: %s); computing its tokens "
                            "again", len(chunks), type(err).__name__, err)
                return CompressedCache(self.config, model=self.model, calibration=None), []
            if bad is None:
                return cache, chunks
            index, why = bad
            self._drop(self.folder / f"{chunks[index]['key']}{SUFFIX}", why)
            chunks = chunks[:index]

    def _first_bad(self, cache: CompressedCache, row: np.ndarray, count: int,
                   keys0: torch.Tensor | None) -> tuple[int, str] | None:
        """The first of the ``count`` chunks ``cache`` holds that does not decode or whose layer-0 keys are not
        the model's for ``row``'s tokens, with why; None if all are sound. Adopted blocks (``keys0`` None) are
        decoded here once (verifying each stream), so that no stored stream first fails inside `generate`."""
        if keys0 is None:
            coding = cache.lossless
            for layer in cache.kv_layers():
                try:
                    decoded = coding.read_all(layer.blocks)
                except Exception:
                    return self._failing_chunk(coding, layer.blocks, count)
                keys0 = keys0 if keys0 is not None else torch.cat([k for k, _ in decoded], dim=2)
        tokens = count * self.chunk_tokens
        found = binding_problem(self.model, torch.from_numpy(row[:tokens].copy()).unsqueeze(0), 0, keys0)
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

    def _fill(self, cache: CompressedCache, chunks: list[dict[str, Any]]) -> torch.Tensor | None:
        """Hold the chunks' tokens in ``cache``: their blocks adopted as they are (`generic`), or decoded once and
        coded as generation codes (`context`: layer 0's keys, decoded here, returned). A failure that one chunk
        causes raises `_BadChunk` naming it."""
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
                for b in entry["blocks"]:
                    with _blame(number):
                        rows = [_read_row(r, chunk["payload"]) for r in b["rows"]]
                        block = CodedBlock(i, b["start"], b["tokens"], rows, entry["heads"],
                                           entry["key_dim"], dtype, _layer_device(self.model, i),
                                           value_dim=entry["value_dim"])
                        _check_block(block, source or coding, (source or coding).predictor, sides)
                    checker[(i, b["start"])] = block
                    per_layer.setdefault(i, []).append(block)
        keys0 = None
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
            keys0 = keys if i == 0 else keys0
            cache.update(keys, values, i)
        if coding is not None:
            cache._blocks_changed()
        return keys0


class _BadChunk(Exception):
    """Chunk ``index`` of a hit failed (``why``)."""

    def __init__(self, index: int, why: str):
        super().__init__(why)
        self.index, self.why = index, why


@contextlib.contextmanager
def _blame(index: int) -> Iterator[None]:
    """Whatever fails inside is chunk ``index``'s fault: a `_BadChunk`."""
    try:
        yield
    except _BadChunk:
        raise
    except Exception as err:
        raise _BadChunk(index, f"does not decode: {type(err).__name__}: {err}") from err


# ---------------------------------------------------------------------- folder-level tools (the CLI's)


def folder_usage(root: str | Path) -> list[dict[str, Any]]:
    """Per model folder under ``root`` (a store's folder): chunks, bytes and the newest use (a Unix time)."""
    out = []
    for folder in sorted(_namespace_folders(Path(root)), key=lambda f: f.name):
        files = list(_own_files(folder))
        chunks = [info for _, info, chunk in files if chunk]
        out.append({"folder": folder.name, "chunks": len(chunks), "bytes": sum(info.st_size for info in chunks),
                    "temporary_files": len(files) - len(chunks),
                    "last_used": max((info.st_mtime for info in chunks), default=None)})
    return out


def folder_model(folder: str | Path) -> str | None:
    """What the newest chunk in ``folder`` says of its model: its name (chunks written since 2026-12-04), dtype,
    layers, KV heads x key width, from its header alone (read-only, unchecked: for listings), or None without a
    readable one."""
    chunks = [(info.st_mtime, path) for path, info, chunk in _own_files(Path(folder)) if chunk]
    for _, path in sorted(chunks, reverse=True)[:1]:
        try:
            fd, _size = open_regular(path, follow_links=False)  # regular files only: no FIFO to block on
            try:
                magic, _version, size = _PREFIX.unpack(read_exactly(fd, _PREFIX.size))
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


def clear(root: str | Path) -> int:
    """Remove every chunk and temporary file of the store at ``root`` (and the folders that leaves empty);
    returns bytes removed. Only names the store creates, in its own namespace folders: nothing else is touched
    (a folder that is no store's is refused with a ``ValueError``)."""
    root = Path(root)
    if not root.is_dir():
        return 0
    if not _is_store(root):
        raise ValueError(f"{root} is not a prefix store's folder (no {MARKER} file, and it holds other files)")
    removed = 0
    for folder in _namespace_folders(root):
        for path, info, _chunk in list(_own_files(folder)):
            removed += _unlink(path, info.st_size)
        with contextlib.suppress(OSError):  # left non-empty by files that are not the store's
            folder.rmdir()
    return removed


# ---------------------------------------------------------------------- the folder: what the store owns


def _claim(path: object) -> Path:
    """The store's root for ``path``: created if missing, marked as a store's (`MARKER`) if new or empty (or a
    store's from before the marker: namespace folders only); any other folder is refused."""
    if path is None:
        root = cache_dir() / "prefixes"
    elif isinstance(path, (str, os.PathLike)):
        if os.fspath(path) in ("", b""):
            raise ValueError("PrefixStore: path is empty; name the store's folder (the working directory is not one)")
        root = Path(os.fsdecode(path))
    else:
        raise TypeError(f"PrefixStore: path must be a str or os.PathLike folder, got {type(path).__name__}")
    if root.exists() and not root.is_dir():
        raise ValueError(f"PrefixStore: path {str(root)!r} is not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:
        raise ValueError(f"PrefixStore: path {str(root)!r} is not a folder") from err
    if not _is_store(root):
        raise ValueError(f"PrefixStore: path {str(root)!r} holds files that are not a prefix store's (no {MARKER} "
                         "file); name a new or empty folder")
    marker = root / MARKER
    if not _is_regular(marker):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            pass  # another process marked it meanwhile
        else:
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps({"format": "hf_kvcompress.prefix_store", "version": VERSION}) + "\n")
    return root


def _is_store(root: Path) -> bool:
    """Whether ``root`` is a store's folder: it holds the marker, or nothing but namespace folders (empty, or
    written before the marker existed)."""
    if _is_regular(root / MARKER):
        return True
    with os.scandir(root) as entries:
        return all(_FOLDER.fullmatch(e.name) and e.is_dir(follow_symlinks=False) for e in entries)


def _check_bindable(model: torch.nn.Module) -> None:
    problem = bindable(model)
    if problem is not None:
        raise ValueError(f"PrefixStore: {problem}; the store holds only K/V it can check against the model")


def _own_folder(folder: Path, *, create: bool) -> bool:
    """Whether ``folder`` (a namespace folder) is a real folder to read or write chunks in (``create``: made if
    missing); a link or another file there is refused once per process, with a warning."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        if not create:
            return False
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        info = os.lstat(folder)
    if stat.S_ISDIR(info.st_mode):
        return True
    if folder not in _REFUSED:
        _REFUSED.add(folder)
        log.warning("prefix store: %s is a link or not a folder; nothing is read or written through it", folder)
    return False


_REFUSED: set[Path] = set()


def _namespace_folders(root: Path) -> list[Path]:
    """The namespace folders directly under ``root`` (real folders of the store's names; links are not
    followed)."""
    try:
        with os.scandir(root) as entries:
            return [Path(e.path) for e in entries if _FOLDER.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _own_files(folder: Path) -> Iterator[tuple[Path, os.stat_result, bool]]:
    """The regular files in ``folder`` named as the store names them: (path, stat, whether a chunk: else a
    temporary file)."""
    try:
        with os.scandir(folder) as entries:
            found = [e for e in entries if (_CHUNK.fullmatch(e.name) or _TEMP.fullmatch(e.name))
                     and e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for entry in found:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        yield Path(entry.path), info, entry.name.endswith(SUFFIX)


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _writer_gone(path: Path, info: os.stat_result) -> bool:
    """Whether a temporary file's writer is gone: it holds no lock on it (a writer locks its file from creation to
    rename; the kernel drops the lock of a killed process). Without locks (some network file systems), its age."""
    age = time.time() - info.st_mtime
    if age < TEMP_GRACE_SECONDS:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return age > STALE_SECONDS
    finally:
        os.close(fd)


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
        row = ids.detach().cpu().numpy().astype(np.int64)
    elif isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        if any(not 0 <= t < 1 << 63 for t in ids):
            raise ValueError("PrefixStore: ids must be token ids in [0, 2**63), got "
                             f"{next(t for t in ids if not 0 <= t < 1 << 63)}")
        row = np.asarray(ids, dtype=np.int64)
    else:
        raise ValueError(f"PrefixStore: ids must be a tensor or a list of ints, got {type(ids).__name__}")
    if row.size and int(row.min()) < 0:
        raise ValueError(f"PrefixStore: ids must be token ids (>= 0), got {int(row.min())}")
    return row


def _layer_types(model: torch.nn.Module) -> list[str]:
    return get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]


def _layer_kv(layer: object, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values (one row, at least ``stop`` tokens), on the host."""
    keys, values = layer.keys, layer.values
    if keys is not None and keys.shape[2] != layer.get_seq_length():  # checked before the first chunk is written
        raise ValueError(f"PrefixStore.put: a cache layer holds {keys.shape[2]} entries for {layer.get_seq_length()} "
                         "tokens (a lossy or sliding-window cache); the store takes the exact KV of every token")
    if keys is None or keys.shape[0] != 1 or keys.shape[2] < stop:
        raise ValueError("PrefixStore.put: the cache holds fewer tokens (or more rows) than asked for")
    return keys.cpu(), values.cpu()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file: a temporary file in the same folder,
    locked while it is written (`_writer_gone`), then a rename (atomic on POSIX; it replaces whatever is at
    ``path`` without following it); another writer of the same chunk writes the same bytes."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        with contextlib.suppress(OSError):  # no locks here: a killed writer's file goes after STALE_SECONDS
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep other users' processes from reading a shared store
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.replace(tmp, path)  # still locked: an evicting process never takes it for a leftover
    except BaseException:
        _unlink(Path(tmp), 0)
        raise


def _touch_chain(paths: list[Path]) -> None:
    """Mark a prompt's chunks (in chain order) used now, each a microsecond older than the one before it: eviction
    takes the least recently used first, so a chain loses its tail before its head (a chunk is of no use without
    every chunk before it; same-time marks would leave the order to sizes and names). Links are not followed."""
    now = time.time_ns()
    for index, path in enumerate(paths):
        with contextlib.suppress(OSError, NotImplementedError):  # evicted meanwhile
            os.utime(path, ns=(now - 1000 * index, now - 1000 * index), follow_symlinks=False)


def _unlink(path: Path, size: int) -> int:
    try:
        path.unlink()
        return size
    except OSError:
        return 0
