"""One-file save / load of a lossless cache: the prefix-cache use (store a prompt's KV once, reload later).

File layout: ``MAGIC`` (8 bytes), the format version (u32, little endian), the header length (u32), a UTF-8
JSON header, the payload (every stream and tensor, at the offsets the header lists, in order, without gaps),
then a SHA-256 of everything before it. The header carries the token ids, the config, the predictor, the model
identity and calibration checksum, the library version and what the predictor needs to reproduce (threads,
CPU). Nothing is unpickled.

Version 3 holds caches whose layers all keep every token in one K/V shape (full attention). Version 4 holds
every other layer structure: one entry per layer that holds anything, with its own K/V widths, its sliding window
and the first position it holds (a window keeps the last ``sliding_window - 1`` tokens), and the recurrent /
convolution states of hybrid models as raw tensors (`_STATE_FIELDS`). `save` writes version 3 whenever the
cache fits it (its files stay byte for byte what they were) and version 4 otherwise; `load` reads both.

`load_cache` trusts nothing it has not checked: the SHA-256 over the whole file first, then every header
field against the others and against the payload (block order and sizes, stream and side-data extents,
each stream's declared dtype and shape, the listed elements of portable predictors) before anything is
allocated or decoded. Files of earlier versions are refused with a request to re-save them (version 2 held
float32 predictor statistics, which decode only on CPUs that round like the writer's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import stat
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..blockcodec import BlockCodec, CodedBlock, CodedRow
from ..blockcoder import SCALE_MAX, SCALE_MIN, expected_side, listed_problem
from ..calibration import Calibration, CalibrationError, calibration_dir, find_calibration
from ..codec import DEFAULT_CODER, CorruptStreamError, coder_of_stream, stream_info
from ..codec.codec_config import MAX_WINDOW
from ..config import CompressionConfig
from ..errors import CacheFileError, PredictorMismatchError
from ..identity import ModelIdentity, model_identity
from ..layer import CompressedLayer
from ..layer.hybrid import state_tensors
from ..layer.storage import Block
from ..predictors import make_predictor
from ..predictors.base import Predictor
from ..predictors.registry import reads_calibration
from ..predictors.rerun import decoder_layers
from ..version import __version__
from .binding import binding_problem


class CompressedCache(Protocol):
    """What save and load use of a `cache.CompressedCache` (a protocol, so that this module, which the cache's
    ``save`` / ``load`` call, does not import the cache)."""

    config: CompressionConfig
    calibration: Calibration | None
    model: torch.nn.Module | None
    model_config: Any
    layers: list[Any]
    lossless: BlockCodec | None
    token_ids: torch.Tensor | None
    saw_padding: bool

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def kv_layers(self) -> list[CompressedLayer]: ...

    def build_layers(self, kinds: list[tuple[str, dict] | None]) -> None: ...

MAGIC = b"\x89HFKVC\r\n"
LEGACY_MAGIC = b"HFKVCACH"  # format version 1: SHA-256 over the payload only
FORMAT = "hf_kvcompress.cache"
VERSION = 3  # caches of full-attention layers of one shape; `LAYERED` for every other structure
LAYERED = 4
VERSIONS = (VERSION, LAYERED)
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_DIGEST = 32  # trailing SHA-256
MAX_HEADER = 1 << 30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32,
          "float64": torch.float64, "int64": torch.int64}
_MIN_STREAM_ENTRY = 8  # bytes per window-table entry: a stream of n bytes holds at most n / 8 windows



def reproducibility() -> dict[str, Any]:
    """What a model-running predictor's bits depend on besides the inputs."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def save_cache(cache: CompressedCache, path: str | Path, predictor: str | None = None, probe_layer: int | None = None,
               progress: bool = False) -> Path:
    """Write ``cache`` to ``path`` as one file, every token coded with ``predictor`` (default: the config's
    ``save_predictor``)."""
    target = Path(path)
    if target.is_dir():  # before any coding: open() would raise a bare IsADirectoryError after it
        raise IsADirectoryError(f"save: {str(target)!r} is a folder; pass a file path, e.g. {str(target / 'cache.kvc')!r}")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"save: the folder {target.parent} does not exist")
    layers = cache.kv_layers()
    states = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
              and bool(state_tensors(layer))]
    if max((layer.seen_tokens for layer in layers), default=0) == 0 and not states:
        raise ValueError("save: the cache is empty")
    if any(not block.exact for layer in layers for block in layer.blocks):
        raise ValueError("save: only caches that hold their tokens exactly (no lossy summary)")
    settings = cache.config.lossless
    name = predictor or settings.save_predictor
    k = probe_layer or settings.probe_layer
    # portable: the file is read on other machines
    chosen = make_predictor(name, calibration=cache.calibration, model=cache.model, probe_layer=k, portable=True)
    layered = not _fits_version_3(cache)
    if layered and chosen.below_depth() > 0:
        raise ValueError(
            f"save: the '{name}' predictor reads the layers below each block, but this cache's layers do not all hold "
            "the same tokens (sliding windows, KV-sharing or state layers); save with predictor='generic'"
        )
    token_ids = cache.token_ids
    tokens = max((layer.seen_tokens for layer in layers), default=0)
    if tokens == 0:  # recurrent states only (a mamba model): the recorded ids say how many tokens they hold
        if token_ids is None:
            raise ValueError("save: a cache of recurrent states only needs the model attached (model=...) from "
                             "its first forward, so that it knows how many tokens its states hold")
        tokens = token_ids.shape[1]
    needs_tokens = not chosen.practical_in_generation
    if needs_tokens:
        _check_tokens_for_rerun(cache, token_ids, tokens)

    block_tokens = cache.config.block_tokens
    blocks: dict[tuple[int, int], Block] = {}  # the file's blocks as they are made, for the layer-below lookups
    coding = BlockCodec.over(settings, chosen, cache.calibration, lambda layer, start: blocks.get((layer, start)))
    if cache.lossless is None or not coding.codes_like(cache.lossless):
        # the file codes every token again: for size (the codec's default coder), not for decode speed (a generation
        # coder such as ``huff``); a save that codes as generation keeps generation's blocks and their coder
        coding = BlockCodec.over(dataclasses.replace(settings, coder=DEFAULT_CODER), chosen, cache.calibration,
                                 lambda layer, start: blocks.get((layer, start)))
    if needs_tokens:
        coding.extras_source = chosen.model_extras(token_ids)
    payload = bytearray()

    def coded_blocks(index: int, keys: torch.Tensor, values: torch.Tensor, first: int) -> list[dict[str, Any]]:
        entries = []
        for at in range(0, keys.shape[2], block_tokens):
            stop = min(at + block_tokens, keys.shape[2])
            block = coding.encode_block(index, keys[:, :, at:stop], values[:, :, at:stop], first + at)
            blocks[(index, first + at)] = block
            entries.append({"start": first + at, "tokens": stop - at,
                            "rows": [_write_row(row, payload) for row in block.rows]})
        return entries

    layer_entries = []
    held = [(index, layer) for index, layer in enumerate(cache.layers)
            if isinstance(layer, (CompressedLayer, LinearAttentionCacheLayerMixin))]
    bar = tqdm(total=len(held), desc=f"saving ({name})", disable=not progress, leave=False)
    keys0 = None
    for index, layer in held:
        kv = None
        taken = _generation_blocks(cache, layer, index, chosen, coding) if isinstance(layer, CompressedLayer) \
            else None
        if taken is not None:  # the cache's own blocks are the file's: their streams, not decoded and coded again
            keys, values = layer.residual_keys, layer.residual_values
            keys0 = keys if keys0 is None else keys0
            entries = [{"start": b.start, "tokens": b.tokens, "rows": [_write_row(row, payload) for row in b.rows]}
                       for b in taken]
            kv = {"heads": keys.shape[1], "key_dim": keys.shape[3], "value_dim": values.shape[3],
                  "sliding_window": None, "start": 0,
                  "blocks": entries + coded_blocks(index, keys, values, len(taken) * block_tokens)}
        elif isinstance(layer, CompressedLayer) and layer.is_initialized:
            keys, values = layer.keys, layer.values
            keys0 = keys if keys0 is None else keys0
            first = layer.seen_tokens - keys.shape[2]
            kv = {"heads": keys.shape[1], "key_dim": keys.shape[3], "value_dim": values.shape[3],
                  "sliding_window": layer.sliding_window, "start": first,
                  "blocks": coded_blocks(index, keys, values, first)}
        if layered:
            state = _write_state(layer, payload) if isinstance(layer, LinearAttentionCacheLayerMixin) else None
            layer_entries.append({"layer": index, "kv": kv, "state": state})
        else:
            layer_entries.append({"layer": index, "blocks": kv["blocks"]})
        bar.update(1)
    bar.close()

    first = keys0 if keys0 is not None else state_tensors(states[0])[0]  # rows and dtype of what is held
    if token_ids is not None and tuple(token_ids.shape) != (first.shape[0], tokens):
        token_ids = None  # ids of other rows or tokens than the cache holds (recorded partly): not the cache's
    header = {
        "format": FORMAT,
        "version": LAYERED if layered else VERSION,
        "library_version": __version__,
        "config": cache.config.to_dict(),
        "predictor": {"name": name, "probe_layer": k},
        "model": model_identity(cache.model).to_dict() if cache.model is not None else None,
        # only a file coded with the calibration names it (a 'generic' file loads without one)
        "calibration_sha256": cache.calibration.meta["tensors_sha256"]
        if cache.calibration is not None and chosen.calibrated else None,
        "dtype": str(first.dtype).replace("torch.", ""),
        "kv_layers": len(cache.layers) if layered else len(layer_entries),
        "rows": first.shape[0],
        "kv_heads": None if layered else keys0.shape[1],
        "head_dim": None if layered else keys0.shape[3],
        "tokens": tokens,
        "token_ids": token_ids.tolist() if token_ids is not None else None,
        "reproducibility": reproducibility(),
        "layers": layer_entries,
        "payload_bytes": len(payload),
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    head = _PREFIX.pack(MAGIC, header["version"], len(blob))
    digest = hashlib.sha256(head)
    digest.update(blob)
    digest.update(payload)
    with open(target, "wb") as out:
        out.write(head)
        out.write(blob)
        out.write(payload)
        out.write(digest.digest())
    if cache.calibration is not None and not uses_calibration(cache):
        cache.calibration.release()  # heads read for this save only: generation does not hold them
    return target


def _generation_blocks(cache: CompressedCache, layer: CompressedLayer, index: int, chosen: Predictor,
                       coding: BlockCodec) -> list[CodedBlock] | None:
    """``layer``'s sealed blocks when they are what the file would code (the save's predictor is generation's and
    codes alike on every CPU, the same codec settings and marginals; whole blocks from position 0 of a
    full-attention layer), else None: the save then codes every token itself."""
    mine = cache.lossless
    if mine is None or not coding.codes_like(mine) or not layer.is_initialized:
        return None
    if type(layer) is not CompressedLayer or layer.sliding_window is not None or not layer.blocks:
        return None
    block_tokens = cache.config.block_tokens
    if layer.block_starts != [i * block_tokens for i in range(len(layer.blocks))] or any(
            not isinstance(b, CodedBlock) or b.tokens != block_tokens or len(b.rows) != layer.rows
            for b in layer.blocks):
        return None
    return list(layer.blocks)


def _fits_version_3(cache: CompressedCache) -> bool:
    """Whether version 3 holds ``cache``: only full-attention layers, all holding every token in one K/V shape."""
    shapes = set()
    for layer in cache.layers:
        if type(layer) is not CompressedLayer or layer.sliding_window is not None or not layer.is_initialized:
            return False
        shapes.add((tuple(layer.residual_keys.shape[1:2]), layer.residual_keys.shape[3],
                    layer.residual_values.shape[3], layer.seen_tokens))
    return len(shapes) == 1 and len({(s[1], s[2]) for s in shapes if s[1] == s[2]}) == 1


def uses_calibration(cache: CompressedCache) -> bool:
    """Whether ``cache``'s in-generation predictor codes with its calibration (else only saves read it)."""
    return cache.lossless is not None and cache.lossless.predictor.calibrated


def load_cache(path: str | Path, *, cache_class: type[CompressedCache], model: torch.nn.Module | None = None,
               calibration=None, config: CompressionConfig | None = None, progress: bool = False,
               verify: bool | None = None) -> CompressedCache:
    """Rebuild a saved cache: bit-identical keys and values, held per ``config`` (default: the saved one).
    Every failure is a `CacheFileError` that says what is wrong. Blocks coded as the cache codes them in
    generation are adopted, not decoded: the file's SHA-256 and structure are checked here, each stream's own
    checks at its first decode unless ``verify`` (default: when ``model`` is given) decodes them here once, so that
    a file edited behind its checksum fails in `load`, not at the first read, where it raises `CorruptStreamError`)."""
    if verify is None:  # a model attached means generation follows: nothing read from the file may fail inside it
        verify = model is not None
    try:
        return _load(Path(path), cache_class, model, calibration, config, progress, verify)
    except CacheFileError as err:
        raise CacheFileError(f"{path}: {err}") from err.__cause__


def read_header(path: str | Path) -> dict[str, Any]:
    """The checked JSON header of a saved cache (stream offsets and sizes, predictor, fingerprints)."""
    try:
        return _read(Path(path)).header
    except CacheFileError as err:
        raise CacheFileError(f"{path}: {err}") from err.__cause__


def stream_bytes(header: dict[str, Any]) -> list[dict[str, int]]:
    """Bytes per layer of key streams, value streams and side data (scales, side tensors) in a header."""
    per_layer = []
    for entry in header["layers"]:
        kv = entry["kv"] if header["version"] == LAYERED else {"heads": header["kv_heads"], "blocks": entry["blocks"]}
        if kv is None:
            continue
        heads = kv["heads"]
        k = v = side = 0
        for block in kv["blocks"]:
            for row in block["rows"]:
                lengths = [length for _, length in row["streams"]]
                k += sum(lengths[:heads])
                v += sum(lengths[heads:])
                side += len(row["scales"]) + sum(info["bytes"] for info in row["side"].values())
        per_layer.append({"layer": entry["layer"], "k": k, "v": v, "side": side})
    return per_layer


# ---------------------------------------------------------------------- loading


def _default_calibration(header: dict[str, Any], model):
    """The calibration a file names when the caller gave none: the model's default one, or None for a file
    saved without one (looked up, never fitted: a new fit would not be the one the file was coded with)."""
    want = header["calibration_sha256"]
    if want is None:
        return None
    if model is None:
        raise CacheFileError(f"saved with calibration {want}: pass calibration= (or model= to use its default one)")
    try:
        found = find_calibration(model)
    except CalibrationError as err:
        raise CacheFileError(f"saved with calibration {want}; the model's default one is unusable: {err}") from err
    if found is None or found.digest != want:
        raise CacheFileError(
            f"saved with calibration {want}, but the model's default calibration in {calibration_dir(model)} is "
            f"{'missing' if found is None else found.digest}; pass the calibration it was saved with"
        )
    return found


@dataclass
class _Saved:
    """A file whose checksum and header structure have been verified (see `_check_header`)."""

    header: dict[str, Any]
    payload: bytes
    config: CompressionConfig
    dtype: torch.dtype
    model: ModelIdentity | None


def _load(path: Path, cache_class, model, calibration, config, progress, verify: bool = False) -> CompressedCache:
    saved = _read(path)
    header = saved.header
    if header["library_version"] != __version__:
        raise CacheFileError(f"saved by hf_kvcompress {header['library_version']}, this is {__version__}; re-save it")
    _check_model(saved, model)
    if calibration is None:
        calibration = _default_calibration(header, model)
    elif header["calibration_sha256"] is None and not reads_calibration((config or saved.config).lossless.predictor):
        calibration = None  # a file coded without one, for a cache whose generation reads none: not needed
    try:
        target = cache_class(config or saved.config, model=model, calibration=calibration)
    except (ValueError, TypeError) as err:  # CalibrationError included: a calibration for another model
        raise CacheFileError(f"cannot build the cache to load into: {err}") from err
    _check_layers(header, target)
    want_cal = header["calibration_sha256"]
    have_cal = target.calibration.meta["tensors_sha256"] if target.calibration is not None else None
    if want_cal is not None and want_cal != have_cal:  # a file coded without one loads into any cache
        raise CacheFileError(
            f"saved with calibration {want_cal or 'none'}, loading with {have_cal or 'none'}; "
            "pass the calibration it was saved with"
        )
    name, k = header["predictor"]["name"], header["predictor"]["probe_layer"]
    try:
        # the file's predictor as it coded: with the calibration the file names, or without one
        predictor = make_predictor(name, calibration=target.calibration if want_cal is not None else None,
                                   model=model, probe_layer=k, portable=True)  # portable: as it was written
    except (ValueError, TypeError) as err:
        raise CacheFileError(f"cannot rebuild the {name!r} predictor it was saved with: {err}") from err
    blocks: dict[tuple[int, int], Block] = {}  # the file's blocks as they are checked, for the layer-below lookups
    coding = BlockCodec.over(_file_settings(header, saved), predictor, target.calibration,
                             lambda layer, start: blocks.get((layer, start)))
    token_ids = torch.tensor(header["token_ids"], dtype=torch.long) if header["token_ids"] is not None else None
    if not predictor.practical_in_generation:
        if token_ids is None:
            raise CacheFileError(f"the {name} predictor needs token ids, which this file lacks")
        coding.extras_source = predictor.model_extras(token_ids)

    rows = header["rows"]
    entries = _layer_entries(header)
    if header["version"] == LAYERED:
        _layered_target(target, entries, header["kv_layers"])
    sides: dict[tuple, dict] = {}  # the side data each block shape needs, asked of the predictor once per shape
    for entry in entries:  # every block checked before any is decoded (or allocated for)
        layer, kv = entry["layer"], entry["kv"]
        for b in (kv or {}).get("blocks", ()):
            coded = [_read_row(row, saved.payload) for row in b["rows"]]
            block = CodedBlock(layer, b["start"], b["tokens"], coded, kv["heads"], kv["key_dim"],
                               saved.dtype, torch.device("cpu"), value_dim=kv["value_dim"])
            _check_block(block, coding, predictor, sides)
            blocks[(layer, b["start"])] = block
    adopting = _adopts(header, saved.config, target, predictor, coding)
    try:
        for entry in tqdm(entries, desc=f"loading ({name})", disable=not progress, leave=False):
            layer, kv = entry["layer"], entry["kv"]
            device = _layer_device(model, layer)
            if kv is None:
                _restore_state(target.layers[layer], entry["state"], saved.payload, device, header["tokens"])
                continue
            held = target.layers[layer] if layer < len(target.layers) else None
            count = _adoptable_blocks(kv, header["tokens"], target, held) if adopting else 0
            adopted = [_adopted(blocks[(layer, b["start"])], device) for b in kv["blocks"][:count]]
            keys, values = [], []
            for b in kv["blocks"][count:]:  # the newest tokens, which generation holds as plain tensors
                decoded = coding.decoded(blocks[(layer, b["start"])])
                keys.append(decoded.keys)
                values.append(decoded.values)
            if adopted:
                if held is None:
                    target.layers.append(target._new_layer(layer))
                    held = target.layers[layer]
                if keys:
                    held.adopt(adopted, torch.cat(keys, dim=2).to(device), torch.cat(values, dim=2).to(device))
                else:
                    held.adopt(adopted)
                if entry["state"] is not None:
                    _restore_state(held, entry["state"], saved.payload, device, header["tokens"])
                continue
            keys, values = torch.cat(keys, dim=2).to(device), torch.cat(values, dim=2).to(device)
            if header["version"] == LAYERED:
                target.layers[layer].restore(keys, values, header["tokens"])
                if entry["state"] is not None:  # after the K/V: restoring them resets the layer
                    _restore_state(target.layers[layer], entry["state"], saved.payload, device, header["tokens"])
            else:
                target.update(keys, values, layer)
        if verify and adopting:  # adopted blocks decode once here, so that a stream that does not decode fails now
            for held in target.kv_layers():
                if held.blocks and target.lossless is not None:
                    target.lossless.read_all(held.blocks)
        if model is not None:
            _check_binding(target, model, token_ids)
    except PredictorMismatchError as err:
        here = reproducibility()
        why = (f"saved with {header['reproducibility']}, loading with {here}" if header["reproducibility"] != here
               else f"the file's environment record equals this one ({here})")
        raise CacheFileError(
            f"the '{name}' predictor does not reproduce here ({why}), or the file was edited and its checksum "
            f"recomputed; 'generic', 'none' and 'context' files decode on every CPU, predictors that rerun the "
            f"model depend on its kernels: {err}"
        ) from err
    except CorruptStreamError as err:
        raise CacheFileError(f"a stream does not decode: {err}") from err
    except ValueError as err:  # e.g. a calibration that lacks a layer the file holds
        raise CacheFileError(f"cannot decode: {err}") from err
    if next((layer.rows for layer in target.kv_layers() if layer.is_initialized), rows) != rows:
        raise CacheFileError(f"decoded {target.kv_layers()[0].rows} batch rows, the header says {rows}")
    target.token_ids = token_ids
    return target


def _check_binding(target: CompressedCache, model: torch.nn.Module, token_ids: torch.Tensor | None) -> None:
    """The file's first K/V layer must hold the keys ``model`` computes for the file's token ids (`binding`): a
    file whose ids were edited, or that holds another model's K/V of the same shapes, is refused. Files of one
    row that record their ids (`save` records them when the model was attached from the first forward); a batch
    is not bound (left padding moves its positions), nor a lossy target (its layers hold summaries)."""
    if token_ids is None or token_ids.shape[0] != 1:
        return
    index, layer = next(((i, held) for i, held in enumerate(target.layers)
                         if isinstance(held, CompressedLayer) and held.is_initialized), (0, None))
    if layer is None or any(not block.exact for block in layer.blocks):
        return
    keys = layer.keys  # a sealed block decodes here: a stream edited behind the checksum fails in load
    try:
        problem = binding_problem(model, token_ids, index, keys, start=layer.seen_tokens - keys.shape[2])
    except (RuntimeError, IndexError, TypeError) as err:  # the model's forward on the file's ids
        raise CacheFileError(f"cannot recompute layer {index}'s keys for the file's token ids: {err}") from err
    if problem is not None:
        raise CacheFileError(f"{problem[1]}; the file was edited or saved from another model")


def _file_settings(header: dict[str, Any], saved) -> Any:
    """The saved `LosslessConfig` with the coder the file's streams were written by (their magic bytes): a save
    that codes the tokens again uses the codec's default coder whatever the cache generated with."""
    settings = saved.config.lossless
    for entry in _layer_entries(header):
        for b in (entry["kv"] or {}).get("blocks", ()):
            for row in b["rows"]:
                blobs = _read_row(row, saved.payload).blobs
                if blobs:
                    try:
                        return dataclasses.replace(settings, coder=coder_of_stream(blobs[0]).name)
                    except CorruptStreamError:
                        return settings  # the block's own check names the problem
    return settings


def _adopts(header: dict[str, Any], saved: CompressionConfig, target: CompressedCache, predictor: Predictor,
            coding: BlockCodec) -> bool:
    """Whether the file's blocks are coded exactly as ``target`` codes blocks in generation (`BlockCodec.codes_like`),
    in blocks of the same length, so that `load` takes them as they are."""
    mine = target.lossless
    return mine is not None and saved.block_tokens == target.config.block_tokens and coding.codes_like(mine)


def _adoptable_blocks(kv: dict[str, Any], tokens: int, target: CompressedCache, layer: object) -> int:
    """How many of a layer's saved blocks ``target`` takes as they are: those generation would have sealed (whole
    blocks from position 0, leaving ``residual_tokens``), into a full-attention layer that seals (0: none)."""
    if kv["start"] != 0 or kv["sliding_window"] is not None:
        return 0
    if layer is not None and (type(layer) is not CompressedLayer or layer.sliding_window is not None
                              or not layer.seals):
        return 0
    block_tokens = target.config.block_tokens
    sealed = max(0, tokens - target.config.residual_tokens) // block_tokens
    count = 0
    for b in kv["blocks"][:sealed]:
        if b["start"] != count * block_tokens or b["tokens"] != block_tokens:
            break
        count += 1
    return count


def _adopted(block: CodedBlock, device: torch.device) -> CodedBlock:
    """A checked block of a file, moved into the cache it loads into (its streams not decoded; its decoded tensors
    go to ``device``)."""
    block.device = device
    return block


def _check_model(saved: _Saved, model: torch.nn.Module | None) -> None:
    """Refuse another model (naming what differs) before anything is built or decoded."""
    if saved.model is None:
        return
    if model is None:
        raise CacheFileError("this cache was saved from a model; pass model=... to load it")
    problem = saved.model.mismatch(model_identity(model))
    if problem is not None:
        raise CacheFileError(f"saved from model {saved.model.fingerprint}, not the model given: {problem}")


def _check_layers(header: dict[str, Any], target: CompressedCache) -> None:
    """With a model attached, the file must hold one entry per KV layer of the model, in its K/V shape, and
    token ids from its vocabulary (a model-running predictor reruns it on them); with a calibration, no more
    layers than it has fitted."""
    fitted = target.calibration.meta["model"]["layers"] if target.calibration is not None else None
    if fitted is not None and header["kv_layers"] > fitted:
        raise CacheFileError(f"holds {header['kv_layers']} KV layers, the calibration covers {fitted}")
    if header["version"] == LAYERED:
        if target.model_config is not None and header["kv_layers"] != len(target.layers):
            raise CacheFileError(f"holds {header['kv_layers']} layers, the model has {len(target.layers)}")
        return  # each layer's kind and shape: `_layered_target`
    expected = len(target.kv_layers())
    if target.model_config is None or expected == 0:
        return
    if header["kv_layers"] != expected:
        raise CacheFileError(f"holds {header['kv_layers']} KV layers, the model has {expected}")
    text = target.model_config.get_text_config(decoder=True)
    # a file that records the model's identity matched it (config included) already, and its shapes are the
    # model's own, whatever the config's head fields say (multi-query falcon, an MLA latent's one head)
    if header["model"] is None:
        heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
        dim = getattr(text, "head_dim", None)
        if dim is None and heads is not None and getattr(text, "hidden_size", None):
            dim = text.hidden_size // text.num_attention_heads
        if heads is not None and header["kv_heads"] != heads:
            raise CacheFileError(f"holds {header['kv_heads']} KV heads per layer, the model has {heads}")
        if dim is not None and header["head_dim"] != dim:
            raise CacheFileError(f"holds head_dim {header['head_dim']}, the model has {dim}")
    vocab = getattr(text, "vocab_size", None)
    if vocab and header["token_ids"] is not None and max(max(row) for row in header["token_ids"]) >= vocab:
        raise CacheFileError(f"holds token ids beyond the model's vocabulary of {vocab}")


def _layer_entries(header: dict[str, Any]) -> list[dict[str, Any]]:
    """The header's layer entries in version 4's form (version 3: every layer full attention, one shape)."""
    if header["version"] == LAYERED:
        return header["layers"]
    shape = {"heads": header["kv_heads"], "key_dim": header["head_dim"], "value_dim": header["head_dim"],
             "sliding_window": None, "start": 0}
    return [{"layer": entry["layer"], "kv": {**shape, "blocks": entry["blocks"]}, "state": None}
            for entry in header["layers"]]


def _layered_target(target: CompressedCache, entries: list[dict[str, Any]], count: int) -> None:
    """Check (model attached) or make (no model: layers from the file) ``target``'s layers for a version 4 file:
    each entry's kind, window and shape where the cache has a layer of its own."""
    if not target.layers:  # built without a model: the file says what each layer is
        by_index = {entry["layer"]: entry for entry in entries}
        kinds: list[tuple[str, dict] | None] = []
        for index in range(count):
            entry = by_index.get(index)
            if entry is None:
                kinds.append(None)
                continue
            kv, state = entry["kv"], entry["state"]
            window = kv["sliding_window"] if kv is not None else None
            if kv is None:
                kind = "linear_attention"
            elif state is not None:
                kind = "hybrid_sliding" if window else "hybrid"
            else:
                kind = "sliding_attention" if window else "full_attention"
            kinds.append((kind, {"sliding_window": window, "number_of_states": len(state["previous"]) if state else 1}))
        target.build_layers(kinds)
    held = {entry["layer"] for entry in entries}
    for index, layer in enumerate(target.layers):
        holds = isinstance(layer, (CompressedLayer, LinearAttentionCacheLayerMixin))
        if holds and index not in held and not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise CacheFileError(f"holds nothing for layer {index}, where the model keeps K/V")
    for entry in entries:
        index, kv, state = entry["layer"], entry["kv"], entry["state"]
        layer = target.layers[index] if index < len(target.layers) else None
        if kv is not None and (not isinstance(layer, CompressedLayer) or layer.sliding_window != kv["sliding_window"]):
            have = getattr(layer, "sliding_window", None)
            raise CacheFileError(f"layer {index} holds K/V of window {kv['sliding_window']} (None: full attention), "
                                 f"the cache has a {type(layer).__name__} of window {have} there")
        if state is not None and (not isinstance(layer, LinearAttentionCacheLayerMixin)
                                  or layer.number_of_states != len(state["previous"])):
            raise CacheFileError(f"layer {index} holds {len(state['previous'])} recurrent states, the cache has a "
                                 f"{type(layer).__name__} there")


def _write_state(layer: LinearAttentionCacheLayerMixin, payload: bytearray) -> dict[str, Any]:
    """A linear-attention / hybrid layer's conv and recurrent states, raw, as transformers holds them."""
    count = layer.number_of_states

    def tensor(states: dict, i: int) -> dict[str, Any] | None:
        t = states.get(i)
        return None if t is None else _write_tensor(t.detach().cpu(), payload)

    conv = [tensor(layer.conv_states, i) if layer.is_conv_states_initialized[i] else None for i in range(count)]
    recurrent = [tensor(layer.recurrent_states, i) if layer.is_recurrent_states_initialized[i] else None
                 for i in range(count)]
    kernel = [layer.conv_kernel_size[i] if conv[i] is not None else None for i in range(count)]
    return {"conv": conv, "recurrent": recurrent, "conv_kernel": kernel,
            "previous": [bool(layer.has_previous_state[i]) for i in range(count)]}


def _restore_state(layer: LinearAttentionCacheLayerMixin, state: dict[str, Any], payload: bytes,
                   device: torch.device, tokens: int) -> None:
    """Put a checked state entry back into transformers' layer, as its own updates would have left it after
    ``tokens`` tokens (its token counter too, where transformers keeps one: ``cumulative_length_linear``, 5.25+)."""
    view = memoryview(payload)
    for i, previous in enumerate(state["previous"]):
        if state["conv"][i] is not None:
            conv = _read_tensor(state["conv"][i], view).to(device)
            layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=state["conv_kernel"][i])
            layer.conv_states[i] = conv  # the saved tensor itself: a recorded past may be longer than the kernel
        if state["recurrent"][i] is not None:
            recurrent = _read_tensor(state["recurrent"][i], view).to(device)
            layer.lazy_initialization(recurrent_states=recurrent, state_idx=i)
            layer.recurrent_states[i].copy_(recurrent)
        layer.has_previous_state[i] = previous
    counter = getattr(layer, "cumulative_length_linear", None)
    if isinstance(counter, torch.Tensor):
        counter.fill_(tokens)


