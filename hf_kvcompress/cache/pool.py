"""Decoded tensors of a lossless cache: who owns them, how long they live, and what they cost.

A lossless cache holds sealed blocks as bytes; attention needs them as tensors. Two owners keep decoded
tensors between reads, and both are counted in `CompressedCache.stats()['held_bytes']`:

- `DecodedPool`: blocks kept decoded across steps, within a byte budget (``LosslessConfig.decoded_budget``,
  a fraction of the sealed blocks' raw size). The most recent blocks win (they are the ones a crop or an
  assisted-generation rollback unseals, and recency is as good as any order for a scan that reads every
  block each step). A larger budget trades memory for fewer decodes per step.
- the chain memo of `blockcodec.BlockCodec`: predictors that read the layer(s) below need those layers' decoded
  blocks while the next layer decodes; entries are dropped as soon as no layer above can need them.

Everything stored here is an owned, compact copy (`blockcodec.flat_values`), never a view into a larger buffer.
"""

from __future__ import annotations

import torch

from ..predictors.base import LayerValues


def kv_bytes(values: LayerValues) -> int:
    """Decoded K/V bytes of ``values``: what the pool's budget counts (the per-token surprise beside them is
    ~3 % more, counted in held_bytes), so that a budget of 1.0 holds every block."""
    return sum(t.numel() * t.element_size() for t in (values.keys, values.values))


def values_tensors(values: LayerValues) -> list[torch.Tensor]:
    return [values.keys, values.values, values.surprise]


class DecodedPool:
    """Decoded blocks kept across steps within a byte budget (see module docstring)."""

    def __init__(self, fraction: float):
        self.fraction = fraction
        #: False for a budget of 0 (a pool that never keeps anything): its readers need not ask it
        self.holds = fraction > 0
        self.entries: dict[tuple[int, int], tuple[object, LayerValues, int]] = {}
        self.nbytes = 0
        #: raw bytes of every sealed block of the cache (the budget is a fraction of it); kept up to date by the cache
        self.sealed_raw_bytes = 0

    def budget(self, sealed_raw_bytes: int | None = None) -> int:
        return int(self.fraction * (self.sealed_raw_bytes if sealed_raw_bytes is None else sealed_raw_bytes))

    def get(self, block) -> LayerValues | None:
        hit = self.entries.get((block.layer, block.start))
        if hit is None:
            return None
        if hit[0] is not block:  # a stale entry: that block was replaced (rows selected, cropped, reloaded)
            self.drop(block.layer, block.start)
            return None
        return hit[1]

    def wants(self, block, values: LayerValues) -> bool:
        """Whether `offer` would keep ``values`` (so that callers copy only what is kept)."""
        if self.get(block) is values:
            return False  # already held as it is
        size = kv_bytes(values)
        budget = self.budget()
        if size > budget:
            return False
        if self.nbytes + size <= budget:
            return True
        return min((k[1], k[0]) for k in self.entries) < (block.start, block.layer)

    def offer(self, block, values: LayerValues) -> bool:
        """Keep ``values`` (already owned, flat) if the budget allows, evicting older blocks for newer ones."""
        key = (block.layer, block.start)
        self.drop(*key)
        size = kv_bytes(values)
        budget = self.budget()
        if size > budget:
            return False
        # newest first: evict the oldest entries while the newcomer does not fit and is newer than them
        while self.nbytes + size > budget:
            oldest = min(self.entries, key=lambda k: (k[1], k[0]))
            if (oldest[1], oldest[0]) >= (block.start, block.layer):
                return False
            self.drop(*oldest)
        self.entries[key] = (block, values, size)
        self.nbytes += size
        return True

    def drop(self, layer: int, start: int) -> None:
        hit = self.entries.pop((layer, start), None)
        if hit is not None:
            self.nbytes -= hit[2]

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, values, _ in self.entries.values() for t in values_tensors(values)]
