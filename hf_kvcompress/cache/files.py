"""`CompressedCache.save` / `CompressedCache.load` (the `CacheFiles` methods the cache takes, as transformers'
models take their hub methods from ``PushToHubMixin``), and writing a cache file in short steps: plan (the
file's predictor, coding and version), write each layer (the cache's own blocks where they are the file's,
else coded here), the header, the frame (`container.frame`). The format is `persist`'s; loading is
`persist.load_cache`. This module calls the cache, never the other way round."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..blockcodec import BlockCodec, CodedBlock
from ..calibration import Calibration
from ..config import CompressionConfig
from ..identity import model_identity
from ..layer import CompressedLayer
from ..layer.hybrid import state_tensors, states_outside_cache
from ..layer.layer import holds_as_generated
from ..layer.storage import Block
from ..predictors import make_predictor
from ..predictors.base import Predictor
from ..predictors.registry import (
    AUTO,
    CALIBRATED_STORAGE,
    head_set,
    reads_calibration,
    settings_for,
    storage_predictor,
)
from ..validation import check_bool, check_instance, check_path
from ..version import __version__
from .atomic import replace_file
from .container import frame, write_blocks, write_tensor
from .persist import (
    FORMAT,
    LAYERED,
    MAGIC,
    VERSION,
    CompressedCache,
    load_cache,
    recorded_environment,
    uses_calibration,
)


class CacheFiles:
    """The file methods of `CompressedCache` (a mixin: `cache.CompressedCache` derives from it)."""

    def save(self: Any, path: str | Path, *, predictor: str | None = None, probe_layer: int | None = None,
             progress: bool = False) -> Path:
        """Write the whole cache (token ids, config, calibration fingerprint, streams) to one file, every
        token coded with ``predictor`` (default: ``LosslessConfig.save_predictor``, ``"auto"``: calibrated storage,
        `predictors.registry.CALIBRATED_STORAGE`, where the cache's calibration, or the model's saved one, has its
        heads and every layer holds every token, else ``"generic"``). ``predictor="generic"`` turns calibrated
        storage off: the file then takes generation's blocks as they are and `load` adopts them; another name codes
        with it (``"probe"``/``"twin"`` rerun the model here and at load). A named predictor that reads a
        calibration first resolves a pending ``calibration="auto"`` (`resolve_calibration`: found, or fitted on
        first use); ``"auto"`` only finds one.
        The file is replaced atomically (a temporary file beside it, flushed to the disk, then renamed): a save that
        fails (a full disk, an interrupt, a killed process) leaves an existing file as it was.
        Raises ``TypeError`` for a ``path`` that is no str / os.PathLike or a ``self`` that is no `CompressedCache`
        (a transformers ``DynamicCache``), ``ValueError`` for an empty ``path``, one that names a device or FIFO, or a
        cache that cannot be saved
        (empty, lossy, or of a model that keeps recurrent states in its own modules, as RecurrentGemma) and
        ``OSError`` for a path that cannot be written (``FileNotFoundError``: no such folder;
        ``IsADirectoryError``: a folder; ``PermissionError``: a folder this process may not write), all before
        any coding; an ``OSError`` while writing (a full disk) leaves the old file untouched."""
        check_instance("save: the cache", self, CacheFiles,
                       "a CompressedCache (to keep a transformers DynamicCache's K/V, put it into a PrefixStore or "
                       "fill a CompressedCache)")
        target = _writable(path)
        check_instance("save: predictor", predictor, str, "a predictor name", optional=True)
        name = predictor or self.config.lossless.save_predictor
        if name == AUTO:
            name = _auto_predictor(self)
        elif self.calibration_pending and reads_calibration(name):
            self.resolve_calibration(predictor=name)
        return save_cache(self, target, predictor=name, probe_layer=probe_layer, progress=progress)

    @classmethod
    def load(cls, path: str | Path, *, model: torch.nn.Module | None = None,
             calibration: Calibration | str | Path | None = None, config: CompressionConfig | None = None,
             progress: bool = False, verify: bool | None = None) -> Any:
        """Rebuild a cache saved with `save`: bit-identical K/V; generation continues as without the round
        trip. A file saved with a calibration needs that calibration: ``calibration`` or, when not given, the
        model's default one (never fitted here). Raises `CacheFileError` for files from another model,
        calibration or library version, corrupt files, or a predictor that does not reproduce here. Blocks coded
        as generation codes them (a ``"generic"`` file) are adopted, not re-coded. ``verify`` (default: when a
        ``model`` is given, i.e. for generating) decodes every stream once here, so that a file edited behind its
        checksum is a `CacheFileError` here, never an error inside `generate`; ``verify=False`` leaves each
        stream's checks to its first read (`CorruptStreamError` there). Arguments of the wrong type (``path`` no
        str / os.PathLike, ``model`` no torch module, ``calibration`` no `Calibration` or path, ``config`` no
        `CompressionConfig`, ``verify`` no bool or None) raise ``TypeError`` (an empty ``path``: ``ValueError``)
        naming the argument, before the file is read."""
        _check_load_arguments(path, model, calibration, config, progress, verify)
        return load_cache(path, cache_class=cls, model=model, calibration=calibration, config=config,
                          progress=progress, verify=verify)


@dataclass
class _Plan:
    """What a save codes with: the predictor (by name and built), its coding over the file's own blocks, the
    file's version and the tokens it holds."""

    name: str
    header_fields: dict[str, Any]  # the header's predictor object beside the name
    predictor: Predictor
    coding: BlockCodec
    blocks: dict[tuple[int, int], Block]  # the file's blocks as they are made, for the layer-below lookups
    layered: bool
    tokens: int
    token_ids: torch.Tensor | None


