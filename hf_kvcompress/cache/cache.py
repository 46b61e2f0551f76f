"""`CompressedCache`: the `transformers.Cache` users pass to `generate()`."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from ..calibration import FIRST_USE_PREDICTORS, Calibration, calibration_for
from ..config import CompressionConfig
from ..errors import BUILD_WITH_MODEL, LayerKindError
from ..identity import not_full_attention
from ..layer import CompressedLayer, RawStorage, SlidingWindowLayer, Storage
from ..layer.hybrid import CompressedHybridLayer, SlidingHybridLayer
from ..layer.storage import owned, row_index
from ..lossy.layer import LossyHybridLayer, LossyLayer
from ..lossy.refusals import require_model
from ..predictors.registry import FITTED, reads_calibration
from ..validation import check_int
from .coded import CodedStorage, LosslessCoding, coding_for, sealed_raw_bytes
from .files import CacheFiles
from .report import cache_stats

#: a sliding layer seals (codes) blocks only when its window holds at least this many blocks beyond the residual:
#: a smaller window keeps every token raw, as transformers does (docs/model_support.md, "Sliding windows")
SLIDING_MIN_BLOCKS = 4


def _attention_layer(cache: CompressedCache, layer_idx: int, kwargs: dict) -> CompressedLayer:
    """Full attention: lossy mode's layer, else one sealing blocks through the mode's storage."""
    if cache.config.mode == "lossy":
        return LossyLayer(cache, layer_idx=layer_idx)
    return CompressedLayer(cache._storage_for(layer_idx), **_sizes(cache, layer_idx))


def _sliding_layer(cache: CompressedCache, layer_idx: int, kwargs: dict) -> CompressedLayer:
    """A sliding (or chunked) window: never lossy (its memory is bounded already), coded only when large enough."""
    window = kwargs.get("sliding_window")
    if window is None:  # a sliding type without a window attends to everything
        return _attention_layer(cache, layer_idx, kwargs)
    return SlidingWindowLayer(**_window(cache, layer_idx, window), **_sizes(cache, layer_idx))


def _hybrid_layer(cache: CompressedCache, layer_idx: int, kwargs: dict) -> CompressedLayer:
    """transformers' recurrent states beside full-attention KV."""
    states = kwargs.get("number_of_states", 1)
    if cache.config.mode == "lossy":
        return LossyHybridLayer(cache, layer_idx=layer_idx, number_of_states=states)
    return CompressedHybridLayer(cache._storage_for(layer_idx), number_of_states=states, **_sizes(cache, layer_idx))


def _hybrid_sliding_layer(cache: CompressedCache, layer_idx: int, kwargs: dict) -> CompressedLayer:
    """transformers' recurrent states beside a sliding window's KV."""
    window = kwargs.get("sliding_window")
    if window is None:
        return _hybrid_layer(cache, layer_idx, kwargs)
    return SlidingHybridLayer(number_of_states=kwargs.get("number_of_states", 1),
                              **_window(cache, layer_idx, window), **_sizes(cache, layer_idx))


def _state_layer(cache: CompressedCache, layer_idx: int, kwargs: dict) -> LinearAttentionLayer:
    """Recurrent / convolution states only: transformers' own layer (nothing to seal or code)."""
    return LinearAttentionLayer(number_of_states=kwargs.get("number_of_states", 1))


def _sizes(cache: CompressedCache, layer_idx: int) -> dict[str, Any]:
    return {"block_tokens": cache.config.block_tokens, "residual_tokens": cache.config.residual_tokens,
            "layer_idx": layer_idx}


def _window(cache: CompressedCache, layer_idx: int, window: int) -> dict[str, Any]:
    """A sliding layer's storage and settings: coded in lossless mode when the window holds `SLIDING_MIN_BLOCKS`."""
    config = cache.config
    seals = config.mode == "lossless" and window - 1 >= config.residual_tokens + SLIDING_MIN_BLOCKS * config.block_tokens
    return {"storage": cache._storage_for(layer_idx) if seals else RawStorage(), "sliding_window": window,
            "seals": seals}


