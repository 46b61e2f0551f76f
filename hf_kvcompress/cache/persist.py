"""The `.kvc` cache file and loading it: the prefix-cache use (store a prompt's KV once, reload later).

File layout: a framed file (`container`: ``MAGIC``, the format version, the header length, a UTF-8 JSON header,
the payload, a SHA-256 of everything before it; `files` writes it). The header carries the token ids, the
config, the predictor, the model identity and calibration checksum, the library version and, only for a predictor
that reruns the model (its bits depend on the machine), what it needs to reproduce (threads, CPU): the same K/V
give the same bytes on every machine otherwise. Nothing is unpickled.

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
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..blockcodec import BlockCodec, CodedBlock
from ..calibration import Calibration, CalibrationError, calibration_dir, find_calibration
from ..codec import CorruptStreamError, coder_of_stream
from ..config import CompressionConfig
from ..errors import CacheFileError, PredictorMismatchError
from ..identity import ModelIdentity, kv_shape, model_identity
from ..layer import CompressedLayer
from ..layer.layer import held_parts, holds_as_generated
from ..predictors import make_predictor
from ..predictors.base import Predictor
from ..predictors.registry import reads_calibration, settings_for
from ..predictors.rerun import layer_device
from ..version import __version__
from .binding import binding_problem
from .container import (
    DTYPES,
    check_blocks,
    check_int,
    check_ints,
    check_object,
    check_str,
    check_tensor,
    open_regular,
    read_blocks,
    read_exactly,
    read_framed,
    read_row,
    read_tensor,
)


class CompressedCache(Protocol):
    """What save and load use of a `cache.CompressedCache` (a protocol: the cache takes its ``save`` / ``load``
    from `files.CacheFiles`, which imports this module, so this module does not import the cache)."""

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



def reproducibility() -> dict[str, Any]:
    """What a model-running predictor's bits depend on besides the inputs: recorded in the files of such predictors
    only (`recorded_environment`), to say why one does not decode elsewhere."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def recorded_environment(predictor: Predictor) -> dict[str, Any] | None:
    """The header's ``reproducibility``: this machine's description (`reproducibility`) for a predictor whose bits
    depend on it (one that reruns the model at load: not `practical_in_generation`), else None, so that the same K/V
    give the same file on every CPU ('generic', 'none', 'context', ... code alike everywhere)."""
    return None if predictor.practical_in_generation else reproducibility()


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
    """Read and check the file, build the cache it loads into, check every block, then adopt or decode each
    layer's blocks."""
    saved = _read(path)
    target = _target(saved, cache_class, model, calibration, config)
    reading = _reading(saved, target, model)
    header = saved.header
    try:
        for entry in tqdm(reading.entries, desc=f"loading ({reading.name})", disable=not progress, leave=False):
            _fill_layer(saved, target, reading, entry, layer_device(model, entry["layer"]))
        if verify and reading.adopting and target.lossless is not None:
            # adopted blocks decode once here (every layer in one call where the codec may: `read_layers`): a stream
            # that does not decode fails now
            target.lossless.read_layers([held.blocks for held in target.kv_layers() if held.blocks])
        if model is not None:
            _check_binding(target, model, reading.token_ids)
    except PredictorMismatchError as err:
        here, saved_with = reproducibility(), header["reproducibility"]
        why = (f"the file records no environment, loading with {here}" if saved_with is None
               else f"saved with {saved_with}, loading with {here}" if saved_with != here
               else f"the file's environment record equals this one ({here})")
        raise CacheFileError(
            f"the '{reading.name}' predictor does not reproduce here ({why}), or the file was edited and its checksum "
            f"recomputed; 'generic', 'none' and 'context' files decode on every CPU, predictors that rerun the "
            f"model depend on its kernels: {err}"
        ) from err
    except CorruptStreamError as err:
        raise CacheFileError(f"a stream does not decode: {err}") from err
    except ValueError as err:  # e.g. a calibration that lacks a layer the file holds
        raise CacheFileError(f"cannot decode: {err}") from err
    rows = header["rows"]
    if next((layer.rows for layer in target.kv_layers() if layer.is_initialized), rows) != rows:
        raise CacheFileError(f"decoded {target.kv_layers()[0].rows} batch rows, the header says {rows}")
    target.token_ids = reading.token_ids
    return target


def _target(saved: _Saved, cache_class, model, calibration, config) -> CompressedCache:
    """The empty cache the file loads into, checked against the file (library version, model, calibration,
    layers) before anything is decoded."""
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
    return target


