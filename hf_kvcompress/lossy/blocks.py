"""Blocks a lossy layer holds: kept/synthetic entries with optional per-entry biases, and low-rank factors."""

from __future__ import annotations

import torch

from ..layer.storage import Block, tensor_nbytes
from .packed import MIXED_TIERS, Packed, Split, pack, unpack

Values = torch.Tensor | Packed | Split | tuple[torch.Tensor, torch.Tensor]


class LossyBlock(Block):
    """Entries attention sees as they are, plus an optional additive logit bias per entry.

    ``values`` is a tensor, or low-rank factors ``(U, W)`` with ``V = U @ W`` (``[b, h, n, r]``, ``[b, h, r, d]``).
    ``keys`` and tensor ``values`` may be `Packed` or `Split` (quantized codes with side data per vector, see
    `packed`).
    ``bias`` (``[batch, kv_heads, entries]``, cache dtype) is added to the attention logits of its entries: a
    fitted log-weight for summary entries, ``-inf`` for entries that must be ignored (padding of a shorter row).
    ``None`` means all zeros and costs nothing.
    """

    exact = False

    def __init__(self, keys: torch.Tensor | Packed | Split, values: Values, bias: torch.Tensor | None, *, tokens: int):
        self.keys = keys
        self.values = values
        self.bias = bias
        self.entries = keys.shape[-2]
        self.tokens = tokens

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.values, tuple):
            return unpack(self.keys), self.values[0] @ self.values[1]
        return unpack(self.keys), unpack(self.values)

    def read_bias(self) -> torch.Tensor | None:
        """Per-entry logit bias ``[batch, kv_heads, entries]`` or None (all zeros)."""
        return self.bias

    def nbytes(self) -> int:
        values = self.values if isinstance(self.values, tuple) else (self.values,)
        return _nbytes(self.keys) + sum(_nbytes(v) for v in values) + tensor_nbytes(self.bias)

    def _map(self, fn) -> LossyBlock:
        def apply(t):
            return fn(t) if isinstance(t, torch.Tensor) else t.map(fn)

        values = tuple(fn(v) for v in self.values) if isinstance(self.values, tuple) else apply(self.values)
        bias = None if self.bias is None else fn(self.bias)
        return LossyBlock(apply(self.keys), values, bias, tokens=self.tokens)

    def select_rows(self, indices: torch.Tensor) -> LossyBlock:
        index = indices.to(unpack_device(self.keys))
        return self._map(lambda t: t.index_select(0, index))

    def to(self, device: torch.device | str) -> LossyBlock:
        return self._map(lambda t: t.to(device))


class LowRankBlock(Block):
    """Per-head truncated SVD of K and V: ``K ~ Uk @ Wk`` with ``Uk`` = ``[b, h, n, r]`` (singular values folded
    in) and ``Wk`` = ``[b, h, r, d]``; the same for V. Attention sees all ``n`` reconstructed entries."""

    exact = False

    def __init__(
        self,
        key_factors: tuple[torch.Tensor, torch.Tensor],
        value_factors: tuple[torch.Tensor, torch.Tensor],
        bias: torch.Tensor | None,
        *,
        tokens: int,
    ):
        self.key_factors = key_factors
        self.value_factors = value_factors
        self.bias = bias
        self.entries = key_factors[0].shape[-2]
        self.tokens = tokens

    @property
    def rank(self) -> int:
        return self.key_factors[0].shape[-1]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_factors[0] @ self.key_factors[1], self.value_factors[0] @ self.value_factors[1]

    def read_bias(self) -> torch.Tensor | None:
        return self.bias

    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for t in (*self.key_factors, *self.value_factors, self.bias))

    def select_rows(self, indices: torch.Tensor) -> LowRankBlock:
        index = indices.to(self.key_factors[0].device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index)

        return LowRankBlock(
            (pick(self.key_factors[0]), pick(self.key_factors[1])),
            (pick(self.value_factors[0]), pick(self.value_factors[1])),
            pick(self.bias),
            tokens=self.tokens,
        )

    def to(self, device: torch.device | str) -> LowRankBlock:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return LowRankBlock(
            (move(self.key_factors[0]), move(self.key_factors[1])),
            (move(self.value_factors[0]), move(self.value_factors[1])),
            move(self.bias),
            tokens=self.tokens,
        )