#: transformers' layer type (`transformers.cache_utils.DYNAMIC_LAYER_TYPE_MAPPING`) -> what holds it here:
#: ``(cache, layer_idx, transformers' kwargs for the layer) -> layer``. Attention KV in a `CompressedLayer` (sliding
#: and chunked windows in a `SlidingWindowLayer`, as transformers' `DynamicSlidingWindowLayer` holds both),
#: recurrent / convolution states in transformers' own `LinearAttentionLayer`, both for hybrids; every other type
#: is refused at construction (`_unsupported_why`).
LAYER_FACTORIES: dict[str, Callable[[CompressedCache, int, dict], Any]] = {
    "full_attention": _attention_layer,
    "sliding_attention": _sliding_layer,
    "chunked_attention": _sliding_layer,
    "conv": _state_layer,
    "linear_attention": _state_layer,
    "hybrid": _hybrid_layer,
    "hybrid_sliding": _hybrid_sliding_layer,
    "dummy": lambda cache, layer_idx, kwargs: DummyLayer(),
}
SUPPORTED_LAYER_TYPES = tuple(LAYER_FACTORIES)


class LazyLayers(list):
    """The layers of a cache built without a model: made as attention first updates them. A model whose own code
    reads a cache layer before that (``cache.layers[i]``: one with cache layers of its own kinds) gets a reason."""

    def __getitem__(self, index):
        try:
            return super().__getitem__(index)
        except IndexError:
            raise LayerKindError(
                f"CompressedCache: the model read cache layer {index} before any update made it: a CompressedCache "
                "built without model= (or model_config=) makes its layers lazily, as attention layers, so it cannot "
                "serve a model that reads its cache layers first (one with cache layers of its own kinds). "
                + BUILD_WITH_MODEL
            ) from None


