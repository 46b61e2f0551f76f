"""`PrefixStore`: an embedded, compressed store of prompt prefixes' KV, shared by processes on one machine.

A prompt's tokens are cut into chunks of ``chunk_tokens``; chunk ``i`` is keyed by a chained hash (as vLLM and
LMCache key prefixes): ``key_0 = namespace``, ``key_{i+1} = sha256(key_i || ids of chunk i)``, where the
namespace hashes the model's fingerprint (weights, dtype, config), the library version, the chunk format, the
coding settings and the calibration's checksum, so another model, dtype, library version or calibration never
matches. A chunk file holds every full layer's blocks of its tokens (a window layer's: those its window needs at
the chunk's end, `chunks.Chunks.window_first`), coded as generation codes them (the cache's
block coder: `generic` statistics, the cache's codec settings), so a hit is adopted by a `CompressedCache`
without decoding: its blocks decode when attention first reads them. With ``predictor="context"`` (a
calibration) chunks are ~20 % smaller and are transcoded once on lookup (slower to the first token).

Safety (docs/prefix_store.md "Trust"): a chunk is written to a temporary file in its folder and renamed (atomic
on POSIX), so readers never see a partial chunk; a writer holds a lock on its temporary file, so one killed
mid-put leaves a file that the next eviction reclaims (and counts toward ``max_bytes`` until then). Every read
takes regular files only (no FIFO, device, folder or link), bounded by what a chunk of this model can hold, and
checks the whole file (SHA-256, or a keyed HMAC with ``secret``; header structure against the model's K/V shape,
streams, the chunk's own token ids); a hit is then decoded once and layer 0's keys compared with the model's
keys and values compared with the model's layer 0 for the prompt's tokens (`binding`). Any chunk that fails is a
miss, logged in one warning line and removed. The store owns its folder (a marker file in it) and only touches
names it produces there, each through a descriptor of the folder it checked (`store_folder`: a folder swapped for
a link meanwhile never redirects a read or write outside it). ``max_bytes`` bounds
the folder: after a put the least recently used chunks (file modification times, refreshed on every hit) go
first.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from ..calibration import Calibration
from ..config import CompressionConfig
from ..errors import CacheFileError
from ..identity import model_identity
from ..layer import CompressedLayer
from ..predictors.registry import AUTO
from ..version import __version__
from .binding import bindable, binding_problem
from .cache import CompressedCache
from .chunks import FORMAT, MAGIC, VERSION, BadChunk, Chunks, folder_model, layer_kv
from .container import read_regular
from .store_folder import (
    MARKER,
    SUFFIX,
    claim,
    clear,
    clear_at,
    each_folder,
    folder_usage,
    is_regular,
    open_folder,
    opened,
    own_files,
    touch_chain,
    unlink,
    write_atomic,
    writer_gone,
)

#: the folder-level tools the CLI runs and the names tests and docs cite, where they always were
__all__ = ["DEFAULT_CHUNK_TOKENS", "DEFAULT_MAX_BYTES", "FORMAT", "MAGIC", "MARKER", "PREDICTORS", "SUFFIX", "VERSION",
           "PrefixStore", "StoreStats", "clear", "folder_model", "folder_usage"]

log = logging.getLogger(__name__)

#: the default bound: 8 GiB (about 570,000 tokens of SmolLM2-135M KV at the generic rate, 0.65 x 45 MiB per 2,048
#: tokens), or a quarter of the disk space free when the store is opened, whichever is smaller
DEFAULT_MAX_BYTES = 8 << 30
#: LMCache's and vLLM's default chunk size: a chunk of this store and one of an LMCache deployment cover the same
#: tokens
DEFAULT_CHUNK_TOKENS = 256
#: the predictors a store may name: `AUTO` (calibrated storage where the model's calibration allows it, the default),
#: ``"generic"`` (turns it off) and the calibrated ones whose blocks need no model rerun
PREDICTORS = (AUTO, "generic", "grid", "context", "below")


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
        model: the model whose KV is stored: full-attention and sliding-window (or chunked) layers, and layers
            holding no K/V of their own (KV sharing: nothing stored for them); recurrent, convolution and
            linear-attention layers are refused, saying why (docs/prefix_store.md "What a chunk holds per layer
            kind").
        path: the folder (default ``$HF_KVCOMPRESS_CACHE/prefixes``): new, empty or a store's (it holds the
            `MARKER` file); several models may share one.
        max_bytes: bound on the folder's chunk bytes (default `DEFAULT_MAX_BYTES` or a quarter of the free disk).
        chunk_tokens: tokens per chunk, a multiple of the cache's ``block_tokens`` (128).
        predictor: ``"auto"`` (the default: calibrated storage, `predictors.registry.CALIBRATED_STORAGE`, where
            ``calibration`` or the model's saved calibration, found and never fitted here, has its heads; else
            ``"generic"``), ``"generic"`` (per-block statistics: 0.65x raw, adopted without decoding; turns
            calibrated storage off), ``"grid"``, ``"below"`` or ``"context"`` (the model's calibration, found or fitted on first
            use: ~0.52x raw, transcoded on lookup); docs/prefix_store.md "Calibrated chunks".
        config: the lossless configuration of the caches `cache_for` returns (default ``CompressionConfig()``).
        secret: bytes that key an HMAC-SHA256 over every chunk instead of the plain SHA-256, for a folder that
            others can write (docs/prefix_store.md "Trust"); stores with other secrets never share chunks.

    The store holds its folder open (a descriptor: every name in it is opened relative to the folder it
    checked) until `close` (or the end of a ``with PrefixStore(...) as store:`` block, or its collection).
    A folder this process cannot create or mark raises an ``OSError`` (``PermissionError``...) naming it; one it
    can read but not write serves lookups, and `put` then stores nothing (a warning), as on a full disk.
    """

    def __init__(self, model: torch.nn.Module, *, path: str | os.PathLike | None = None,
                 max_bytes: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, predictor: str = AUTO,
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
        chunks = Chunks(model, config, chunk_tokens, predictor, secret, calibration)  # refuses what it cannot hold
        self.model = model
        self.config = config
        self.chunk_tokens = chunk_tokens
        self._secret = secret
        self._root_fd: int | None = None
        _check_bindable(model)
        self.root, self._root_fd = claim(path)
        if max_bytes is None:
            max_bytes = max(1, min(DEFAULT_MAX_BYTES, shutil.disk_usage(self._root_fd).free // 4))
        self.max_bytes = max_bytes
        self.chunks = chunks
        self._identity = model_identity(model)
        self._namespace: bytes | None = None
        self.hits = self.misses = self.hit_tokens = self.bytes_saved = 0

    # ------------------------------------------------------------------ public API

    def close(self) -> None:
        """Close the store's folder; the store cannot be used after (a second close does nothing)."""
        fd, self._root_fd = self._root_fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _close=os.close) -> None:  # os itself may be gone at interpreter exit
        fd = getattr(self, "_root_fd", None)  # a constructor that failed early set none
        if fd is not None:
            _close(fd)

    @property
    def calibration(self) -> Calibration | None:
        """The calibration chunks are coded with (a calibrated predictor: found or fitted on first use)."""
        return self.chunks.calibration

    @property
    def predictor(self) -> str:
        """The predictor chunks are coded with (``"auto"`` resolved on first use: `Chunks.predictor`)."""
        return self.chunks.predictor

    @property
    def folder(self) -> Path:
        """This model's (and settings') chunks (a path for people and listings: the store itself opens the name
        under its root's descriptor, `_folder`)."""
        return self.root / self._folder_name

    @property
    def _folder_name(self) -> str:
        return self.namespace.hex()[:32]

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
                "codec": {name: getattr(self.chunks.settings, name) for name in self.config.lossless.CODEC_FIELDS},
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
        with self._folder(create=False) as fd:
            cache, base, count, served = self._hit(fd, keys, row)
            self.misses += usable - count
            if not count:
                return cache
            touch_chain(fd, [_name(key) for key in keys[base:count]])
        self.hits += count - base
        self.hit_tokens += count * self.chunk_tokens
        self.bytes_saved += served
        tokens = count * self.chunk_tokens
        cache.token_ids = torch.from_numpy(row[:tokens].copy()).unsqueeze(0)
        return cache

    def put(self, ids: torch.Tensor | list[int], cache: Cache) -> int:
        """Store the whole chunks of ``ids`` (one row: the prompt, or ``generate``'s output) that ``cache`` holds
        and the store does not; returns how many tokens were written. ``cache`` must hold the KV of ``ids``' first
        tokens (and may hold more): a `CompressedCache` that recorded other ids, or a cache whose layer-0 keys or
        values are not what the model computes for ``ids``, is refused with a ``ValueError`` before anything is
        written. A folder that cannot be written (permissions, a full disk) stores nothing: a warning, no error."""
        row = _one_row(ids)
        if not isinstance(cache, Cache):
            raise TypeError(f"PrefixStore.put: cache must be a transformers Cache holding the K/V of ids (a "
                            f"DynamicCache, a CompressedCache), got {type(cache).__name__}")
        held = cache.get_seq_length()
        recorded = getattr(cache, "token_ids", None)
        common = min(held, len(row))
        if isinstance(recorded, torch.Tensor) and (recorded.shape[0] != 1 or recorded.shape[1] < held
                                                   or not np.array_equal(recorded[0, :common].numpy(), row[:common])):
            raise ValueError("PrefixStore.put: the cache holds the KV of other tokens than ids")
        self._check_kv(cache)
        keys = self.keys(row[:common])
        names = [_name(key) for key in keys]
        with self._folder(create=False) as fd:
            todo = [i for i, name in enumerate(names) if fd is None or not is_regular(fd, name)]
            if not todo:  # all held: marked used
                touch_chain(fd, names)
                return 0
        stop = (todo[-1] + 1) * self.chunk_tokens
        window = self.chunks.windows[0]
        whole = {0: layer_kv(cache.layers[0], stop, window)}
        keys0, values0, held = whole[0]
        # a full first layer binds the tokens stored; a window the tokens it still holds of ids (the chunks' window
        # blocks are among them, and they tie the cache's other layers to ids as a full layer's do)
        bound = stop if window is None else common
        if bound <= held:
            raise ValueError(f"PrefixStore.put: the cache's first layer (a window of {window}) holds none of ids' "
                             "tokens, so the cache cannot be checked to hold their K/V; nothing stored")
        problem = binding_problem(self.model, torch.from_numpy(row[:bound].copy()).unsqueeze(0), 0,
                                  keys0[:, :, : bound - held], values0[:, :, : bound - held], held)
        if problem is not None:
            raise ValueError(f"PrefixStore.put: {problem[1]}; nothing stored")
        written = 0
        with self._folder(create=True) as fd:
            if fd is None:
                return 0
            for index in todo:
                blob = self.chunks.encode(cache, index, keys[index], self.namespace, row, whole)
                try:
                    write_atomic(fd, names[index], blob)
                except OSError as err:  # a full disk, permissions or a concurrent clear(): the store is a cache
                    log.warning("prefix store: could not write %s in %s (%s); stopped storing this prompt",
                                names[index], self.folder, err)
                    names = names[:index]
                    break
                written += self.chunk_tokens
            touch_chain(fd, names)
        if written:
            self.evict()
        return written

    def _check_kv(self, cache: Cache) -> None:
        """The cache's K/V must be this model's: its dtype, KV heads and head size (a cache of another model or
        dtype would be stored under this model's keys)."""
        dtype, shapes = self.chunks.layer_shapes
        for i, (layer, (heads, dim)) in enumerate(zip(cache.layers, shapes)):
            if not getattr(layer, "is_initialized", False):
                continue
            # a compressed layer's residual has the dtype and shape of its K/V (its .keys would decode every block)
            keys = layer.residual_keys if isinstance(layer, CompressedLayer) else layer.keys
            if keys is None:
                continue
            if keys.dtype != dtype or keys.shape[1] != heads or keys.shape[3] != dim:
                raise ValueError(f"PrefixStore.put: layer {i} holds {keys.dtype} K/V of {keys.shape[1]} heads x "
                                 f"{keys.shape[3]}, this store's model {dtype} of {heads} x {dim}")
            if not self.chunks.windowed:
                return  # one layer tells: the rest come from the same forward

    def stats(self) -> dict[str, int]:
        """Chunks and bytes on disk for this model and settings, raw bytes they hold, and this process's hits,
        misses (chunks), tokens hit and raw KV bytes served from the store."""
        with self._folder(create=False) as fd:
            files = [] if fd is None else [(name, info) for name, info, chunk in own_files(fd) if chunk]
        per_chunk = self.chunks.raw_bytes()
        return StoreStats(len(files), sum(info.st_size for _, info in files), len(files) * per_chunk, self.hits,
                          self.misses, self.hit_tokens, self.bytes_saved).as_dict()

    def evict(self) -> int:
        """Remove least recently used chunks (of every model in the folder) until at most ``max_bytes`` remain,
        counting the temporary files of writers still at work, and reclaim those of writers gone; returns the
        bytes removed."""
        entries = []
        removed = writing = 0
        with contextlib.ExitStack() as open_folders:
            for name, fd in each_folder(self._root()):
                fd = open_folders.enter_context(opened(os.dup(fd)))  # kept open until the chunks are removed
                for file, info, chunk in own_files(fd):
                    if chunk:
                        entries.append((info.st_mtime, info.st_size, name, file, fd))
                    elif writer_gone(fd, file, info):
                        removed += unlink(fd, file, info.st_size)
                    else:
                        writing += info.st_size
            total = writing + sum(entry[1] for entry in entries)
            for _, size, _, file, fd in sorted(entries, key=lambda e: e[:4]):
                if total <= self.max_bytes:
                    break
                removed += unlink(fd, file, size)
                total -= size
        return removed

    def clear(self) -> int:
        """Remove every chunk and temporary file of the store's folder; returns the bytes removed."""
        return clear_at(self._root())

    # ------------------------------------------------------------------ chunks

    def _root(self) -> int:
        if self._root_fd is None:
            raise ValueError("PrefixStore: the store is closed")
        return self._root_fd

    @contextmanager
    def _folder(self, *, create: bool) -> Iterator[int | None]:
        """A descriptor of this model's folder under the root's (`store_folder.open_folder`: never through a
        link), closed on leaving; None where there is none (``create``: made if missing) or it cannot be opened
        (a warning: the store is a cache, lookups miss and puts store nothing)."""
        try:
            fd = open_folder(self._root(), self._folder_name, create=create)
        except OSError as err:
            log.warning("prefix store: cannot %s %s (%s); %s", "create or open" if create else "open", self.folder,
                        err, "nothing stored" if create else "a miss")
            fd = None
        with opened(fd):
            yield fd

    def _read_chunk(self, fd: int, key: bytes, index: int, row: np.ndarray) -> dict[str, Any] | None:
        """The checked chunk of ``key`` in the folder ``fd`` (header, payload), or None: missing, or anything else
        than a chunk of this store (then removed: a damaged file, a FIFO, a link, a file larger than a chunk can
        be)."""
        name = _name(key)
        try:
            data = read_regular(name, magic=MAGIC, follow_links=False, max_bytes=self.chunks.max_bytes(), dir_fd=fd)
        except CacheFileError as err:
            if not isinstance(err.__cause__, FileNotFoundError):
                self._drop(fd, name, err)
            return None
        try:
            return self.chunks.check(data, key, self.namespace, index, row)
        except Exception as err:  # any parse failure (a 4,300-digit integer is a ValueError of its own)
            self._drop(fd, name, err)
            return None

    def _drop(self, fd: int, name: str, why: object) -> None:
        log.warning("prefix store: %s is damaged (%s); removed, computing its tokens again", name, why)
        unlink(fd, name, 0)  # never follows a link: a link planted at a chunk's name is removed, not its target

    def _hit(self, fd: int | None, keys: list[bytes], row: np.ndarray) -> tuple[CompressedCache, int, int, int]:
        """A cache holding the longest prefix of ``row`` that stored chunks restore, with the first chunk it read,
        how many chunks long the prefix is (0: an empty cache, a miss) and the raw bytes the chunks read hold. The
        prefix ends where every layer's tokens are held: full layers read every chunk before (stopping at the first
        missing one), window layers read the chunks their windows reach (`Chunks.first_needed`), which must hold
        what the window needs there (`Chunks.restorable`). Each chunk that fails a check, does not decode or does
        not bind to ``row``'s tokens is removed with a warning, and a shorter prefix tried."""
        found: dict[int, dict[str, Any] | None] = {}

        def chunk(index: int) -> dict[str, Any] | None:
            if index not in found:
                found[index] = None if fd is None else self._read_chunk(fd, keys[index], index, row)
            return found[index]

        last = len(keys) - 1
        if self.chunks.first_needed(last) == 0:  # a layer holds every token: chunks are read in chain order
            last = next((index for index in range(len(keys)) if chunk(index) is None), len(keys)) - 1
        while last >= 0:
            base = self.chunks.first_needed(last)
            run = [chunk(index) for index in range(base, last + 1)]
            if any(c is None for c in run) or not self.chunks.restorable(run, base):
                last -= 1
                continue
            cache = CompressedCache(self.config, model=self.model, calibration=None)
            try:
                bad = self.chunks.first_bad(cache, row, len(run), self.chunks.fill(cache, run, base), base)
            except BadChunk as err:
                bad = (err.index, err.why)
            except Exception as err:  # not attributable to one chunk: a miss, nothing removed
                log.warning("prefix store: a hit of %d chunks could not be adopted (%s: %s); computing its tokens "
                            "again", len(run), type(err).__name__, err)
                break
            if bad is None:
                return cache, base, last + 1, sum(c["raw_bytes"] for c in run)
            index, why = bad
            assert fd is not None  # chunks were read through it
            self._drop(fd, f"{run[index]['key']}{SUFFIX}", why)
            found[base + index] = None
            last = base + index - 1 if base == 0 else last - 1
        return CompressedCache(self.config, model=self.model, calibration=None), 0, 0, 0


def _check_bindable(model: torch.nn.Module) -> None:
    problem = bindable(model)
    if problem is not None:
        raise ValueError(f"PrefixStore: {problem}; the store holds only K/V it can check against the model")


# ---------------------------------------------------------------------- helpers


def _name(key: bytes) -> str:
    """The file name of the chunk of ``key`` in its namespace folder."""
    return f"{key.hex()}{SUFFIX}"


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