@dataclass
class _Reading:
    """How a checked file decodes: its predictor (by name and built) and coding, its blocks (checked, by layer and
    first position), its layer entries, token ids, and whether ``target`` adopts its blocks as they are."""

    name: str
    coding: BlockCodec
    blocks: dict[tuple[int, int], CodedBlock]
    entries: list[dict[str, Any]]
    token_ids: torch.Tensor | None
    adopting: bool


def _reading(saved: _Saved, target: CompressedCache, model: torch.nn.Module | None) -> _Reading:
    """The file's predictor as it coded (with the calibration the file names, or without one) and every block of
    the file, checked (`container.check_block`) before any is decoded or allocated for."""
    header = saved.header
    name = header["predictor"]["name"]
    try:
        calibration = target.calibration if header["calibration_sha256"] is not None else None
        # portable: as it was written
        predictor = make_predictor(name, calibration=calibration, model=model,
                                   settings=settings_for(name, header["predictor"]), portable=True)
    except (ValueError, TypeError) as err:
        raise CacheFileError(f"cannot rebuild the {name!r} predictor it was saved with: {err}") from err
    blocks: dict[tuple[int, int], CodedBlock] = {}  # the file's blocks as they are checked: layer-below lookups
    coding = BlockCodec.over(_file_settings(header, saved), predictor, target.calibration,
                             lambda layer, start: blocks.get((layer, start)))
    token_ids = torch.tensor(header["token_ids"], dtype=torch.long) if header["token_ids"] is not None else None
    if not predictor.practical_in_generation:
        if token_ids is None:
            raise CacheFileError(f"the {name} predictor needs token ids, which this file lacks")
        coding.extras_source = predictor.model_extras(token_ids)
    entries = _layer_entries(header)
    if header["version"] == LAYERED:
        _layered_target(target, entries, header["kv_layers"])
    sides: dict[tuple, dict] = {}  # the side data each block shape needs, asked of the predictor once per shape
    for entry in entries:
        layer, kv = entry["layer"], entry["kv"]
        if kv is not None:
            for block in read_blocks(kv, saved.payload, coding, layer, saved.dtype, torch.device("cpu"), predictor,
                                     sides):
                blocks[(layer, block.start)] = block
    adopting = _adopts(header, saved.config, target, predictor, coding)
    return _Reading(name, coding, blocks, entries, token_ids, adopting)


def _fill_layer(saved: _Saved, target: CompressedCache, reading: _Reading, entry: dict[str, Any],
                device: torch.device) -> None:
    """One layer entry into ``target``: the blocks it takes as they are (`_adoptable_blocks`) adopted, the rest
    decoded into its residual (or, none adopted, into the layer as an update), then its recurrent states."""
    header, tokens = saved.header, saved.header["tokens"]
    layer, kv, state = entry["layer"], entry["kv"], entry["state"]
    if kv is None:
        _restore_state(target.layers[layer], state, saved.payload, device, tokens)
        return
    held = target.layers[layer] if layer < len(target.layers) else None
    count = _adoptable_blocks(kv, tokens, target, held) if reading.adopting else 0
    adopted = [_adopted(reading.blocks[(layer, b["start"])], device) for b in kv["blocks"][:count]]
    decoded = reading.coding.decoded_layer([reading.blocks[(layer, b["start"])] for b in kv["blocks"][count:]])
    keys = [d.keys for d in decoded]  # the newest tokens, which generation holds as plain tensors
    values = [d.values for d in decoded]
    if adopted:
        if held is None:
            target.layers.append(target._new_layer(layer))
            held = target.layers[layer]
        if keys:
            held.adopt(adopted, torch.cat(keys, dim=2).to(device), torch.cat(values, dim=2).to(device))
        else:
            held.adopt(adopted)
        if state is not None:
            _restore_state(held, state, saved.payload, device, tokens)
        return
    keys, values = torch.cat(keys, dim=2).to(device), torch.cat(values, dim=2).to(device)
    if header["version"] == LAYERED:
        target.layers[layer].restore(keys, values, tokens)
        if state is not None:  # after the K/V: restoring them resets the layer
            _restore_state(target.layers[layer], state, saved.payload, device, tokens)
    else:
        target.update(keys, values, layer)


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
    # keys and values of one decode (a sealed block decodes here: a stream edited behind the checksum fails in load)
    keys, values = (torch.cat(parts, dim=-2) for parts in held_parts(layer))
    try:
        problem = binding_problem(model, token_ids, index, keys, values, start=layer.seen_tokens - keys.shape[2])
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
                blobs = read_row(row, saved.payload).blobs
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
    if layer is not None and not holds_as_generated(layer):
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
        heads, dim = kv_shape(text)
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