class CompressedCache(CacheFiles, Cache):
    """A KV cache that seals old tokens into compressed blocks.

    Args:
        config: what to compress and how; defaults to ``CompressionConfig()``. A transformers model config
            (``CompressedCache(config=model.config)``, as `DynamicCache` takes it) is taken as ``model_config``,
            compressed with the default ``CompressionConfig()``.
        model: the model this cache serves. Needed by predictors that rerun (part of) the model and lets the
            cache build one layer per model layer, with sliding-window layers where the model has them.
        model_config: the model's config, when the model itself is not at hand (layer types only).
        calibration: for lossless mode: a `Calibration` (or the folder one was saved to) with fitted predictor
            heads, sigma tables and marginals; ``"auto"`` (the default) takes the attached model's default
            calibration, fitting and saving it on first use (`hf_kvcompress.calibration.calibration_for`: about
            half a minute for SmolLM2-135M, with a progress bar) when something first needs it: here, if the
            in-generation predictor (``LosslessConfig.predictor``) reads one, else on the first `save` whose
            predictor reads one (or `resolve_calibration`); generation with ``"generic"`` (the default) never
            waits for it. None codes without one (per-block channel statistics). ``stats()["calibration"]`` says
            which was used, or that the lookup is still to come.

    Without ``model``/``model_config`` layers are created lazily as full-attention layers, like `DynamicCache`.
    """

    def __init__(
        self,
        config: CompressionConfig | PretrainedConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        model_config: PretrainedConfig | None = None,
        calibration: Calibration | str | Path | None = "auto",
    ):
        if isinstance(config, PretrainedConfig):  # `DynamicCache(config=model.config)`'s call: the model's layers
            if model_config is not None and model_config is not config:
                raise TypeError("CompressedCache: config is a model config and model_config another; pass the model's "
                                "config as model_config= and a CompressionConfig as config=")
            config, model_config = None, config
        if config is None:
            config = CompressionConfig()
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"CompressedCache: config must be a CompressionConfig, got {type(config).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"CompressedCache: model must be the model object (a torch.nn.Module, e.g. from "
                            f"load_model()), got {type(model).__name__} {model!r:.60}")
        if model_config is not None and not isinstance(model_config, PretrainedConfig):
            raise TypeError(f"CompressedCache: model_config must be a transformers PretrainedConfig, got "
                            f"{type(model_config).__name__}")
        if config.mode == "lossy":  # before any slow work: a query-scored method needs the model
            require_model(config.lossy, model)
        if model is not None and model_config is None:
            model_config = getattr(model, "config", None)
        self.config = config
        self.model = model
        self.model_config = model_config
        self.calibration, self.calibration_note = _resolve_calibration(calibration, model, config)
        #: True while an ``"auto"`` calibration waits for its first use (`resolve_calibration`)
        self._calibration_pending = self.calibration_note in (PENDING_NOTE, PENDING_ON_REQUEST_NOTE)
        self.lossless: LosslessCoding | None = None
        if config.mode == "lossless":
            self.lossless = coding_for(self)
        self._layer_count: int | None = None
        layers: list[Any] = []
        if model_config is not None:
            layers = self._layers_for(model_config)
            self._layer_count = len(layers)
            if self.lossless is not None:  # the codec's chain memo keeps nothing of the top layer
                self.lossless.layer_count = len(layers)
        super().__init__(layers=layers if model_config is not None else LazyLayers())
        #: ``[batch, tokens]`` ids of every cached position, recorded when a model is attached (probe/twin
        #: saves rerun the model on them); None when unknown.
        self.token_ids: torch.Tensor | None = None
        self.saw_padding = False
        self._tokens_lost = False
        self._hook = None
        #: the step (one forward) in progress: what `rollback_step` restores if it fails; None between steps
        self._step: _Step | None = None
        #: without a forward hook, the highest layer a step updates (None: not known yet): its update ends the step,
        #: so that no checkpoint outlives it (a checkpoint pins the tensors the step replaced, which `stats` omits)
        self._top_layer: int | None = None
        #: why this cache cannot continue (a failed step that had advanced recurrent states in place), or None
        self._broken: str | None = None
        if model is not None:
            self._hook = _TokenRecorder.attach(self, model)

    # ------------------------------------------------------------------ building layers

    def _layers_for(self, model_config: PretrainedConfig) -> list[Any]:
        """One layer per model layer, each what `LAYER_FACTORIES` makes of its type (every refusal first)."""
        layer_types, per_layer_kwargs = _supported_layer_types(model_config)
        return [self._new_layer(idx, layer_type, kwargs) for idx, (layer_type, kwargs)
                in enumerate(zip(layer_types, per_layer_kwargs))]

    def _new_layer(self, layer_idx: int, layer_type: str = "full_attention", kwargs: dict | None = None) -> Any:
        """The layer holding ``layer_type`` (transformers' name) at ``layer_idx`` (`LAYER_FACTORIES`)."""
        return LAYER_FACTORIES[layer_type](self, layer_idx, kwargs or {})

    def _storage_for(self, layer_idx: int) -> Storage:
        if self.lossless is not None:
            return CodedStorage(self.lossless, layer_idx)
        return RawStorage()

    # ------------------------------------------------------------------ Cache interface

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer_idx(layer_idx)
        while len(self.layers) <= layer_idx:
            self.layers.append(self._new_layer(len(self.layers)))
        if not isinstance(self.layers[layer_idx], CompressedLayer):
            raise ValueError(f"CompressedCache: layer {layer_idx} is a {type(self.layers[layer_idx]).__name__}, which "
                             "holds no attention KV; update() is for attention layers")
        if self._broken is not None:
            raise RuntimeError(self._broken)
        step = self._step
        if step is None or layer_idx <= step.last:  # the step's first update (without a model: no forward hook)
            step = self._begin_step()
        step.enter(layer_idx, self.layers[layer_idx])
        try:
            if layer_idx == 0 and self.lossless is not None:  # once per forward: the pool budget's reference
                self.lossless.sealed_raw_bytes = sealed_raw_bytes(self.kv_layers())
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            # a read of this layer's blocks failed (a damaged stream) after the layers below appended the step's
            # tokens, or this layer's own update failed after its append: put every layer back, so that a retry
            # fails the same way (or succeeds) instead of on positions one token on
            self.rollback_step()
            raise
        if self._hook is None and layer_idx >= self._top():  # no forward hook will end this step: its top layer does
            self._end_step()
        return out

    # ------------------------------------------------------------------ a failed step

    def _begin_step(self) -> _Step:
        """Open the step (one forward) that follows: what the cache holds now is what `rollback_step` restores."""
        self._end_step()  # the step before completed (without a model: nothing else says so)
        self._step = _Step(self)
        return self._step

    def _end_step(self) -> None:
        """The step completed: its checkpoints go (they would pin the K/V tensors it replaced)."""
        if self._step is not None:
            self._top_layer = max(self._top_layer or 0, self._step.last)
        self._step = None

    def _top(self) -> float:
        """The highest layer a step updates: the last K/V layer when the layers are known, else the highest one an
        earlier step updated (infinite before one completed: the first step ends when the next begins)."""
        if self._top_layer is None and self._layer_count is not None:
            self._top_layer = max((i for i, layer in enumerate(self.layers) if isinstance(layer, CompressedLayer)),
                                  default=0)
        if self._top_layer is None:
            return math.inf
        return self._top_layer

    def rollback_step(self) -> None:
        """Undo the step in progress (no-op without one): every layer it updated, the recorded token ids and the
        decoded pool back as they were before its first update. The cache calls it when an update fails, and
        after a forward of its model that raised. Recurrent and convolution states (hybrid models) are advanced in
        place by transformers' layers and cannot be put back: a cache holding them refuses to continue (a
        ``RuntimeError`` at its next update, until `reset`) rather than continue from states one step on."""
        step, self._step = self._step, None
        if step is None:
            return
        step.rollback(self)
        held = [i for i, layer in enumerate(self.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)
                and any(layer.has_previous_state.values())]
        if held:
            self._broken = (f"CompressedCache: a step failed after the recurrent / convolution states of layer(s) "
                            f"{held} may have advanced in place, which cannot be undone; continuing would use "
                            "states one step on: reset() the cache (or build a new one) and run the prompt again")

    # ------------------------------------------------------------------ recurrent states (hybrid models)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._state_layer(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._state_layer(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._state_layer(layer_idx)
        return super().get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._state_layer(layer_idx)
        return super().get_recurrent_state(layer_idx, state_idx)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        raise ValueError(
            f"CompressedCache: layer {layer_idx} of this model keeps a sparse-attention indexer key cache beside its "
            "K/V (DeepSeek V3.2-style DSA), which this cache does not hold; use transformers' DynamicCache"
        )

    def _state_layer(self, layer_idx: int) -> LinearAttentionCacheLayerMixin:
        """The layer holding ``layer_idx``'s recurrent / conv states; a clear error where the cache could not know
        the model has one (built without ``model=``, its layers are made lazily, as attention layers)."""
        self._check_layer_idx(layer_idx)
        found = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not isinstance(found, LinearAttentionCacheLayerMixin):
            raise ValueError(
                f"CompressedCache: layer {layer_idx} of this model keeps a recurrent or convolution state (a hybrid "
                "model: linear attention, mamba or conv layers), but this cache "
                + ("was built without model= (or model_config=), so its layers are made lazily as attention "
                   "layers. Build it with CompressedCache(config, model=model)."
                   if self.model_config is None else f"holds a {type(found).__name__} there.")
            )
        return found

    def build_layers(self, kinds: list[tuple[str, dict] | None]) -> None:
        """Give a cache built without a model its layers, one per model layer: ``(layer type, kwargs)`` as
        transformers names them, or None for a layer that caches nothing (`load`: the file says what each is)."""
        if self.layers:
            raise ValueError("CompressedCache.build_layers: this cache has its layers already")
        self.layers.extend(DummyLayer() if kind is None else self._new_layer(index, *kind)
                           for index, kind in enumerate(kinds))
        self._layer_count = len(kinds)
        if self.lossless is not None:
            self.lossless.layer_count = len(kinds)

    def _check_layer_idx(self, layer_idx: Any) -> None:
        check_int("CompressedCache: layer_idx", layer_idx)
        # an IndexError below, not check_int's ValueError: ``cache.layers[i]`` semantics that callers rely on
        if layer_idx < 0:
            raise IndexError(f"CompressedCache: layer_idx must be >= 0, got {layer_idx}")
        if self._layer_count is not None and layer_idx >= self._layer_count:
            raise IndexError(
                f"CompressedCache: layer_idx {layer_idx} out of range for a model with {self._layer_count} layers"
            )

    def kv_layers(self) -> list[CompressedLayer]:
        """The layers that hold K/V (skipping KV-sharing dummies)."""
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    # token ids follow every change of rows or length
    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.token_ids is not None and tokens_to_remove < 0:
            self.token_ids = owned(self.token_ids[:, :tokens_to_remove])  # a view would pin the cropped ids
        self._blocks_changed()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        index = row_index(beam_idx, self._rows(), masks=False)
        super().reorder_cache(index)
        self._select_token_rows(index)
        self._blocks_changed()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.token_ids is not None:
            self.token_ids = self.token_ids.repeat_interleave(repeats, dim=0)
        self._blocks_changed()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        index = row_index(indices, self._rows())
        super().batch_select_indices(index)
        self._select_token_rows(index)
        self._blocks_changed()

    def _blocks_changed(self) -> None:
        """Blocks were replaced or removed: decoded copies of the old ones would only pin memory (and a step's
        checkpoints would restore what was there before the change)."""
        self._step = None
        if self.lossless is not None:
            self.lossless.forget()
            self.lossless.sealed_raw_bytes = sealed_raw_bytes(self.kv_layers())

    def reset(self) -> None:
        super().reset()
        self._step = None
        self._broken = None
        self.token_ids = None
        self.saw_padding = False
        self._tokens_lost = False
        if self.lossless is not None:
            self.lossless.forget()

    def _rows(self) -> int | None:
        """Batch rows held (layers first, else the recorded token ids), None when nothing is held."""
        for layer in self.kv_layers():
            if layer.is_initialized:
                return layer.rows
        return None if self.token_ids is None else self.token_ids.shape[0]

    def _select_token_rows(self, index: torch.Tensor) -> None:
        if self.token_ids is not None:
            self.token_ids = self.token_ids.index_select(0, index)

    # ------------------------------------------------------------------ save / load: `files.CacheFiles`

    @property
    def calibration_pending(self) -> bool:
        """Whether ``calibration="auto"`` is still to be resolved (`resolve_calibration`; `calibration` is
        None until then)."""
        return self._calibration_pending

    def resolve_calibration(self, *, predictor: str | None = None) -> Calibration | None:
        """The calibration this cache uses, resolving a pending ``calibration="auto"`` first: the attached
        model's default calibration, found or fitted and saved on first use (`calibration_for`, with its
        progress bar and one printed line), or None where there is none (``stats()["calibration"]`` says why).
        Idempotent: later calls return what the first found. `save` calls it when its predictor reads a
        calibration; the in-generation predictor keeps coding as it was built (without one). ``predictor``: a
        predictor whose heads a first-use fit also fits (beside `FIRST_USE_PREDICTORS`)."""
        if self._calibration_pending:
            wanted = FIRST_USE_PREDICTORS if predictor is None or predictor not in FITTED else \
                tuple(dict.fromkeys((*FIRST_USE_PREDICTORS, predictor)))
            self.calibration, self.calibration_note = calibration_for(self.model, predictors=wanted)
            self._calibration_pending = False  # after the lookup: one interrupted midway is tried again
        return self.calibration

    def storage_calibration(self, predictors: tuple[str, ...]) -> Calibration | None:
        """The calibration calibrated storage may use (`predictors.registry.storage_predictor`): the cache's own,
        or for a pending ``calibration="auto"`` the model's saved one when it has the heads of ``predictors``
        (found, never fitted: a default save must not wait minutes for a fit; `resolve_calibration` fits)."""
        if self._calibration_pending and self.model is not None:
            found, note = calibration_for(self.model, predictors=predictors, fit=False)
            if found is not None:
                self.calibration, self.calibration_note = found, note
                self._calibration_pending = False
        return self.calibration

    def layer(self, layer_idx: int) -> CompressedLayer:
        """The `CompressedLayer` at ``layer_idx`` (a clear error where there is none)."""
        self._check_layer_idx(layer_idx)
        if layer_idx >= len(self.layers):
            raise IndexError(f"CompressedCache: layer {layer_idx} has not been created yet ({len(self.layers)} exist)")
        found = self.layers[layer_idx]
        if not isinstance(found, CompressedLayer):
            raise IndexError(f"CompressedCache: layer {layer_idx} holds no KV ({type(found).__name__})")
        return found

    # ------------------------------------------------------------------ reporting

    def stats(self, *, per_layer: bool = False) -> dict[str, Any]:
        """What this cache holds against what a `DynamicCache` in the same dtype would hold.

        Returns a dict with ``mode``, ``tokens`` (text positions seen), ``entries`` (K/V rows attention sees,
        summed over layers), ``raw_bytes``, ``stored_bytes`` (the compressed form: blocks with their headers
        and side data, residual tensors), ``held_bytes`` (every byte the cache keeps: ``stored_bytes`` plus
        decoded blocks kept between steps, the recorded token ids and whole buffers behind any view),
        ``decoded_bytes``, ``token_ids_bytes`` and ``calibration_bytes`` (the parts of it no layer holds: the
        calibration's tensors read so far), ``state_bytes`` (recurrent and convolution states of hybrid models,
        held as transformers holds them and counted in ``raw_bytes``, ``stored_bytes`` and ``held_bytes`` alike),
        ``bits_per_scalar`` (stored bits per cached K/V scalar, states left out),
        ``compression_ratio`` (raw / stored), ``dtype``, ``predictor`` (the one coding blocks in generation, as
        it really runs) and ``calibration`` (where it came from, or why there is none). ``per_layer=True`` adds
        ``per_layer``: the same numbers per layer, with each method's own (summaries, residual bytes, ...).
        """
        return cache_stats(self, per_layer=per_layer)

    def __repr__(self) -> str:
        return f"CompressedCache(mode={self.config.mode!r}, layers={len(self.layers)}, tokens={self.get_seq_length()})"


