"""Layers that hold a recurrent state beside their attention KV (transformers' ``"hybrid"`` / ``"hybrid_sliding"``
layer types: falcon_h1 runs a mamba mixer and attention in one layer).

The recurrent and convolution states are transformers' own `LinearAttentionLayer` code, untouched (they are small,
of fixed size, and every update rewrites them whole: nothing there to seal or code); the attention KV is the
compressed layer's. This follows transformers' `LinearAttentionAndFullAttentionLayer`: one class per pair, each
call sent to the part it concerns. Pure linear-attention / conv layers are held by `LinearAttentionLayer` itself.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from .layer import CompressedLayer
from .sliding import SlidingWindowLayer
from .storage import Storage, storage_bytes


def state_tensors(layer: LinearAttentionCacheLayerMixin) -> list[torch.Tensor]:
    """The conv and recurrent state tensors a linear-attention (or hybrid) layer holds now."""
    out = []
    for states in (layer.conv_states, layer.recurrent_states):
        out.extend(t for t in states.values() if isinstance(t, torch.Tensor))
    return out


def states_outside_cache(layers: list, model: torch.nn.Module | None) -> str | None:
    """After a forward into a cache of ``layers``, the first linear-attention layer whose state the model keeps in its
    own modules (RecurrentGemma), said as the refusals of `CompressedCache.save` and `PrefixStore` say it; None when
    every such layer holds its state. Such a layer's states are never updated, so neither a file nor a chunk can hold
    them, and a cache continued from one would start from a wrong state."""
    for index, layer in enumerate(layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not state_tensors(layer):
            name = type(model).__name__ if model is not None else "this model"
            return (f"layer {index} is a linear-attention layer whose state the model keeps in its own modules, not "
                    f"in the cache ({name})")
    return None


def state_bytes(layer: LinearAttentionCacheLayerMixin) -> int:
    """Bytes behind those tensors (whole buffers: a recorded past may hold a grown conv state), behind the
    layer's token counter where transformers keeps one as a tensor (``cumulative_length_linear``, 5.25+), and
    behind the recurrent states' history a recorded past keeps (``recurrent_states_history``, 5.25+; its lists
    may be one shared list, each storage is counted once)."""
    counter = getattr(layer, "cumulative_length_linear", None)
    history = getattr(layer, "recurrent_states_history", None) or {}
    kept = [t for states in history.values() for t in states if isinstance(t, torch.Tensor)]
    return storage_bytes(state_tensors(layer) + ([counter] if isinstance(counter, torch.Tensor) else []) + kept)


class RecurrentStateMixin(LinearAttentionLayer):
    """The linear-attention half of a hybrid layer; the attention half is the class that follows it in the MRO
    (a `CompressedLayer` or one of its subclasses), reached with ``super(LinearAttentionCacheLayerMixin, self)``."""

    keeps_generated_blocks = False  # the recurrent state is held beside the blocks

    def _init_states(self, number_of_states: int) -> None:
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def _attention(self):
        return super(LinearAttentionCacheLayerMixin, self)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # as transformers' hybrid layers: attention's `update` passes (keys, values), the state updates keywords
        if len(args) == 2 and not kwargs:
            self._attention().lazy_initialization(*args)
        elif not args:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        # the attention half's tokens, as transformers' hybrid layers count them: the states' counter
        # (``cumulative_length_linear``) has already counted a forward's tokens when its attention asks for the query
        # offset (Inkling's convolutions update before its attention reads `Cache.get_query_offset`)
        return self._attention().get_seq_length()

    def reset(self) -> None:
        if hasattr(self, "number_of_states"):  # the attention half's __init__ resets before the states exist
            LinearAttentionLayer.reset(self)
        self._attention().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        self._attention().reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        self._attention().crop(tokens_to_remove)

    def offload(self) -> None:
        LinearAttentionLayer.offload(self)
        self._attention().offload()

    def prefetch(self) -> None:
        LinearAttentionLayer.prefetch(self)
        self._attention().prefetch()

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        # one flag for both halves, as on transformers' hybrid layers; the states' history as transformers keeps it
        # (5.25+: without it a recorded prefill of zamba / zaya failed on a missing `recurrent_states_history`)
        LinearAttentionCacheLayerMixin.activate_past_recording(self, recurrent_states_to_keep)

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return LinearAttentionLayer.is_croppable.fget(self) and all(block.exact for block in self.blocks)

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False

    def stats(self) -> dict[str, int]:
        found = self._attention().stats()
        states = state_bytes(self)
        found["state_bytes"] = states
        found["held_bytes"] += states
        return found

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._attention().__repr__()}, states={self.number_of_states})"


class CompressedHybridLayer(RecurrentStateMixin, CompressedLayer):
    """A ``hybrid`` layer: transformers' recurrent states beside a `CompressedLayer`'s KV."""

    def __init__(self, storage: Storage, *, number_of_states: int = 1, **kwargs):
        CompressedLayer.__init__(self, storage, **kwargs)
        self._init_states(number_of_states)


class SlidingHybridLayer(RecurrentStateMixin, SlidingWindowLayer):
    """A ``hybrid_sliding`` layer: transformers' recurrent states beside a `SlidingWindowLayer`'s KV."""

    def __init__(self, storage: Storage, *, number_of_states: int = 1, **kwargs):
        SlidingWindowLayer.__init__(self, storage, **kwargs)
        self._init_states(number_of_states)
