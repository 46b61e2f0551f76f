"""Capture one full-attention forward (post-RoPE Q, K, V of every layer) and replay it into any cache.

Comparing many caches on the same text needs the same prefill for each; it runs once here and every cache is
filled from the captured states: lossy layers through ``LossyLayer.replay`` (what ``generate`` does to them,
queries included), any other cache (``DynamicCache``, ``QuantizedCache``, lossless) through ``update``. The
captured queries of later positions are the held-out queries of the attention-output error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

CAPTURE_NAME = "hf_kvcompress_eval_capture"
_sink: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    _sink[module.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE_NAME, _capture_attention)
AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)


@dataclass
class Captured:
    """Per layer ``(query [b, hq, n, d], key [b, h, n, d], value [b, h, n, d])`` of one forward, its logits
    (the last ``logits_to_keep`` positions) and the attention scaling."""

    states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    logits: torch.Tensor
    scaling: float

    def slice(self, start: int, stop: int) -> Captured:
        """The states of positions ``start:stop`` (e.g. the context part of a longer capture)."""
        cut = [(q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :]) for q, k, v in self.states]
        return Captured(cut, self.logits, self.scaling)


@contextlib.contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def attention_scaling(model) -> float:
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
            return float(module.scaling)
    raise ValueError(f"{type(model).__name__}: no attention module with a 'scaling' attribute")


@torch.inference_mode()
def capture(model, input_ids: torch.Tensor, *, logits_to_keep: int = 1) -> Captured:
    """One full-attention forward over ``input_ids`` recording every layer's post-RoPE Q, K, V."""
    _sink.clear()
    try:
        with attention_implementation(model, CAPTURE_NAME):
            out = model(input_ids, logits_to_keep=logits_to_keep, use_cache=False)
        states = [_sink[i] for i in range(len(_sink))]
    finally:
        _sink.clear()
    return Captured(states, out.logits, attention_scaling(model))


@torch.inference_mode()
def replay(cache, captured: Captured):
    """Put ``cache`` in the state a forward over the captured tokens leaves it in; returns ``cache``."""
    for idx, (q, k, v) in enumerate(captured.states):
        layer = cache.layers[idx] if idx < len(cache.layers) else None
        if layer is not None and hasattr(layer, "replay"):
            layer.replay(k, v, q, captured.scaling)
        else:
            cache.update(k, v, idx)
    return cache
