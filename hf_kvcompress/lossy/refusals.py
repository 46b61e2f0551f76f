"""Which models a lossy method refuses, before any work: a query-scored method without a model, or on a model whose
attention reads other keys and values than the cached ones (an MLA latent, mixtures of attention heads)."""

from __future__ import annotations

import torch

from .budget import full_budget
from .methods import METHODS
from .settings import LossyConfig


def require_model(config: LossyConfig, model: torch.nn.Module | None) -> None:
    """Refuse a query-scored method (``needs_queries``) without a model, before any work: the cache alone never sees
    queries, and the key stand-ins lose to the query-free baselines (measured: docs/lossy.md, at the top)."""
    if model is None and METHODS[config.method].needs_queries and not full_budget(config):
        free = " or ".join(repr(name) for name, method in METHODS.items() if not method.needs_queries)
        raise ValueError(
            f"CompressedCache: lossy method {config.method!r} scores entries by the model's queries; pass the model: "
            f"CompressedCache(config, model=model). Without a model use method {free} "
            "(LossyConfig(method=...)), which need no queries"
        )
    refuse_latent_cache(config, model)


#: models whose attention reads keys and values computed from the cached ones in another layout, known by type
#: (the general check, `LossyLayer.check_reads`, sees it only at the first attention call; measured in the
#: architecture matrix, docs/results/architectures_table.md)
EXPANDED_READS = {"jetmoe": "each cached KV head once per selected attention expert (mixture of attention heads)"}


def refuse_latent_cache(config: LossyConfig, model: torch.nn.Module | None) -> None:
    """Refuse a query-scored method on a model whose cache holds an MLA latent (DeepSeek-V2/V3 style: a
    ``kv_lora_rank``-wide compressed KV as keys and the rotary key part as values, up-projected per head only after
    the cache), before any work: the queries attention scores are not in the latent's space, so neither a selection
    by their scores nor a refit against them is defined there. `LossyLayer.check_reads` refuses the same at the first
    attention call for any model whose attention reads other keys or values than the cached ones."""
    if model is None or not METHODS[config.method].needs_queries or full_budget(config):
        return
    text = model.config.get_text_config(decoder=True)
    if text.model_type in EXPANDED_READS:
        raise ValueError(
            f"lossy method {config.method!r} scores entries by the model's queries, but {text.model_type}'s attention "
            f"reads {EXPANDED_READS[text.model_type]}, not the cached entries as they are: use method 'streaming' or "
            "'svd' (LossyConfig(method=...)), or mode='lossless'"
        )
    configs = getattr(text, "per_layer_config", None) or [text]  # per-layer attributes are read per layer
    rank = next((getattr(c, "kv_lora_rank", None) for c in configs if getattr(c, "kv_lora_rank", None)), None)
    if not rank:
        return
    rope = next((getattr(c, "qk_rope_head_dim", None) for c in configs if getattr(c, "kv_lora_rank", None)), None)
    layers = getattr(text, "num_hidden_layers", None)
    where = f"layers 0..{layers - 1}" if layers else "every layer"
    raise ValueError(
        f"lossy method {config.method!r} scores entries by the model's queries, but {where} of this "
        f"{text.model_type} model cache an MLA latent (keys {rank} wide, values {rope} wide), not the per-head keys "
        "and values attention reads: use method 'streaming' or 'svd' (LossyConfig(method=...)), which keep or "
        "approximate the cached entries as they are, or mode='lossless'"
    )
