"""Running (part of) a transformers decoder to get hidden states and K/V, and serving them per block
(`CacheExtras`): used by the model-running predictors (``probe``, ``twin``) and by calibration."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from .base import ExtrasSource

#: the `CacheExtras` name of the hidden state
HIDDEN = "hidden"


class _StopForward(Exception):
    pass


def decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of ``model`` (``model.model`` for Llama-style models): `get_decoder`, unless what it finds
    is not a model (ModernBERT-decoder's LM head is an attribute named ``decoder``), then `base_model`."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if not isinstance(decoder, PreTrainedModel):
        decoder = getattr(model, "base_model", model)
    return decoder


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's list of layers (``model.model.layers`` for Llama-style models)."""
    decoder = decoder_stack(model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected `.model.layers`)")
    return layers


def layer_device(model: torch.nn.Module | None, layer: int) -> torch.device:
    """The device of ``model``'s decoder layer ``layer`` (CPU without a model), where its K/V are held."""
    if model is None:
        return torch.device("cpu")
    try:
        return next(decoder_layers(model)[layer].parameters()).device
    except (StopIteration, IndexError, ValueError):
        return torch.device("cpu")


def run_decoder(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    *,
    hidden_at: Sequence[int] = (),
    stop_after: int | None = None,
) -> tuple[DynamicCache, dict[int, torch.Tensor]]:
    """Run the decoder on ``token_ids`` ``[batch, tokens]`` (one forward, positions from 0).

    Returns the `DynamicCache` it filled and the hidden states entering layers ``hidden_at`` (``[batch,
    tokens, hidden]``, float32; index ``num_layers`` is the last layer's output before the final norm).
    ``stop_after=k`` stops once layer ``k - 1`` has run, so only layers ``0..k-1`` cost anything.
    """
    layers = decoder_layers(model)
    wanted = set(hidden_at)
    if stop_after is not None:
        wanted.add(stop_after)
    if any(k < 1 or k > len(layers) for k in wanted):
        raise ValueError(f"hidden states exist for layers 1..{len(layers)}, asked for {sorted(wanted)}")
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for k in sorted(wanted):

        def hook(module, args, output, k=k):
            hidden = output[0] if isinstance(output, tuple) else output
            captured[k] = hidden.detach().to(torch.float32)
            if k == stop_after:
                raise _StopForward

        handles.append(layers[k - 1].register_forward_hook(hook))
    cache = DynamicCache()
    try:
        _forward(model, token_ids, cache)
    finally:
        for handle in handles:
            handle.remove()
    return cache, captured


def _forward(model: torch.nn.Module, token_ids: torch.Tensor, cache: DynamicCache) -> None:
    """One forward of the decoder over ``token_ids`` into ``cache``, which a hook or the cache may end early
    (`_StopForward`)."""
    decoder = decoder_stack(model)
    try:
        with torch.no_grad():
            decoder(input_ids=token_ids.to(model.device), cache=cache, use_cache=True)
    except _StopForward:
        pass


class _FirstKV(DynamicCache):
    """A cache that stops the forward at the first K/V it is handed: the first attention layer's keys (after
    its norm and RoPE, as a cache holds them) and values, what `first_kv` returns."""

    def __init__(self, config):
        super().__init__(config=config)
        self.captured: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.captured = (layer_idx, key_states.detach(), value_states.detach())
        raise _StopForward


def first_kv(model: torch.nn.Module, token_ids: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """The keys and values the first K/V-holding layer computes for ``token_ids`` ``[batch, tokens]`` (positions
    from 0): ``(layer index, keys [batch, kv heads, tokens, head dim], values [batch, kv heads, tokens, value
    dim])``, as that layer hands them to the cache, or None when no layer hands its K/V to the cache. Only the
    layers up to that one run (the embeddings and, for Llama-style models, one K and one V projection): any
    decoder transformers runs, through its own forward (norms, RoPE variants, embedding scales)."""
    cache = _FirstKV(model.config.get_text_config(decoder=True))
    _forward(model, token_ids, cache)
    return cache.captured


class CacheExtras(ExtrasSource):
    """Extras cut out of per-layer ``[batch, heads, tokens, dim]`` K/V and a ``[batch, tokens, hidden]``
    hidden state computed for the whole sequence (``hidden`` is the extra named `HIDDEN`)."""

    def __init__(self, layers: dict[int, dict[str, torch.Tensor]], hidden: torch.Tensor | None = None):
        self.layers = layers
        self.hidden = hidden

    def extras(self, layer: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {name: t[:, :, start:stop] for name, t in self.layers.get(layer, {}).items()}
        if self.hidden is not None:
            out[HIDDEN] = self.hidden[:, start:stop]
        return out
