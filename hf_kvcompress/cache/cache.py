"""`CompressedCache`: the `transformers.Cache` users pass to `generate()`."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DummyLayer, get_layer_types_and_kwargs

from ..config import CompressionConfig
from .layer import CompressedLayer
from .storage import RawStorage, Storage

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "dummy")


class CompressedCache(Cache):
    """A KV cache that seals old tokens into compressed blocks.

    Args:
        config: what to compress and how; defaults to ``CompressionConfig()``.
        model: the model this cache serves. Needed by predictors that rerun (part of) the model and lets the
            cache build one layer per model layer, with sliding-window layers where the model has them.
        model_config: the model's config, when the model itself is not at hand (layer types only).

    Without ``model``/``model_config`` layers are created lazily as full-attention layers, like `DynamicCache`.
    """

    def __init__(
        self,
        config: CompressionConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        model_config: PretrainedConfig | None = None,
    ):
        if config is None:
            config = CompressionConfig()
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"CompressedCache: config must be a CompressionConfig, got {type(config).__name__}")
        if model is not None and model_config is None:
            model_config = getattr(model, "config", None)
        self.config = config
        self.model = model
        self.model_config = model_config
        self._layer_count: int | None = None
        layers: list[Any] = []
        if model_config is not None:
            layers = self._layers_for(model_config)
            self._layer_count = len(layers)
        super().__init__(layers=layers)

    # ------------------------------------------------------------------ building layers

    def _layers_for(self, model_config: PretrainedConfig) -> list[Any]:
        decoder_config = model_config.get_text_config(decoder=True)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(decoder_config)
        layers: list[Any] = []
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, per_layer_kwargs)):
            if layer_type not in SUPPORTED_LAYER_TYPES:
                raise ValueError(
                    f"CompressedCache does not support layer type '{layer_type}' (layer {idx} of "
                    f"{decoder_config.model_type}); supported: {list(SUPPORTED_LAYER_TYPES)}"
                )
            if layer_type == "dummy":
                layers.append(DummyLayer())
            else:
                layers.append(self._new_layer(idx, sliding_window=kwargs.get("sliding_window")))
        return layers

    def _new_layer(self, layer_idx: int, sliding_window: int | None = None) -> CompressedLayer:
        if self.config.mode == "lossy":
            from ..lossy.layer import LossyLayer

            return LossyLayer(self, layer_idx=layer_idx, sliding_window=sliding_window)
        return CompressedLayer(
            self._storage_for(layer_idx),
            block_tokens=self.config.block_tokens,
            residual_tokens=self.config.residual_tokens,
            sliding_window=sliding_window,
            layer_idx=layer_idx,
        )

    def _storage_for(self, layer_idx: int) -> Storage:
        if self.config.mode == "none":
            return RawStorage()
        raise ValueError(f"CompressedCache: mode '{self.config.mode}' is not available in this build")

    # ------------------------------------------------------------------ Cache interface

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer_idx(layer_idx)
        while len(self.layers) <= layer_idx:
            self.layers.append(self._new_layer(len(self.layers)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_layer_idx(self, layer_idx: Any) -> None:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"CompressedCache: layer_idx must be an int, got {type(layer_idx).__name__}")
        if layer_idx < 0:
            raise IndexError(f"CompressedCache: layer_idx must be >= 0, got {layer_idx}")
        if self._layer_count is not None and layer_idx >= self._layer_count:
            raise IndexError(
                f"CompressedCache: layer_idx {layer_idx} out of range for a model with {self._layer_count} layers"
            )

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

    def stats(self) -> dict[str, Any]:
        """What this cache holds against what a `DynamicCache` in the same dtype would hold.

        Returns a dict with ``mode``, ``tokens`` (text positions seen), ``entries`` (K/V rows attention sees,
        summed over layers), ``raw_bytes``, ``stored_bytes`` (everything really held: blocks with their headers
        and side data, residual tensors), ``bits_per_scalar`` (stored bits per cached K/V scalar),
        ``compression_ratio`` (raw / stored), ``dtype`` and ``per_layer`` (the same numbers per layer).
        """
        per_layer = []
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, CompressedLayer):
                per_layer.append({"layer": idx, **layer.stats()})
        raw = sum(s["raw_bytes"] for s in per_layer)
        stored = sum(s["stored_bytes"] for s in per_layer)
        scalars = sum(s["scalars"] for s in per_layer)
        dtypes = {str(layer.dtype).replace("torch.", "") for layer in self.layers if getattr(layer, "dtype", None)}
        return {
            "mode": self.config.mode,
            "tokens": max((s["tokens"] for s in per_layer), default=0),
            "entries": sum(s["entries"] for s in per_layer),
            "raw_bytes": raw,
            "stored_bytes": stored,
            "bits_per_scalar": 8.0 * stored / scalars if scalars else 0.0,
            "compression_ratio": raw / stored if stored else 1.0,
            "dtype": ",".join(sorted(dtypes)) or None,
            "per_layer": per_layer,
        }

    def __repr__(self) -> str:
        return f"CompressedCache(mode={self.config.mode!r}, layers={len(self.layers)}, tokens={self.get_seq_length()})"
