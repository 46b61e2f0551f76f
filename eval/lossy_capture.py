"""Capture one full-cache forward pass (post-RoPE Q, K, V of every layer) and replay it into lossy caches.

Experiments compare many lossy configurations on the same text. The prefill is the same for all of them (lossy
mode runs the prefill with full attention and summarises right after it), so it runs once here, and each lossy
cache is filled from the captured states through `LossyLayer.replay`, the same code path ``generate`` takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_kvcompress import CompressedCache, CompressionConfig

CAPTURE_NAME = "hf_kvcompress_capture"
_sink: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    _sink[module.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE_NAME, _capture_attention)
AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)


@dataclass
class Captured:
    """Per layer ``(query [b, hq, n, d], key [b, h, n, d], value [b, h, n, d])`` of one forward, plus its logits."""

    states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    logits: torch.Tensor
    scaling: float

    def slice(self, start: int, stop: int) -> Captured:
        """The states of positions ``start:stop`` (e.g. the context part of a longer capture)."""
        cut = [(q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :]) for q, k, v in self.states]
        return Captured(cut, self.logits, self.scaling)


@contextlib.contextmanager
def _implementation(model, name: str) -> Iterator[None]:
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.inference_mode()
def capture(model, input_ids: torch.Tensor, *, logits_to_keep: int = 1) -> Captured:
    """One full-attention forward over ``input_ids`` recording every layer's post-RoPE Q, K, V."""
    _sink.clear()
    with _implementation(model, CAPTURE_NAME):
        out = model(input_ids, logits_to_keep=logits_to_keep, use_cache=False)
    layers = len(_sink)
    states = [_sink[i] for i in range(layers)]
    _sink.clear()
    scaling = float(model.model.layers[0].self_attn.scaling)
    return Captured(states, out.logits, scaling)


def replayed_cache(model, config: CompressionConfig, captured: Captured) -> CompressedCache:
    """A `CompressedCache` for ``model`` in the state ``generate`` leaves it in after prefilling ``captured``."""
    cache = CompressedCache(config, model=model)
    with torch.inference_mode():
        for layer, (q, k, v) in zip(cache.layers, captured.states):
            if hasattr(layer, "replay"):
                layer.replay(k, v, q, captured.scaling)
            else:
                layer.update(k, v)
    return cache