def _check_block(block: CodedBlock, coding: BlockCodec, predictor: Predictor, sides: dict[tuple, dict]) -> None:
    """Each stream must declare the block's dtype and channel-major shape; side data must be what the
    predictor sends for such a block (names, per-row shapes, dtypes; ``sides`` memoises them per shape)."""
    where = f"layer {block.layer}, block at token {block.start}"
    config = coding.codec_for(block.layer)
    for r, row in enumerate(block.rows):
        for s, blob in enumerate(row.blobs):
            try:
                dtype, shape = stream_info(blob, config=config)
            except (CorruptStreamError, TypeError) as err:
                raise CacheFileError(f"{where}, row {r}, stream {s}: {err}") from err
            dim = block.dim if s < block.heads else block.value_dim  # key streams first (`stream_order`)
            if dtype != block.dtype or shape != (dim, block.tokens):
                raise CacheFileError(
                    f"{where}, row {r}, stream {s}: holds {dtype} {list(shape)}, the header says "
                    f"{block.dtype} {[dim, block.tokens]}"
                )
    shape = (block.layer, block.heads, block.tokens, block.dim, block.dtype, block.value_dim)
    if shape not in sides:
        sides[shape] = expected_side(predictor, *shape[:5], value_dim=block.value_dim)
    expected = sides[shape]
    for r, row in enumerate(block.rows):
        got = {name: (t.dtype, tuple(t.shape)) for name, t in row.side.items()}
        if got != expected:
            raise CacheFileError(f"{where}, row {r}: side data {got}, the '{predictor.name}' predictor needs {expected}")
        _check_listed(row.listed, f"{where}, row {r}", 2 * block.heads, block.tokens * max(block.dim, block.value_dim))