#: ``stats()["calibration"]`` of an ``"auto"`` calibration still to be resolved (`CompressedCache.resolve_calibration`):
#: the in-generation predictor reads none, the default save predictor does / does not
PENDING_NOTE = ("auto: looked up at the first save (found for calibrated storage, or fitted for a predictor named "
                "there; generation does not use one)")
PENDING_ON_REQUEST_NOTE = ("auto: found or fitted only for a save with a predictor that uses one (neither generation "
                           "nor the default save predictor does)")


def _resolve_calibration(calibration, model, config: CompressionConfig) -> tuple[Calibration | None, str]:
    """The calibration a cache uses and a note of where it came from (``stats()["calibration"]``). An ``"auto"``
    calibration that the in-generation predictor does not read is left for its first use: None and
    `PENDING_NOTE` (or `PENDING_ON_REQUEST_NOTE`), which `CompressedCache.resolve_calibration` resolves."""
    if isinstance(calibration, str) and calibration == "auto":
        if config.mode != "lossless":
            return None, "none: not used in this mode"
        settings = config.lossless
        if model is None:
            return None, "none: no model attached (pass model= to use its calibration)"
        others = not_full_attention(model.config)
        if others:
            # calibrations are fitted on models whose layers all hold every token (their heads read the layers
            # below); other structures code with per-block statistics
            return None, f"none: calibrations cover full-attention models only, this one has {others} layers"
        if not reads_calibration(settings.predictor):  # fitting one would only delay the cache's first use
            return None, PENDING_NOTE if reads_calibration(settings.save_predictor) else PENDING_ON_REQUEST_NOTE
        # the first-use heads and those of the in-generation predictor (``none`` is not among the first-use ones)
        return calibration_for(model, predictors=tuple(dict.fromkeys((*FIRST_USE_PREDICTORS, settings.predictor))))
    if calibration is None:
        return None, "none"
    if isinstance(calibration, (str, Path)):
        return Calibration.load(calibration, model), str(calibration)
    if not isinstance(calibration, Calibration):
        raise TypeError(
            "CompressedCache: calibration must be a Calibration, a folder, 'auto' or None, got "
            f"{type(calibration).__name__}"
        )
    if model is not None:
        calibration.check_model(model)
    return calibration, "given"


