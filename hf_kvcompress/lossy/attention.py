"""The attention function lossy mode installs on an attached model.

Why a custom attention function (registered with transformers' ``AttentionInterface``) rather than hooks:
- it receives the post-RoPE queries exactly as attention uses them, for any model that follows the functional
  attention API (no per-architecture re-implementation of q_proj/q_norm/RoPE);
- it runs right after the layer's ``cache.update``, so a summary that is due can be fitted on the queries of the
  very forward pass that filled the cache (a long prefill is summarised before ``generate`` takes its next step);
- it can add per-entry logit biases (fitted summary weights, ``-inf`` for padding) and build the mask of the held
  entries itself, so layers may hold different numbers of entries and left padding stays correct.

With no lossy layer active for the call (another cache, or no cache), it simply calls the model's original
implementation, so the attached model keeps working as before.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

if TYPE_CHECKING:
    from .layer import LossyLayer

ATTENTION_NAME = "hf_kvcompress_lossy"
INNER_ATTRIBUTE = "_hf_kvcompress_inner_attention"
SUPPORTED_INNER = ("sdpa", "eager")

_local = threading.local()
_registered = False


def _active() -> dict[int, LossyLayer]:
    if not hasattr(_local, "layers"):
        _local.layers = {}
    return _local.layers


def set_active(layer_idx: int, layer: LossyLayer) -> None:
    """Called by `LossyLayer.update`: the next attention call of ``layer_idx`` in this thread belongs to ``layer``."""
    _active()[layer_idx] = layer


def take_active(layer_idx: int) -> LossyLayer | None:
    return _active().pop(layer_idx, None)


def register() -> None:
    """Register the attention function and its mask builder with transformers (once per process)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, lossy_attention)
        # transformers builds the mask by implementation name; ours needs sdpa's boolean mask (it only reads the
        # columns of the new tokens and builds the held entries' part itself)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True


def attach(model: torch.nn.Module) -> None:
    """Switch ``model`` to the lossy attention function (idempotent). Its previous implementation (sdpa or eager)
    keeps doing the actual attention."""
    register()
    config = model.config
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    if current == ATTENTION_NAME:
        return
    if current not in SUPPORTED_INNER:
        raise ValueError(
            f"lossy mode needs the model's attention implementation to be one of {list(SUPPORTED_INNER)} (it adds "
            f"per-entry biases through a float mask); this model uses {current!r}. Load it with "
            "attn_implementation='sdpa'."
        )
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            setattr(module, INNER_ATTRIBUTE, current)
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise ValueError(f"could not switch {type(model).__name__} to the lossy attention function")


def detach(model: torch.nn.Module) -> None:
    """Give ``model`` its original attention implementation back."""
    inner = next((getattr(m, INNER_ATTRIBUTE) for m in model.modules() if hasattr(m, INNER_ATTRIBUTE)), None)
    if inner is not None and model.config._attn_implementation == ATTENTION_NAME:
        model.set_attn_implementation(inner)


def _inner_function(module: torch.nn.Module):
    name = getattr(module, INNER_ATTRIBUTE, "sdpa")
    if name == "eager":
        # each modeling file defines its own eager function; use the one of the module's model
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def lossy_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    inner = _inner_function(module)
    layer = take_active(getattr(module, "layer_idx", -1))
    if layer is None or not layer.expects(query, key):
        return inner(module, query, key, value, attention_mask, **kwargs)
    mask = layer.attention_mask(query, key.shape[-2], attention_mask)
    if mask is not None and mask.dtype != torch.bool:
        # the float mask replaces sdpa's causal shortcut: tell it the mask is complete
        kwargs["is_causal"] = False
    output = inner(module, query, key, value, mask, **kwargs)
    layer.observe(query, getattr(module, "scaling", None))
    return output
