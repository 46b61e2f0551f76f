"""`CompressedCache.stats()`: what a cache holds against what a `DynamicCache` in the same dtype would hold, summed
from its layers' own stats plus what no layer holds (decoded blocks, token ids, the calibration's tensors and the
marginals its codec reads)."""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..layer import CompressedLayer
from ..layer.hybrid import state_bytes
from ..layer.storage import storage_bytes


def cache_stats(cache: Any, *, per_layer: bool = False) -> dict[str, Any]:
    """`CompressedCache.stats` of ``cache`` (its docstring lists the keys; typed Any: this module is imported by
    cache.py, so it does not import the class)."""
    layers = [{"layer": idx, **layer.stats()} for idx, layer in enumerate(cache.layers)
              if isinstance(layer, CompressedLayer)]
    for idx, layer in enumerate(cache.layers):  # recurrent / conv states only: held as transformers holds them
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CompressedLayer):
            layers.append({"layer": idx, "tokens": 0, "entries": 0, "raw_bytes": 0, "stored_bytes": 0,
                           "scalars": 0, "held_bytes": state_bytes(layer), "residual_bytes": 0,
                           "state_bytes": state_bytes(layer)})
    layers.sort(key=lambda s: s["layer"])
    states = sum(s.get("state_bytes", 0) for s in layers)
    raw = sum(s["raw_bytes"] for s in layers) + states
    kv_stored = sum(s["stored_bytes"] for s in layers)
    stored = kv_stored + states
    scalars = sum(s["scalars"] for s in layers)
    decoded = (storage_bytes(cache.lossless.decoded_tensors()) + cache.lossless.ahead_bytes()
               if cache.lossless is not None else 0)
    ids = storage_bytes([cache.token_ids]) if cache.token_ids is not None else 0
    calibration = calibration_bytes(cache)
    dtypes = {str(layer.dtype).replace("torch.", "") for layer in cache.layers if getattr(layer, "dtype", None)}
    summary = {
        "mode": cache.config.mode,
        "tokens": max((s["tokens"] for s in layers), default=0),
        "entries": sum(s["entries"] for s in layers),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "held_bytes": sum(s.get("held_bytes", s["stored_bytes"]) for s in layers) + decoded + ids + calibration,
        "decoded_bytes": decoded,
        "token_ids_bytes": ids,
        "calibration_bytes": calibration,
        "state_bytes": states,
        "bits_per_scalar": 8.0 * kv_stored / scalars if scalars else 0.0,
        "compression_ratio": raw / stored if stored else 1.0,
        "dtype": ",".join(sorted(dtypes)) or None,
        "predictor": predictor_in_use(cache),
        "calibration": cache.calibration_note,
    }
    if per_layer:
        summary["per_layer"] = layers
    return summary


def calibration_bytes(cache: Any) -> int:
    """The calibration's tensors in memory now, and the marginals the cache's codec views (the same storages while
    the calibration holds them; alone once it released them): each storage once."""
    tensors = cache.calibration.loaded_tensors() if cache.calibration is not None else []
    if cache.lossless is not None:
        tensors = tensors + cache.lossless.marginal_tensors()
    return storage_bytes(tensors)


def predictor_in_use(cache: Any) -> str | None:
    """The predictor coding blocks in generation, as it really runs."""
    if cache.lossless is None:
        return None
    predictor = cache.lossless.predictor
    if predictor.calibrated or not predictor.fitted_by_calibration:
        return predictor.name
    return f"{predictor.name} without a calibration (per-block statistics, as 'generic')"