class _Step:
    """A step in progress: each layer as it was before the step's update of it (`CompressedLayer.checkpoint`,
    taken at its first update in the step), and the cache's recorded ids and decoded pool as they were at its
    start. References, not copies: what a step replaces is kept until the step ends."""

    def __init__(self, cache: CompressedCache):
        #: the highest layer updated in this step: an update of this layer or one below starts the next step
        self.last = -1
        self.layers: list[tuple[CompressedLayer, dict[str, Any]]] = []
        self.recorded = (cache.token_ids, cache.saw_padding, cache._tokens_lost)
        self.coding = None if cache.lossless is None else cache.lossless.checkpoint()

    def enter(self, layer_idx: int, layer: CompressedLayer) -> None:
        self.last = layer_idx
        self.layers.append((layer, layer.checkpoint()))

    def rollback(self, cache: CompressedCache) -> None:
        for layer, state in reversed(self.layers):
            layer.rollback(state)
        cache.token_ids, cache.saw_padding, cache._tokens_lost = self.recorded
        if self.coding is not None:
            cache.lossless.rollback(self.coding)


class _TokenRecorder:
    """A forward pre-hook on the model that appends the input ids of every forward pass using this cache."""

    def __init__(self, cache: CompressedCache):
        self.cache_ref = weakref.ref(cache)
        self.handle = None

    @classmethod
    def attach(cls, cache: CompressedCache, model: torch.nn.Module) -> _TokenRecorder:
        recorder = cls(cache)
        recorder.handle = model.register_forward_pre_hook(recorder, with_kwargs=True)
        # always_call: also after a forward that raised, which must leave the cache as it found it
        ended = model.register_forward_hook(recorder.ended, with_kwargs=True, always_call=True)
        weakref.finalize(cache, recorder.handle.remove)
        weakref.finalize(cache, ended.remove)
        return recorder

    def ended(self, module, args, kwargs, output):
        """After a forward: its step is complete, or (``output`` None: it raised) undone."""
        cache = self.cache_ref()
        if cache is None or kwargs.get("cache", kwargs.get("past_key_values")) is not cache:
            return None
        if output is None:
            cache.rollback_step()
        else:
            cache._end_step()
        return None

    def __call__(self, module, args, kwargs):
        cache = self.cache_ref()
        if cache is None:
            return None
        used = kwargs.get("cache", kwargs.get("past_key_values"))
        if used is not cache:
            return None
        cache._begin_step()  # before the ids are recorded: a forward that fails takes them back
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            cache.token_ids = None  # inputs_embeds: ids unknown from here on
            cache._tokens_lost = True
            return None
        if getattr(cache, "_tokens_lost", False):
            return None
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and bool((mask == 0).any()):
            cache.saw_padding = True
        ids = ids.detach().cpu()
        if cache.token_ids is not None and ids.shape[0] != cache.token_ids.shape[0]:
            raise ValueError(
                f"CompressedCache holds {cache.token_ids.shape[0]} batch row(s), this forward passes {ids.shape[0]}: "
                "a cache serves the batch it was filled with; use a new cache (or cache.reset()) for another batch"
            )
        _check_continues(cache, ids, kwargs.get("position_ids"))
        cache.token_ids = ids if cache.token_ids is None else torch.cat([cache.token_ids, ids], dim=1)
        return None