def save_cache(cache: CompressedCache, target: Path, predictor: str | None = None, probe_layer: int | None = None,
               progress: bool = False) -> Path:
    """Write ``cache`` to ``target`` (a path `_writable` checked) as one file, every token coded with ``predictor``
    (default: the config's ``save_predictor``)."""
    plan = _plan(cache, predictor, probe_layer)
    payload = bytearray()
    entries, first = _write_layers(cache, plan, payload, progress)
    header = _header(cache, plan, entries, first, len(payload))
    replace_file(target, frame(MAGIC, header["version"], header, payload))  # all or nothing: an old file survives
    if cache.calibration is not None and not uses_calibration(cache):
        cache.calibration.release()  # heads read for this save only: generation does not hold them
    return target


def _writable(path: object) -> Path:
    """``path`` as a `Path` whose folder exists and may be written here: checked before any coding, so that a save
    that cannot succeed fails at once (its temporary file and the rename need the folder's write permission)."""
    target = check_path("save: path", path)
    if target.is_dir():  # before any coding: the rename would raise a bare IsADirectoryError after it
        raise IsADirectoryError(f"save: {str(target)!r} is a folder; pass a file path, e.g. {str(target / 'cache.kvc')!r}")
    if target.exists() and not target.is_file():  # the rename would replace a device node or FIFO with a file
        raise ValueError(f"save: {str(target)!r} is a device or FIFO, not a regular file; pass a file path")
    folder = target.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"save: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"save: the folder {folder} is not writable here (a file is written beside the target "
                              "and renamed onto it)")
    return target


def _auto_predictor(cache: CompressedCache) -> str:
    """What a save codes with by default (`LosslessConfig.save_predictor` ``"auto"``): calibrated storage where
    the cache's calibration (or the model's saved one) allows it and the file is of version 3, else ``"generic"``."""
    calibration = cache.storage_calibration((head_set(CALIBRATED_STORAGE),)) if _fits_version_3(cache) else None
    return storage_predictor(AUTO, calibration)


def _check_load_arguments(path: object, model: object, calibration: object, config: object, progress: object,
                          verify: object) -> None:
    """`CacheFiles.load`'s arguments, by type, before the file is read (one wording: `validation`)."""
    check_path("load: path", path)
    check_instance("load: model", model, torch.nn.Module, "the model object (a torch.nn.Module)", optional=True)
    check_instance("load: calibration", calibration, (Calibration, str, os.PathLike),
                   "a Calibration or the path of a calibration folder", optional=True)
    check_instance("load: config", config, CompressionConfig, "a CompressionConfig", optional=True)
    check_bool("load: progress", progress)
    check_instance("load: verify", verify, bool, "a bool", optional=True)


def _check_states_held(cache: CompressedCache) -> None:
    """Refuse a cache whose model keeps a linear-attention layer's state in its own modules (RecurrentGemma): the
    layer's states were never updated although the attention layers hold tokens, so a file could not hold that state,
    and a load continued in another process would start from a wrong one without a word."""
    outside = states_outside_cache(cache.layers, cache.model)
    if outside:
        raise ValueError(f"save: {outside}: a file cannot hold it, so a loaded cache would continue from a wrong state")