def _check_listed(listed: torch.Tensor | None, where: str, streams: int, elements: int) -> None:
    """A portable predictor's listed elements (`blockcoder.settle_stream`): int32 ``[n, 4]``, (stream, element) pairs
    strictly increasing and in range."""
    if listed is None:
        return
    if listed.dtype != torch.int32 or listed.dim() != 2 or listed.shape[1] != 4:
        raise CacheFileError(f"{where}: listed elements must be int32 [n, 4], got {listed.dtype} {list(listed.shape)}")
    if not listed.shape[0]:
        return
    stream, element = listed[:, 0].long().numpy(), listed[:, 1].long().numpy()
    if int(element.min()) < 0 or int(element.max()) >= elements:
        raise CacheFileError(f"{where}: listed elements out of range ({streams} streams of {elements} elements)")
    problem = listed_problem(stream * elements + element, streams * elements)
    if problem is not None:
        raise CacheFileError(f"{where}: listed elements {problem} ({streams} streams of {elements} elements)")


def open_regular(path: Path, *, follow_links: bool = True) -> tuple[int, int]:
    """An open descriptor of ``path`` and its size, if it is a regular file: a FIFO, device or folder there is
    refused without blocking or reading (``follow_links=False``: a symbolic link too). Raises `CacheFileError`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:  # ELOOP: a link where links are refused
        raise CacheFileError(f"cannot read the file ({type(err).__name__}: {err.strerror})") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CacheFileError("not a regular file (a FIFO, device or folder)")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_exactly(fd: int, count: int) -> bytes:
    """Up to ``count`` bytes of ``fd`` from where it stands (fewer only if the file ends sooner)."""
    parts, left = [], count
    while left > 0:
        try:
            part = os.read(fd, min(left, 1 << 24))
        except OSError as err:
            raise CacheFileError(f"cannot read the file: {err}") from err
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _read(path: Path) -> _Saved:
    """Read the file (a regular file; its first bytes must be a cache file's before the rest is read); verify
    magic, version and the SHA-256 over everything; parse and check the header."""
    fd, size = open_regular(path)
    try:
        data = read_exactly(fd, min(size, _PREFIX.size))
        if data[:8] != LEGACY_MAGIC and data.startswith(MAGIC):  # else refused below, the rest never read
            data += read_exactly(fd, size - len(data))
    finally:
        os.close(fd)
    if data[:8] == LEGACY_MAGIC:
        raise CacheFileError(
            "cache file format version 1 (saved by an earlier hf_kvcompress; its header is not checksummed): "
            f"this library reads version {VERSION} only; re-save the cache"
        )
    if not data.startswith(MAGIC) and not MAGIC.startswith(data):
        raise CacheFileError("not an hf_kvcompress cache file (bad magic)")
    if len(data) < _PREFIX.size + _DIGEST:
        raise CacheFileError(f"truncated: {len(data)} bytes")
    _magic, version, size = _PREFIX.unpack_from(data, 0)
    if version not in VERSIONS:
        why = " (version 2 held float32 predictor statistics; re-save it)" if version == 2 else " (or the file is damaged)"
        raise CacheFileError(f"cache format version {version}, this library reads {list(VERSIONS)}{why}")
    if hashlib.sha256(memoryview(data)[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise CacheFileError("checksum mismatch: the file is truncated or corrupt")
    end = _PREFIX.size + size
    if size > MAX_HEADER or end > len(data) - _DIGEST:
        raise CacheFileError(f"header of {size} bytes does not fit a file of {len(data)}")
    try:  # any exception: a 4,300-digit integer is a ValueError of its own, deep nesting a RecursionError
        header = json.loads(data[_PREFIX.size : end].decode())
    except Exception as err:
        raise CacheFileError(f"corrupt header ({type(err).__name__}: {err})") from err
    try:
        saved = _check_header(header, data[end : len(data) - _DIGEST])
    except CacheFileError:
        raise
    except Exception as err:  # a check that met a value of a type it did not expect: still the loader's error
        raise CacheFileError(f"bad header ({type(err).__name__}: {err})") from err
    if saved.header["version"] != version:
        raise CacheFileError(f"the header says version {saved.header['version']}, the file's prefix {version}")
    return saved


def _check_header(header: object, payload: bytes) -> _Saved:
    """Every header field, against the others and the payload: nothing later trusts an unchecked value."""
    h = _dict(header, "header", {"format", "version", "library_version", "config", "predictor", "model",
                                 "calibration_sha256", "dtype", "kv_layers", "rows", "kv_heads", "head_dim",
                                 "tokens", "token_ids", "reproducibility", "layers", "payload_bytes"})
    if h["format"] != FORMAT or h["version"] not in VERSIONS:
        raise CacheFileError(f"header names format {h['format']!r} version {h['version']!r}, not {FORMAT!r} "
                             f"{list(VERSIONS)}")
    for key in ("library_version",):
        _str(h[key], key)
    try:
        config = CompressionConfig.from_dict(h["config"])
        model = None if h["model"] is None else ModelIdentity.from_dict(h["model"])
    except (ValueError, TypeError) as err:
        raise CacheFileError(f"bad header field: {err}") from err
    predictor = _dict(h["predictor"], "predictor", {"name", "probe_layer"})
    _str(predictor["name"], "predictor.name")
    if predictor["probe_layer"] is not None:
        _int(predictor["probe_layer"], "predictor.probe_layer", 0)
    if h["calibration_sha256"] is not None:
        _str(h["calibration_sha256"], "calibration_sha256")
    if h["dtype"] not in DTYPES:
        raise CacheFileError(f"unknown dtype {h['dtype']!r}")
    _dict(h["reproducibility"], "reproducibility", None)
    n_layers, rows = _int(h["kv_layers"], "kv_layers", 1, 1 << 20), _int(h["rows"], "rows", 1)
    tokens = _int(h["tokens"], "tokens", 1)
    if h["version"] == LAYERED:
        heads = dim = 0
        if h["kv_heads"] is not None or h["head_dim"] is not None:
            raise CacheFileError("kv_heads and head_dim are per layer in version 4 (null at the top)")
    else:
        heads, dim = _int(h["kv_heads"], "kv_heads", 1), _int(h["head_dim"], "head_dim", 1)
    if _int(h["payload_bytes"], "payload_bytes", 0) != len(payload):
        raise CacheFileError(f"the header claims {h['payload_bytes']} payload bytes, the file holds {len(payload)}")
    ids = h["token_ids"]
    if ids is not None and (not isinstance(ids, list) or len(ids) != rows
                            or any(not isinstance(r, list) or len(r) != tokens for r in ids)):
        raise CacheFileError(f"token_ids must be {rows} rows of {tokens} ids")
    if ids is not None:
        for r in ids:
            for t in r:
                _int(t, "token id", 0, 1 << 62)
    layers = h["layers"]
    cursor = [0]  # streams and side tensors tile the payload in order: no gaps, overlaps or reuse
    if h["version"] == LAYERED:
        _check_layered(layers, n_layers, rows, tokens, config, cursor)
    else:
        if not isinstance(layers, list) or len(layers) != n_layers:
            raise CacheFileError(f"layers: expected a list of {n_layers} layers, got "
                                 f"{len(layers) if isinstance(layers, list) else type(layers).__name__}")
        for index, entry in enumerate(layers):
            entry = _dict(entry, f"layer {index}", {"layer", "blocks"})
            if entry["layer"] != index:
                raise CacheFileError(f"layer entry {index} is labelled {entry['layer']!r} (layers out of order?)")
            _check_blocks(entry["blocks"], f"layer {index}", 0, tokens, rows, heads, dim, config, cursor)
    if cursor[0] != len(payload):
        raise CacheFileError(f"the header accounts for {cursor[0]} of the {len(payload)} payload bytes")
    return _Saved(h, payload, config, DTYPES[h["dtype"]], model)


#: a state entry's fields: per state index, the conv and recurrent tensors (or null), the conv kernel size (or
#: null) and whether the layer has seen a previous state (transformers' `LinearAttentionLayer` attributes)
_STATE_FIELDS = {"conv", "recurrent", "conv_kernel", "previous"}


def _check_layered(layers: object, n_layers: int, rows: int, tokens: int, config: CompressionConfig,
                   cursor: list[int]) -> None:
    """Version 4's layer entries: increasing layer indices below ``n_layers``, each with K/V blocks that tile the
    tokens it holds and / or a state whose tensors fill their extents."""
    if not isinstance(layers, list) or not layers or len(layers) > n_layers:
        raise CacheFileError(f"layers: expected a list of 1 to {n_layers} layer entries")
    last = -1
    for entry in layers:
        entry = _dict(entry, "layer entry", {"layer", "kv", "state"})
        index = _int(entry["layer"], "layer entry index", last + 1, n_layers - 1)
        last = index
        where = f"layer {index}"
        if entry["kv"] is None and entry["state"] is None:
            raise CacheFileError(f"{where} holds neither K/V nor a state")
        if entry["kv"] is not None:
            kv = _dict(entry["kv"], f"{where} kv", {"heads", "key_dim", "value_dim", "sliding_window", "start",
                                                      "blocks"})
            heads = _int(kv["heads"], f"{where} heads", 1, 1 << 16)
            key_dim = _int(kv["key_dim"], f"{where} key_dim", 1, 1 << 16)
            value_dim = _int(kv["value_dim"], f"{where} value_dim", 1, 1 << 16)
            window = kv["sliding_window"]
            if window is not None:
                _int(window, f"{where} sliding_window", 1)
            start = _int(kv["start"], f"{where} start", 0, tokens - 1)
            if window is None and start != 0:
                raise CacheFileError(f"{where} starts at token {start}, but only a sliding layer drops tokens")
            _check_blocks(kv["blocks"], where, start, tokens, rows, heads, max(key_dim, value_dim), config, cursor)
        if entry["state"] is not None:
            state = _dict(entry["state"], f"{where} state", _STATE_FIELDS)
            count = len(state["previous"]) if isinstance(state["previous"], list) else 0
            if not 1 <= count <= 64 or any(not isinstance(state[f], list) or len(state[f]) != count
                                           for f in _STATE_FIELDS):
                raise CacheFileError(f"{where} state: conv, recurrent, conv_kernel and previous must be lists of "
                                     "one entry per state (1 to 64)")
            for i in range(count):
                if not isinstance(state["previous"][i], bool):
                    raise CacheFileError(f"{where} state {i}: previous must be true or false")
                if state["conv_kernel"][i] is not None:
                    _int(state["conv_kernel"][i], f"{where} state {i} conv_kernel", 1, 1 << 20)
                for field in ("conv", "recurrent"):
                    if state[field][i] is not None:
                        _check_tensor(state[field][i], f"{where} state {i} {field}", cursor)
                        if state[field][i]["shape"][:1] != [rows]:
                            raise CacheFileError(f"{where} state {i} {field}: shape {state[field][i]['shape']} does "
                                                 f"not begin with the {rows} batch rows")
                if (state["conv"][i] is None) != (state["conv_kernel"][i] is None):
                    raise CacheFileError(f"{where} state {i}: a conv state and its kernel size go together")


def _check_blocks(blocks: object, layer: str, start: int, tokens: int, rows: int, heads: int, dim: int,
                  config: CompressionConfig, cursor: list[int]) -> None:
    """``layer``'s blocks tile positions ``start .. tokens`` in order, full blocks but the last (streams at most
    ``dim`` elements a token)."""
    if not isinstance(blocks, list) or not blocks:
        raise CacheFileError(f"{layer} has no blocks")
    for b, block in enumerate(blocks):
        where = f"{layer}, block {b}"
        block = _dict(block, where, {"start", "tokens", "rows"})
        if block["start"] != start:
            raise CacheFileError(f"{where} starts at token {block['start']!r}, expected {start} "
                                 "(blocks missing, duplicated or out of order?)")
        count = _int(block["tokens"], f"{where} tokens", 1, config.block_tokens)
        if count != config.block_tokens and start + count != tokens:
            raise CacheFileError(f"{where} holds {count} tokens; only the last block may hold fewer than "
                                 f"block_tokens={config.block_tokens}")
        if not isinstance(block["rows"], list) or len(block["rows"]) != rows:
            raise CacheFileError(f"{where} must hold {rows} rows")
        for r, row in enumerate(block["rows"]):
            _check_row(row, f"{where}, row {r}", heads, count * dim, cursor)
        start += count
    if start != tokens:
        raise CacheFileError(f"{layer} holds {start} tokens, the header says {tokens}")


def _check_row(row: object, where: str, heads: int, elements: int, cursor: list[int]) -> None:
    row = _dict(row, where, {"scales", "streams", "side", "listed"})
    streams, scales = row["streams"], row["scales"]
    if not isinstance(streams, list) or len(streams) != 2 * heads:
        raise CacheFileError(f"{where} must hold {2 * heads} streams")
    if not isinstance(scales, list) or len(scales) != 2 * heads:
        raise CacheFileError(f"{where} must hold {2 * heads} std scales")
    for scale in scales:
        _int(scale, f"{where} std scale", SCALE_MIN, SCALE_MAX)
    for s, stream in enumerate(streams):
        if not isinstance(stream, list) or len(stream) != 2:
            raise CacheFileError(f"{where}, stream {s}: expected [offset, length]")
        length = _extent(stream[0], stream[1], f"{where}, stream {s}", cursor)
        # a stream of n bytes lists at most n / 8 windows of at most MAX_WINDOW elements (the codec's bound):
        # refuses a block claiming more tokens than its streams can hold before anything is allocated
        if elements > MAX_WINDOW * (length // _MIN_STREAM_ENTRY):
            raise CacheFileError(f"{where}, stream {s}: {length} bytes cannot hold the {elements} elements claimed")
    side = _dict(row["side"], f"{where} side", None)
    for name, info in side.items():
        _check_tensor(info, f"{where} side {name!r}", cursor)
    if row["listed"] is not None:
        _check_tensor(row["listed"], f"{where} listed", cursor)


def _check_tensor(info: object, where: str, cursor: list[int]) -> None:
    """A tensor's entry: dtype, shape and the next extent of the payload, which its bytes fill exactly."""
    info = _dict(info, where, {"dtype", "shape", "offset", "bytes"})
    if info["dtype"] not in DTYPES:
        raise CacheFileError(f"{where}: unknown dtype {info['dtype']!r}")
    shape = info["shape"]
    if not isinstance(shape, list) or len(shape) > 8:
        raise CacheFileError(f"{where}: bad shape {shape!r}")
    count = 1
    for n in shape:
        count *= _int(n, f"{where} shape", 0, 1 << 40)
    length = _extent(info["offset"], info["bytes"], where, cursor)
    if count * DTYPES[info["dtype"]].itemsize != length:
        raise CacheFileError(f"{where}: {length} bytes do not hold shape {shape}")