def _check_continues(cache: CompressedCache, ids: torch.Tensor, positions: Any) -> None:
    """Refuse, before the forward runs, inputs that do not continue the sequence the cache holds: what a reused
    cache gets from ``generate()`` with another prompt of at most its length (``generate`` passes the tokens past
    the cache's length, so none (transformers then fails with a raw reshape error) or positions that restart).
    A longer prompt that does not start with the cached tokens looks like a continuation from here (the forward
    sees only its tail): README "Quick start" says to use a new cache or `reset()`."""
    held = max((layer.seen_tokens for layer in cache.kv_layers()), default=0)  # positions, kept or summarised
    if not held:
        return
    advice = ("generate() continues the sequence a cache holds, so its input must be the cached tokens "
              "(cache.token_ids) followed by new ones; for another prompt use a new cache or call cache.reset()")
    if ids.shape[1] == 0:
        raise ValueError(f"CompressedCache holds {held} tokens and this forward passes none after them: {advice}")
    if cache.token_ids is None or cache.token_ids.shape[1] != held:
        return  # filled through update() (a replay, a copy): ids recorded for part of it at most, no reference
    # padded rows (recorded by the caller from this forward's mask too) start their positions later: not checked
    if isinstance(positions, torch.Tensor) and positions.ndim == 2 and positions.shape[1] and not cache.saw_padding:
        first = int(positions[0, 0])
        if first != held:
            raise ValueError(f"CompressedCache holds {held} tokens but this forward's positions start at {first}: "
                             f"its input does not continue the cached sequence; {advice}")