def _plan(cache: CompressedCache, predictor: str | None, probe_layer: int | None) -> _Plan:
    """Check that ``cache`` can be saved with ``predictor``; the predictor and coding the file is written with."""
    layers = cache.kv_layers()
    states = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
              and bool(state_tensors(layer))]
    seen = max((layer.seen_tokens for layer in layers), default=0)
    if seen == 0 and not states:
        raise ValueError("save: the cache is empty")
    if seen:  # attention layers hold tokens: every linear-attention layer must then hold its state
        _check_states_held(cache)
    if any(not block.exact for layer in layers for block in layer.blocks):
        raise ValueError("save: only caches that hold their tokens exactly (no lossy summary)")
    settings = cache.config.lossless
    name = predictor or settings.save_predictor
    if name == AUTO:
        name = _auto_predictor(cache)
    # the header's predictor object (`_header`): the name and, whatever the predictor, the probe layer (the format's)
    values = {"probe_layer": probe_layer or settings.probe_layer}
    # portable: the file is read on other machines
    chosen = make_predictor(name, calibration=cache.calibration, model=cache.model,
                            settings=settings_for(name, values), portable=True)
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
    if not chosen.practical_in_generation:
        _check_tokens_for_rerun(cache, token_ids, tokens)
    blocks: dict[tuple[int, int], Block] = {}
    coding = BlockCodec.over(settings, chosen, cache.calibration, lambda layer, start: blocks.get((layer, start)))
    if cache.lossless is None or not coding.codes_like(cache.lossless):
        # the file codes every token again: for size (the codec's default coder), not for decode speed (a generation
        # coder such as ``huff``); a save that codes as generation keeps generation's blocks and their coder
        coding = BlockCodec.over(dataclasses.replace(settings, coder=chosen.storage_coder), chosen, cache.calibration,
                                 lambda layer, start: blocks.get((layer, start)))
    if not chosen.practical_in_generation:
        coding.extras_source = chosen.model_extras(token_ids)
    return _Plan(name, values, chosen, coding, blocks, layered, tokens, token_ids)


def _write_layers(cache: CompressedCache, plan: _Plan, payload: bytearray,
                  progress: bool) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
    """Every layer's entry of the header, its streams and tensors appended to ``payload``; and the first K/V
    layer's keys (rows and dtype of what is held), None for a cache of states only."""
    held = [(index, layer) for index, layer in enumerate(cache.layers)
            if isinstance(layer, (CompressedLayer, LinearAttentionCacheLayerMixin))]
    entries, keys0 = [], None
    for index, layer in tqdm(held, desc=f"saving ({plan.name})", disable=not progress, leave=False):
        kv, keys = _kv_entry(cache, plan, index, layer, payload) if isinstance(layer, CompressedLayer) \
            else (None, None)
        keys0 = keys if keys0 is None else keys0
        if plan.layered:
            state = _write_state(layer, payload) if isinstance(layer, LinearAttentionCacheLayerMixin) else None
            entries.append({"layer": index, "kv": kv, "state": state})
        else:
            entries.append({"layer": index, "blocks": kv["blocks"]})
    return entries, keys0


def _kv_entry(cache: CompressedCache, plan: _Plan, index: int, layer: CompressedLayer,
              payload: bytearray) -> tuple[dict[str, Any] | None, torch.Tensor | None]:
    """A K/V layer's entry (None: it holds nothing yet) and its keys' tensor (for shape and dtype)."""
    taken = _generation_blocks(cache, layer, index, plan.predictor, plan.coding)
    if taken is not None:  # the cache's own blocks are the file's: their streams, not decoded and coded again
        keys, values = layer.residual_keys, layer.residual_values
        blocks = taken + _code_blocks(plan, index, keys, values, len(taken) * cache.config.block_tokens,
                                      cache.config.block_tokens)
        return {"heads": keys.shape[1], "key_dim": keys.shape[3], "value_dim": values.shape[3],
                "sliding_window": None, "start": 0, "blocks": write_blocks(blocks, payload)}, keys
    if not layer.is_initialized:
        return None, None
    keys, values = layer.keys, layer.values
    first = layer.seen_tokens - keys.shape[2]
    blocks = _code_blocks(plan, index, keys, values, first, cache.config.block_tokens)
    return {"heads": keys.shape[1], "key_dim": keys.shape[3], "value_dim": values.shape[3],
            "sliding_window": layer.sliding_window, "start": first, "blocks": write_blocks(blocks, payload)}, keys


