"""The attention function lossy mode installs on an attached model.

Why a custom attention function (registered with transformers' ``AttentionInterface``) rather than hooks:
- it receives the post-RoPE queries exactly as attention uses them, for any model that follows the functional
  attention API (no per-architecture re-implementation of q_proj/q_norm/RoPE);
- it runs right after the layer's ``cache.update``, so a summary that is due can be fitted on the queries of the
  very forward pass that filled the cache (a long prefill is summarised before ``generate`` takes its next step);
- it can add per-entry logit biases (fitted summary weights, ``-inf`` for padding) and build the mask of the held
  entries itself, so layers may hold different numbers of entries and left padding stays correct.

With no lossy layer active for the call (another cache, or no cache), it calls the model's original
implementation with transformers' mask converted to the form that implementation expects (sdpa takes the boolean
mask or ``None``; eager adds the mask to its logits, so it gets an additive float mask), so the attached model keeps
working as before.

The switch is undone (`detach`) when the last lossy layer using the model is garbage-collected (every lossy cache
built with ``model=`` released), or at once by calling `detach` (a lossy cache still using the model then refuses
further updates).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION_NAME = "hf_kvcompress_lossy"
INNER_ATTRIBUTE = "_hf_kvcompress_inner_attention"
#: per attached model: [generation, live lossy layers] (``detach`` starts a new generation)
USERS_ATTRIBUTE = "_hf_kvcompress_lossy_users"
SUPPORTED_INNER = ("sdpa", "eager")



class ActiveLayer(Protocol):
    """What this attention function asks of the cache layer whose update precedes it (`LossyLayer`): a protocol,
    so that this module does not import the layer that imports it."""

    layer_idx: int
    rows: int
    #: keys the last update prepared for attention (-1 before the first)
    expected_kv: int

    def expects(self, query: torch.Tensor, key: torch.Tensor) -> bool: ...

    def check_reads(self, key: torch.Tensor, value: torch.Tensor) -> None: ...

    def attention_mask(self, query: torch.Tensor, kv_length: int, mask: torch.Tensor | None, *,
                       additive: bool = False) -> torch.Tensor | None: ...

    def observe(self, query: torch.Tensor, scaling: float | None) -> None: ...


_local = threading.local()
_registered = False


def _active() -> dict[int, ActiveLayer]:
    if not hasattr(_local, "layers"):
        _local.layers = {}
    return _local.layers


def set_active(layer_idx: int, layer: ActiveLayer) -> None:
    """Called by `LossyLayer.update`: the next attention call of ``layer_idx`` in this thread belongs to ``layer``
    (held weakly: a registration whose attention never ran must not keep a released cache alive)."""
    _active()[layer_idx] = weakref.ref(layer)


def take_active(layer_idx: int) -> ActiveLayer | None:
    ref = _active().pop(layer_idx, None)
    return None if ref is None else ref()


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
        # any module may call the attention function (o_proj / out_proj / dense attention, block-attention
        # residuals without a layer index, ...): each finds the implementation to run underneath
        setattr(module, INNER_ATTRIBUTE, current)
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise ValueError(f"could not switch {type(model).__name__} to the lossy attention function")


def detach(model: torch.nn.Module) -> None:
    """Give ``model`` its original attention implementation back now. Lossy caches built on it refuse further
    updates (their summaries need the lossy attention function)."""
    inner = next((getattr(m, INNER_ATTRIBUTE) for m in model.modules() if hasattr(m, INNER_ATTRIBUTE)), None)
    if inner is not None and model.config._attn_implementation == ATTENTION_NAME:
        model.set_attn_implementation(inner)
    users = getattr(model, USERS_ATTRIBUTE, None)
    if users is not None:
        users[0] += 1  # layers acquired before this detach no longer count
        users[1] = 0


def is_attached(model: torch.nn.Module) -> bool:
    """Whether ``model`` currently runs the lossy attention function."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME


def acquire(model: torch.nn.Module) -> int:
    """`attach` ``model`` for one more lossy layer; returns the generation to hand to `release`."""
    attach(model)
    users = getattr(model, USERS_ATTRIBUTE, None)
    if users is None:
        users = [0, 0]
        setattr(model, USERS_ATTRIBUTE, users)
    users[1] += 1
    return users[0]


def release(model_ref: weakref.ref, generation: int) -> None:
    """One lossy layer of ``model`` is gone; the last one of its generation detaches the model."""
    model = model_ref()
    users = None if model is None else getattr(model, USERS_ATTRIBUTE, None)
    if users is None or users[0] != generation:
        return
    users[1] -= 1
    if users[1] <= 0:
        detach(model)


def _inner_name(module: torch.nn.Module) -> str:
    name = getattr(module, INNER_ATTRIBUTE, None)
    if name not in SUPPORTED_INNER:
        raise RuntimeError(
            f"lossy attention called from {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}), which "
            "attach() did not prepare: attach the model again (build a CompressedCache with model=...)"
        )
    return name


def _inner_function(module: torch.nn.Module, name: str):
    if name == "eager":
        # each modeling file defines its own eager function; use the one of the module's model
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def inner_mask(
    name: str, mask: torch.Tensor | None, query: torch.Tensor, kv_length: int
) -> torch.Tensor | None:
    """transformers' sdpa-style mask (``None`` = causal, or bool, True = attend) in the form the inner
    implementation ``name`` expects: unchanged for sdpa, an additive float mask for eager (which adds the mask to
    its logits, so ``None`` or a bool mask there would drop causality)."""
    if name != "eager" or (mask is not None and mask.dtype != torch.bool):
        return mask
    q = query.shape[-2]
    if mask is None:
        # sdpa_mask returns None only for a causal mask with nothing else to hide; the new tokens are the last q
        # of kv_length entries (bottom-right aligned)
        mask = torch.ones(q, kv_length, dtype=torch.bool, device=query.device).tril(diagonal=kv_length - q)[None, None]
    low = torch.finfo(query.dtype).min
    return torch.where(mask, 0.0, low).to(query.dtype)


def lossy_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    name = _inner_name(module)
    inner = _inner_function(module, name)
    layer = take_active(getattr(module, "layer_idx", -1))
    if layer is None:  # another cache (or none) on the attached model, or attention that reads no cache
        if attention_mask is None and not getattr(module, "is_causal", True):
            # a non-causal module's None means no mask at all (inkling2's block-attention residuals), not sdpa's
            # causal shortcut
            return inner(module, query, key, value, None, **kwargs)
        return inner(module, query, key, value, inner_mask(name, attention_mask, query, key.shape[-2]), **kwargs)
    if not layer.expects(query, key):
        raise RuntimeError(
            f"lossy attention, layer {layer.layer_idx}: got {key.shape[-2]} keys for {query.shape[0]} rows, but the "
            f"cache's last update prepared {layer.expected_kv} keys for {layer.rows} rows (an update whose attention "
            "never ran, or two caches interleaved on one model); its biases and padding mask would be lost"
        )
    layer.check_reads(key, value)
    mask = layer.attention_mask(query, key.shape[-2], attention_mask, additive=name == "eager")
    if mask is not None and mask.dtype != torch.bool:
        # the float mask replaces sdpa's causal shortcut: tell it the mask is complete
        kwargs["is_causal"] = False
    output = inner(module, query, key, value, mask, **kwargs)
    layer.observe(query, getattr(module, "scaling", None))
    return output