def _restore_state(layer: LinearAttentionCacheLayerMixin, state: dict[str, Any], payload: bytes,
                   device: torch.device, tokens: int) -> None:
    """Put a checked state entry back into transformers' layer, as its own updates would have left it after
    ``tokens`` tokens (its token counter too, where transformers keeps one: ``cumulative_length_linear``, 5.25+)."""
    view = memoryview(payload)
    for i, previous in enumerate(state["previous"]):
        if state["conv"][i] is not None:
            conv = read_tensor(state["conv"][i], view).to(device)
            layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=state["conv_kernel"][i])
            layer.conv_states[i] = conv  # the saved tensor itself: a recorded past may be longer than the kernel
        if state["recurrent"][i] is not None:
            recurrent = read_tensor(state["recurrent"][i], view).to(device)
            layer.lazy_initialization(recurrent_states=recurrent, state_idx=i)
            layer.recurrent_states[i].copy_(recurrent)
        layer.has_previous_state[i] = previous
    counter = getattr(layer, "cumulative_length_linear", None)
    # transformers counts tokens in its first conv state's updates only: a layer the model never updated (one whose
    # model keeps its states in its own modules, RecurrentGemma) counts 0, and its cache's length reads 0 from it
    if isinstance(counter, torch.Tensor) and state["previous"] and state["previous"][0]:
        counter.fill_(tokens)


def _read(path: Path) -> _Saved:
    """Read the file (a regular file: its prefix and header first, the payload only if the sizes the header
    declares make up the file and it fits in memory, `container.read_framed`); verify magic, version and the
    SHA-256 over everything (`container.unframe`); check the header."""
    fd, _size = open_regular(path)
    try:
        first = read_exactly(fd, len(LEGACY_MAGIC))
    finally:
        os.close(fd)
    if first == LEGACY_MAGIC:
        raise CacheFileError(
            "cache file format version 1 (saved by an earlier hf_kvcompress; its header is not checksummed): "
            f"this library reads version {VERSION} only; re-save the cache"
        )
    framed = read_framed(path, magic=MAGIC, versions=VERSIONS, kind="cache", payload_field="payload_bytes",
                         max_bytes=max_file_bytes(), version_note=_refused_version)
    try:
        saved = _check_header(framed.header, framed.payload)
    except CacheFileError:
        raise
    except Exception as err:  # a check that met a value of a type it did not expect: still the loader's error
        raise CacheFileError(f"bad header ({type(err).__name__}: {err})") from err
    if saved.header["version"] != framed.version:
        raise CacheFileError(f"the header says version {saved.header['version']}, the file's prefix {framed.version}")
    return saved