def _extent(offset: object, length: object, where: str, cursor: list[int]) -> int:
    """Check that [offset, offset + length) is the next piece of the payload; advance the cursor."""
    if _int(offset, f"{where} offset", 0) != cursor[0]:
        raise CacheFileError(f"{where} starts at payload byte {offset}, expected {cursor[0]} (overlap or gap)")
    cursor[0] += _int(length, f"{where} length", 0)
    return length  # type: ignore[return-value]


def _dict(value: object, what: str, keys: set[str] | None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CacheFileError(f"{what} must be a JSON object, got {type(value).__name__}")
    if keys is not None and set(value) != keys:
        missing, extra = sorted(keys - set(value)), sorted(set(value) - keys)
        raise CacheFileError(f"{what}: missing fields {missing}, unknown fields {extra}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise CacheFileError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _int(value: object, what: str, low: int, high: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CacheFileError(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return value


# ---------------------------------------------------------------------- helpers


def _check_tokens_for_rerun(cache: CompressedCache, token_ids: torch.Tensor | None, tokens: int) -> None:
    if cache.model is None:
        raise ValueError("save: this predictor reruns the model; the cache needs model=... attached")
    if token_ids is None or token_ids.shape[1] != tokens:
        raise ValueError(
            "save: this predictor reruns the model on the cached tokens, but the cache did not see them all "
            "(attach the model when creating the cache, before the first forward pass)"
        )
    if cache.saw_padding:
        raise ValueError("save: this predictor cannot rerun padded (left-padded batch) inputs; use 'context'")


def _write_row(row: CodedRow, payload: bytearray) -> dict[str, Any]:
    streams = []
    for blob in row.blobs:
        streams.append([len(payload), len(blob)])
        payload += blob
    side = {name: _write_tensor(tensor, payload) for name, tensor in row.side.items()}
    listed = None if row.listed is None else _write_tensor(row.listed, payload)
    return {"scales": list(row.scales), "streams": streams, "side": side, "listed": listed}


def _write_tensor(tensor: torch.Tensor, payload: bytearray) -> dict[str, Any]:
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    entry = {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape), "offset": len(payload),
             "bytes": len(data)}
    payload += data
    return entry


def _read_row(entry: dict[str, Any], payload: bytes) -> CodedRow:
    """A row of a checked header (`_check_row`): its streams and side tensors, copied out of the payload."""
    view = memoryview(payload)
    blobs = [bytes(view[offset : offset + length]) for offset, length in entry["streams"]]
    side = {name: _read_tensor(info, view) for name, info in entry["side"].items()}
    listed = None if entry["listed"] is None else _read_tensor(entry["listed"], view)
    return CodedRow(blobs, array("b", entry["scales"]), side, listed)  # checked to lie in [SCALE_MIN, SCALE_MAX]


def _read_tensor(info: dict[str, Any], view: memoryview) -> torch.Tensor:
    raw = bytearray(view[info["offset"] : info["offset"] + info["bytes"]])
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(DTYPES[info["dtype"]]).reshape(info["shape"]).clone()


def _layer_device(model: torch.nn.Module | None, layer: int) -> torch.device:
    if model is None:
        return torch.device("cpu")
    try:
        return next(decoder_layers(model)[layer].parameters()).device
    except (StopIteration, IndexError, ValueError):
        return torch.device("cpu")