def _code_blocks(plan: _Plan, index: int, keys: torch.Tensor, values: torch.Tensor, first: int,
                 block_tokens: int) -> list[CodedBlock]:
    """Code ``keys`` / ``values`` (positions ``first ..``) in blocks of ``block_tokens``: the whole blocks in one call
    (`BlockCodec.encode_blocks`: one codec call per kind, a predictor's batched form), the shorter last one apart."""
    whole = keys.shape[2] - keys.shape[2] % block_tokens
    blocks = plan.coding.encode_blocks(index, keys[:, :, :whole], values[:, :, :whole], first, block_tokens) \
        if whole else []
    if whole < keys.shape[2]:
        blocks.append(plan.coding.encode_block(index, keys[:, :, whole:], values[:, :, whole:], first + whole))
    for block in blocks:
        plan.blocks[(index, block.start)] = block
    return blocks


def _header(cache: CompressedCache, plan: _Plan, entries: list[dict[str, Any]], keys0: torch.Tensor | None,
            payload_bytes: int) -> dict[str, Any]:
    """The file's JSON header (`persist._check_header` checks every field of it at load)."""
    if keys0 is None:  # states only: their first tensor says the rows and dtype
        keys0 = state_tensors(next(layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
                                   and bool(state_tensors(layer))))[0]
    token_ids = plan.token_ids
    if token_ids is not None and tuple(token_ids.shape) != (keys0.shape[0], plan.tokens):
        token_ids = None  # ids of other rows or tokens than the cache holds (recorded partly): not the cache's
    layered = plan.layered
    return {
        "format": FORMAT,
        "version": LAYERED if layered else VERSION,
        "library_version": __version__,
        "config": cache.config.to_dict(),
        "predictor": {"name": plan.name, **plan.header_fields},
        "model": model_identity(cache.model).to_dict() if cache.model is not None else None,
        # only a file coded with the calibration names it (a 'generic' file loads without one)
        "calibration_sha256": cache.calibration.meta["tensors_sha256"]
        if cache.calibration is not None and plan.predictor.calibrated else None,
        "dtype": str(keys0.dtype).replace("torch.", ""),
        "kv_layers": len(cache.layers) if layered else len(entries),
        "rows": keys0.shape[0],
        "kv_heads": None if layered else keys0.shape[1],
        "head_dim": None if layered else keys0.shape[3],
        "tokens": plan.tokens,
        "token_ids": token_ids.tolist() if token_ids is not None else None,
        "reproducibility": recorded_environment(plan.predictor),  # null unless the bits depend on this machine
        "layers": entries,
        "payload_bytes": payload_bytes,
    }


def _generation_blocks(cache: CompressedCache, layer: CompressedLayer, index: int, chosen: Predictor,
                       coding: BlockCodec) -> list[CodedBlock] | None:
    """``layer``'s sealed blocks when they are what the file would code (the save's predictor is generation's and
    codes alike on every CPU, the same codec settings and marginals; whole blocks from position 0 of a
    full-attention layer), else None: the save then codes every token itself."""
    mine = cache.lossless
    if mine is None or not coding.codes_like(mine) or not layer.is_initialized:
        return None
    if not holds_as_generated(layer) or not layer.blocks:
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
        if not holds_as_generated(layer) or not layer.is_initialized:
            return False
        shapes.add((tuple(layer.residual_keys.shape[1:2]), layer.residual_keys.shape[3],
                    layer.residual_values.shape[3], layer.seen_tokens))
    return len(shapes) == 1 and len({(s[1], s[2]) for s in shapes if s[1] == s[2]}) == 1


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


def _write_state(layer: LinearAttentionCacheLayerMixin, payload: bytearray) -> dict[str, Any]:
    """A linear-attention / hybrid layer's conv and recurrent states, raw, as transformers holds them."""
    count = layer.number_of_states

    def tensor(states: dict, i: int) -> dict[str, Any] | None:
        t = states.get(i)
        return None if t is None else write_tensor(t.detach().cpu(), payload)

    conv = [tensor(layer.conv_states, i) if layer.is_conv_states_initialized[i] else None for i in range(count)]
    recurrent = [tensor(layer.recurrent_states, i) if layer.is_recurrent_states_initialized[i] else None
                 for i in range(count)]
    kernel = [layer.conv_kernel_size[i] if conv[i] is not None else None for i in range(count)]
    return {"conv": conv, "recurrent": recurrent, "conv_kernel": kernel,
            "previous": [bool(layer.has_previous_state[i]) for i in range(count)]}