def _supported_layer_types(model_config: PretrainedConfig) -> tuple[list[str], list[dict]]:
    """transformers' layer types and kwargs of the model, or the construction error that says why not."""
    decoder_config = model_config.get_text_config(decoder=True)
    looped = _per_loop_caches(decoder_config)
    if looped:
        raise ValueError(
            f"CompressedCache does not support {decoder_config.model_type} with {looped}: its forward appends "
            "copies of its looped layers' caches to the cache (a KV cache per loop), beyond the one layer per "
            "model layer this cache holds. Use transformers' DynamicCache"
            + (", or recurrent_kv_cache_mode='last_loop'" if decoder_config.model_type == "dory" else "")
        )
    layer_types, per_layer_kwargs = get_layer_types_and_kwargs(decoder_config)
    for idx, layer_type in enumerate(layer_types):  # every refusal before anything is built
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise ValueError(
                f"CompressedCache does not support layer type '{layer_type}' (layer {idx} of "
                f"{decoder_config.model_type}): {_unsupported_why(layer_type)}; supported: "
                f"{list(SUPPORTED_LAYER_TYPES)}. Use transformers' DynamicCache for this model."
            )
    return layer_types, per_layer_kwargs


def _unsupported_why(layer_type: str) -> str:
    """Why a transformers layer type is refused, for the construction error."""
    if layer_type == "indexed_attention":
        return ("its layers keep a sparse-attention indexer key cache beside K/V (DeepSeek V3.2-style DSA), which "
                "this cache does not hold")
    return "its cache layer class is specific to the model and this cache has no equivalent of it"


def _per_loop_caches(config: PretrainedConfig) -> str | None:
    """The setting with which a looped model (dory, inkling2_loop) keeps one cache per loop, or None."""
    loops = getattr(config, "n_recurrent_loops", None)
    if loops and loops > 1 and getattr(config, "recurrent_kv_cache_mode", "per_loop") != "last_loop":
        return f"n_recurrent_loops={loops} and recurrent_kv_cache_mode='per_loop'"
    passes = getattr(config, "loop_num_passes", None)
    if passes and passes > 1:
        return f"loop_num_passes={passes}"
    return None
