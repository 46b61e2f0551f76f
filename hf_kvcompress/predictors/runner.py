"""Running (part of) a transformers decoder to get hidden states and K/V: used by the probe and twin
predictors and by calibration."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence

import torch
from transformers import DynamicCache


class _StopForward(Exception):
    pass


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's list of layers (``model.model.layers`` for Llama-style models)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected `.model.layers`)")
    return layers


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
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    try:
        with torch.no_grad():
            decoder(input_ids=token_ids.to(model.device), cache=cache, use_cache=True)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return cache, captured


def build_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose decoder linear weights are rounded to float8 e4m3 with one float32 scale
    per output channel (absmax / 448), computing in the model's dtype: Finn's FP8 twin."""
    # the caches' token-recorder hooks stay with the original: a cache collected while deepcopy walks the hook
    # dicts removes its hook from them ("OrderedDict mutated during iteration")
    hooks, hooks_kwargs = model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs
    model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs = OrderedDict(), {}
    try:
        twin = copy.deepcopy(model)
    finally:
        model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs = hooks, hooks_kwargs
    for module in decoder_layers(twin).modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.data.to(torch.float32)
            scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
            rounded = (weight / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
            module.weight.data = rounded.to(module.weight.dtype)
    return twin.eval()