def max_file_bytes() -> int:
    """The largest cache file `load` reads: the machine's memory (a larger one could not be loaded; a sparse or
    planted file that claims more is refused before anything is read or allocated)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): 64 GiB
        return 64 << 30


def _refused_version(version: int) -> str:
    return " (version 2 held float32 predictor statistics; re-save it)" if version == 2 else " (or the file is damaged)"


def _check_header(header: object, payload: bytes) -> _Saved:
    """Every header field, against the others and the payload: nothing later trusts an unchecked value."""
    h = check_object(header, "header", {"format", "version", "library_version", "config", "predictor", "model",
                                 "calibration_sha256", "dtype", "kv_layers", "rows", "kv_heads", "head_dim",
                                 "tokens", "token_ids", "reproducibility", "layers", "payload_bytes"})
    if h["format"] != FORMAT or h["version"] not in VERSIONS:
        raise CacheFileError(f"header names format {h['format']!r} version {h['version']!r}, not {FORMAT!r} "
                             f"{list(VERSIONS)}")
    for key in ("library_version",):
        check_str(h[key], key)
    try:
        config = CompressionConfig.from_dict(h["config"])
        model = None if h["model"] is None else ModelIdentity.from_dict(h["model"])
    except (ValueError, TypeError) as err:
        raise CacheFileError(f"bad header field: {err}") from err
    predictor = check_object(h["predictor"], "predictor", {"name", "probe_layer"})
    check_str(predictor["name"], "predictor.name")
    if predictor["probe_layer"] is not None:
        check_int(predictor["probe_layer"], "predictor.probe_layer", 0)
    if h["calibration_sha256"] is not None:
        check_str(h["calibration_sha256"], "calibration_sha256")
    if h["dtype"] not in DTYPES:
        raise CacheFileError(f"unknown dtype {h['dtype']!r}")
    if h["reproducibility"] is not None:  # files of predictors that rerun the model; earlier files record it always
        check_object(h["reproducibility"], "reproducibility", None)
    n_layers, rows = check_int(h["kv_layers"], "kv_layers", 1, 1 << 20), check_int(h["rows"], "rows", 1)
    tokens = check_int(h["tokens"], "tokens", 1)
    if h["version"] == LAYERED:
        heads = dim = 0
        if h["kv_heads"] is not None or h["head_dim"] is not None:
            raise CacheFileError("kv_heads and head_dim are per layer in version 4 (null at the top)")
    else:
        heads, dim = check_int(h["kv_heads"], "kv_heads", 1), check_int(h["head_dim"], "head_dim", 1)
    if check_int(h["payload_bytes"], "payload_bytes", 0) != len(payload):
        raise CacheFileError(f"the header claims {h['payload_bytes']} payload bytes, the file holds {len(payload)}")
    ids = h["token_ids"]
    if ids is not None and (not isinstance(ids, list) or len(ids) != rows
                            or any(not isinstance(r, list) or len(r) != tokens for r in ids)):
        raise CacheFileError(f"token_ids must be {rows} rows of {tokens} ids")
    if ids is not None:
        for r in ids:
            check_ints(r, "token id", 0, 1 << 62)
    layers = h["layers"]
    cursor = [0]  # streams and side tensors tile the payload in order: no gaps, overlaps or reuse
    if h["version"] == LAYERED:
        _check_layered(layers, n_layers, rows, tokens, config, cursor)
    else:
        if not isinstance(layers, list) or len(layers) != n_layers:
            raise CacheFileError(f"layers: expected a list of {n_layers} layers, got "
                                 f"{len(layers) if isinstance(layers, list) else type(layers).__name__}")
        for index, entry in enumerate(layers):
            entry = check_object(entry, f"layer {index}", {"layer", "blocks"})
            if entry["layer"] != index:
                raise CacheFileError(f"layer entry {index} is labelled {entry['layer']!r} (layers out of order?)")
            check_blocks(entry["blocks"], f"layer {index}", 0, tokens, rows, heads, dim, config, cursor)
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
        entry = check_object(entry, "layer entry", {"layer", "kv", "state"})
        index = check_int(entry["layer"], "layer entry index", last + 1, n_layers - 1)
        last = index
        where = f"layer {index}"
        if entry["kv"] is None and entry["state"] is None:
            raise CacheFileError(f"{where} holds neither K/V nor a state")
        if entry["kv"] is not None:
            kv = check_object(entry["kv"], f"{where} kv", {"heads", "key_dim", "value_dim", "sliding_window", "start",
                                                      "blocks"})
            heads = check_int(kv["heads"], f"{where} heads", 1, 1 << 16)
            key_dim = check_int(kv["key_dim"], f"{where} key_dim", 1, 1 << 16)
            value_dim = check_int(kv["value_dim"], f"{where} value_dim", 1, 1 << 16)
            window = kv["sliding_window"]
            if window is not None:
                check_int(window, f"{where} sliding_window", 1)
            start = check_int(kv["start"], f"{where} start", 0, tokens - 1)
            if window is None and start != 0:
                raise CacheFileError(f"{where} starts at token {start}, but only a sliding layer drops tokens")
            check_blocks(kv["blocks"], where, start, tokens, rows, heads, max(key_dim, value_dim), config, cursor)
        if entry["state"] is not None:
            state = check_object(entry["state"], f"{where} state", _STATE_FIELDS)
            count = len(state["previous"]) if isinstance(state["previous"], list) else 0
            if not 1 <= count <= 64 or any(not isinstance(state[f], list) or len(state[f]) != count
                                           for f in _STATE_FIELDS):
                raise CacheFileError(f"{where} state: conv, recurrent, conv_kernel and previous must be lists of "
                                     "one entry per state (1 to 64)")
            for i in range(count):
                if not isinstance(state["previous"][i], bool):
                    raise CacheFileError(f"{where} state {i}: previous must be true or false")
                if state["conv_kernel"][i] is not None:
                    check_int(state["conv_kernel"][i], f"{where} state {i} conv_kernel", 1, 1 << 20)
                for field in ("conv", "recurrent"):
                    if state[field][i] is not None:
                        check_tensor(state[field][i], f"{where} state {i} {field}", cursor)
                        if state[field][i]["shape"][:1] != [rows]:
                            raise CacheFileError(f"{where} state {i} {field}: shape {state[field][i]['shape']} does "
                                                 f"not begin with the {rows} batch rows")
                if (state["conv"][i] is None) != (state["conv_kernel"][i] is None):
                    raise CacheFileError(f"{where} state {i}: a conv state and its kernel size go together")
