"""Assembling lossless mode for a cache: the predictor its config names, codec settings, marginals."""

from __future__ import annotations

import functools

from transformers.cache_utils import get_layer_types_and_kwargs

from ..predictors import make_predictor
from .coded import CodedBlock, LosslessContext


def lossless_context(cache) -> LosslessContext:
    """The `LosslessContext` of ``cache`` (a `CompressedCache` in lossless mode)."""
    settings = cache.config.lossless
    predictor = make_predictor(
        settings.predictor, calibration=cache.calibration, model=cache.model, probe_layer=settings.probe_layer
    )
    # model-running predictors (probe, twin) never get here: LosslessConfig refuses them for generation
    _check_layer_chain(cache, predictor)
    codec = settings.codec_config()
    marginals = None
    if cache.calibration is not None and getattr(predictor, "calibrated", False):
        # only a calibrated predictor reads the calibration in generation (the marginals gain 0.001 bit/scalar
        # for `generic`: not worth holding them); `save` reads what it needs then
        marginals = functools.lru_cache(maxsize=None)(cache.calibration.marginal)
    context = LosslessContext(predictor, codec, functools.partial(find_block, cache), marginals, settings.workers,
                              decoded_budget=settings.decoded_budget, layer_count=lambda: cache.kv_layer_count)
    context.blocks_of = functools.partial(layer_blocks, cache)
    return context


def layer_blocks(cache, layer: int) -> list:
    """The sealed blocks of ``cache``'s layer ``layer`` (empty if it holds none or does not exist)."""
    if layer < 0 or layer >= len(cache.layers):
        return []
    return list(getattr(cache.layers[layer], "blocks", ()))


def find_block(cache, layer: int, start: int):
    """The sealed block of ``cache``'s layer ``layer`` that starts at text position ``start``, if any."""
    if layer < 0 or layer >= len(cache.layers):
        return None
    held = cache.layers[layer]
    for block, block_start in zip(getattr(held, "blocks", ()), getattr(held, "block_starts", ())):
        if block_start == start:
            return block
    return None


def _check_layer_chain(cache, predictor) -> None:
    """Predictors that read the layer below need every layer to keep its blocks (no sliding windows)."""
    uses_below = predictor.below_depth() > 0
    config = cache.model_config
    if not uses_below or config is None:
        return
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"lossless predictor '{predictor.name}' reads the layer below, but this model has "
            f"{sorted(set(layer_types) - {'full_attention'})} layers that drop old tokens; use predictor 'none' "
            "or no calibration (per-block statistics) for it"
        )


def sealed_raw_bytes(cache) -> int:
    """Raw (uncompressed) bytes of every sealed block of ``cache``: what the decoded pool's budget scales."""
    total = 0
    for layer in cache.kv_layers():
        for block in layer.blocks:
            if isinstance(block, CodedBlock):
                total += len(block.rows) * block.heads * block.tokens * (block.dim + block.value_dim) * \
                    block.dtype.itemsize
    return total
