"""`SlidingWindowLayer`: a `CompressedLayer` that keeps only what a sliding (or chunked) attention window still
reaches, as transformers' `DynamicSlidingWindowLayer` derives from `DynamicLayer`."""

from __future__ import annotations

import torch

from ..validation import check_int
from .layer import CompressedLayer
from .storage import Block, Storage, owned


class SlidingWindowLayer(CompressedLayer):
    """A sliding-window layer: attention gets the last ``sliding_window - 1`` tokens followed by the new ones (the
    same entries in the same order as on `DynamicSlidingWindowLayer`, so the same bits), `get_mask_sizes` and `crop`
    answer as there (including ``activate_past_recording``), and tokens no future query can reach are dropped:
    whole blocks, and residual tokens. ``seals=False`` never seals a block (a window too small to be worth coding:
    the layer is then a plain window, as transformers holds it; `CompressedCache` decides, docs/model_support.md
    "Sliding windows")."""

    is_sliding = True
    keeps_generated_blocks = False
    STEP_FIELDS = (*CompressedLayer.STEP_FIELDS, "window_start")

    def __init__(self, storage: Storage, *, sliding_window: int, seals: bool = True, **sizes):
        layer_idx = sizes.get("layer_idx")
        check_int(f"layer {layer_idx}: sliding_window", sliding_window, minimum=1)
        self.sliding_window = sliding_window
        self.seals = seals
        #: the first position `DynamicSlidingWindowLayer` would still hold (what ``keys`` / ``values`` show)
        self.window_start = 0
        super().__init__(storage, **sizes)

    def get_max_length(self) -> int:
        return self.sliding_window

    def reset(self) -> None:
        super().reset()
        self.window_start = 0

    def crop(self, tokens_to_remove: int) -> None:
        """As `DynamicSlidingWindowLayer`: once the window has filled, a crop needs ``activate_past_recording()``
        first, and then also trims the layer back to its window (``crop(0)`` too)."""
        if self.seen_tokens < self.sliding_window:
            super().crop(tokens_to_remove)
            return
        if not self.record_past:
            raise RuntimeError(
                "`crop` was called, but the current layer does not track past states, and the sliding window size "
                "was already reached. Call `activate_past_recording` before `crop` to be able to rollback the cache."
            )
        if tokens_to_remove > 0:
            raise RuntimeError(
                "Once the sliding window size has been reached, a sliding layer can only be cropped by passing a "
                "negative int, to specify how many tokens to remove"
            )
        self._crop_tail(-tokens_to_remove)
        self._drop_out_of_window(force=True)

    def restore(self, keys: torch.Tensor, values: torch.Tensor, seen_tokens: int) -> None:
        super().restore(keys, values, seen_tokens)
        if self.record_past:  # nothing dropped: the window shows from the first restored token on
            self.window_start = seen_tokens - keys.shape[-2]

    def adopt(self, blocks: list[Block], keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        raise ValueError(f"layer {self.layer_idx}: adopt() is for full-attention layers that seal blocks")

    def _hidden_entries(self, shown: bool = False) -> int:
        """Held rows attention no longer sees: the oldest beyond ``sliding_window - 1``; with ``shown``, those
        ``keys`` / ``values`` do not show (transformers' layer shows a recorded past until `crop`)."""
        if shown:
            return max(0, self.window_start - (self.seen_tokens - self.held_entries))
        return max(0, self.held_entries - (self.sliding_window - 1))

    def _shown_tokens(self) -> int:
        return min(self.seen_tokens, self.sliding_window - 1)

    def _drop_out_of_window(self, force: bool = False) -> None:
        """Drop what no future query can reach: whole blocks, and residual tokens once no block is left
        (``record_past`` keeps everything until `crop`, which passes ``force``)."""
        if self.record_past and not force:
            return
        # transformers keeps the last sliding_window - 1 tokens: the next query attends to those and itself
        oldest_needed = self.seen_tokens - self.sliding_window + 1
        self.window_start = max(0, oldest_needed)
        while self.blocks and self.block_starts[0] + self.blocks[0].tokens <= oldest_needed:
            self.blocks.pop(0)
            self.block_starts.pop(0)
        cut = oldest_needed - (self.seen_tokens - self.residual_length)
        if not self.blocks and cut > 0 and self.residual_keys is not None:
            # copies: a slice would keep the whole residual alive
            self.residual_keys = owned(self.residual_keys[..., cut:, :])
            self.residual_values = owned(self.residual_values[..., cut:, :])