class RaggedBlock(Block):
    """Kept entries in different numbers per batch row and KV head (head-adaptive budgets: AdaKV), stored compactly:
    ``keys`` / ``values`` hold every (row, head)'s entries one run after the other, rows then heads, in position order
    (``[1, 1, N, d]``, a tensor or `Packed`), ``counts`` (``[b, h]`` int32) how many each has. Attention reads them as
    ``[b, h, max count, d]`` with the missing entries dead (``-inf`` bias): that padded copy exists only while it is
    read, so a head that keeps fewer entries frees their bytes. Every kept entry has bias 0 (no bias stored)."""

    exact = False

    def __init__(self, keys: torch.Tensor | Packed, values: torch.Tensor | Packed, counts: torch.Tensor, *,
                 tokens: int):
        self.keys = keys
        self.values = values
        self.counts = counts
        self.entries = int(counts.max()) if counts.numel() else 0
        self.tokens = tokens

    @classmethod
    def from_mask(cls, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, *, tokens: int,
                  fmt: str) -> RaggedBlock:
        """The entries ``keep`` (``[b, h, n]`` bool) of ``keys`` / ``values`` (``[b, h, n, d]``), in entry format
        ``fmt`` (``mixed``: its cheapest tier for every entry; a per-head count leaves no shared tier split)."""
        fmt = MIXED_TIERS[-1] if fmt == "mixed" else fmt
        return cls(pack(keys[keep][None, None], fmt), pack(values[keep][None, None], fmt),
                   keep.sum(-1, dtype=torch.int32), tokens=tokens)

    def _valid(self) -> torch.Tensor:
        return torch.arange(self.entries, device=self.counts.device) < self.counts[..., None]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        valid = self._valid()
        out = []
        for flat in (unpack(self.keys)[0, 0], unpack(self.values)[0, 0]):
            padded = flat.new_zeros(*valid.shape, flat.shape[-1])
            padded[valid] = flat
            out.append(padded)
        return out[0], out[1]

    def read_bias(self) -> torch.Tensor:
        """``[b, h, max count]``: 0 for kept entries, ``-inf`` for the padding of heads that keep fewer."""
        return torch.where(self._valid(), 0.0, float("-inf")).to(self.keys.dtype)

    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values) + tensor_nbytes(self.counts)

    def _map_entries(self, fn, counts: torch.Tensor) -> RaggedBlock:
        def apply(t):
            return fn(t) if isinstance(t, torch.Tensor) else t.map(fn)

        return RaggedBlock(apply(self.keys), apply(self.values), counts, tokens=self.tokens)

    def select_rows(self, indices: torch.Tensor) -> RaggedBlock:
        index = indices.to(self.counts.device, torch.long)
        per_row = self.counts.sum(-1, dtype=torch.long)
        starts = per_row.cumsum(0) - per_row
        flat = torch.cat([torch.arange(int(starts[i]), int(starts[i] + per_row[i])) for i in index.tolist()])
        flat = flat.to(unpack_device(self.keys))
        return self._map_entries(lambda t: t.index_select(2, flat), self.counts.index_select(0, index))

    def to(self, device: torch.device | str) -> RaggedBlock:
        return self._map_entries(lambda t: t.to(device), self.counts.to(device))


def kept_block(
    keys: torch.Tensor, values: Values, bias: torch.Tensor | None, *, tokens: int, fmt: str,
    tiers: tuple[int, ...] = (),
) -> LossyBlock:
    """A block of kept entries with keys and (tensor) values stored in entry format ``fmt`` (``mixed``: ``tiers``
    entries in each better tier, see `packed.pack` and `budget.upgrade_order`)."""
    if not isinstance(values, tuple):
        values = pack(values, fmt, tiers)
    return LossyBlock(pack(keys, fmt, tiers), values, bias, tokens=tokens)


def unpack_device(x: torch.Tensor | Packed | Split) -> torch.device:
    if isinstance(x, Split):
        return x.parts[0].codes.device
    return x.codes.device if isinstance(x, Packed) else x.device


def _nbytes(x: torch.Tensor | Packed | Split | None) -> int:
    return tensor_nbytes(x) if x is None or isinstance(x, torch.Tensor) else x.nbytes()


def block_bias(block: Block) -> torch.Tensor | None:
    """The per-entry logit bias of any block (None for blocks without one)."""
    reader = getattr(block, "read_bias", None)
    return None if reader is None else reader()
