"""How a sealed block of tokens is held, and what tensors cost. A `Storage` turns K/V tensors into a `Block`;
`CompressedLayer` seals blocks only through these two interfaces, so lossless coding plugs in here
(`hf_kvcompress.cache.coded.CodedStorage`). Lossy summaries are `Block`s too, but made by `LossyLayer`, a
subclass of the layer (`hf_kvcompress.lossy.layer` says why)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch


class Block(ABC):
    """A sealed, immutable run of cached entries for all batch rows of one layer.

    ``tokens`` is how many text positions the block stands for; ``entries`` is how many K/V rows it gives
    attention (equal for exact storage, smaller for summaries).
    """

    tokens: int
    entries: int
    #: True when `read` returns exactly what was sealed, so the block may be unsealed by `crop`.
    exact: bool = True

    @abstractmethod
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, each ``[batch, kv_heads, entries, head_dim]`` on the layer's device."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this block really holds, headers and side data included."""

    @abstractmethod
    def select_rows(self, indices: torch.Tensor) -> Block:
        """A block holding batch rows ``indices`` (reordered, repeated or subset) of this one."""

    def to(self, device: torch.device | str) -> Block:
        """This block with its tensors on ``device`` (blocks that hold bytes ignore it)."""
        return self


class Storage(ABC):
    """Decides how sealed blocks are held. One instance per cache layer."""

    name: str

    @abstractmethod
    def hold(self, keys: torch.Tensor, values: torch.Tensor, *, start: int) -> Block:
        """Seal ``keys``/``values`` (``[batch, kv_heads, tokens, head_dim]``) that begin at text position
        ``start``."""

    def hold_blocks(self, keys: torch.Tensor, values: torch.Tensor, *, start: int, tokens: int) -> list[Block]:
        """Seal ``keys``/``values`` (``[batch, kv_heads, count * tokens, head_dim]``, beginning at text position
        ``start``) as ``count`` blocks of ``tokens`` each, in order: what `hold` of each gives (a storage may seal
        them in one batch; this one holds them one by one)."""
        return [self.hold(keys[..., at : at + tokens, :], values[..., at : at + tokens, :], start=start + at)
                for at in range(0, keys.shape[-2], tokens)]

    def read_all(self, blocks: list[Block]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``block.read()`` of each block, in order (a storage may read a layer's blocks in one batch)."""
        return [block.read() for block in blocks]

    def read_into(self, blocks: list[Block], keys: torch.Tensor, values: torch.Tensor) -> None:
        """The blocks' keys and values one after another along dim -2 of ``keys`` / ``values`` (``[batch,
        kv_heads, entries of all blocks, head_dim]``, views of the tensors attention reads). This copies
        `read_all`'s tensors; a storage that decodes may write there directly."""
        at = 0
        for k, v in self.read_all(blocks):
            n = k.shape[-2]
            keys[..., at : at + n, :].copy_(k)
            values[..., at : at + n, :].copy_(v)
            at += n


class RawBlock(Block):
    """Plain tensors: what `DynamicCache` holds."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, tokens: int | None = None):
        self.keys = keys
        self.values = values
        self.entries = keys.shape[-2]
        self.tokens = self.entries if tokens is None else tokens
        self.exact = self.tokens == self.entries

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys) + tensor_nbytes(self.values)

    def select_rows(self, indices: torch.Tensor) -> RawBlock:
        index = indices.to(self.keys.device)
        return RawBlock(self.keys.index_select(0, index), self.values.index_select(0, index), self.tokens)

    def to(self, device: torch.device | str) -> RawBlock:
        return RawBlock(self.keys.to(device, non_blocking=True), self.values.to(device, non_blocking=True), self.tokens)


class RawStorage(Storage):
    """Mode ``"none"``: blocks are sealed but held as plain tensors (the reference for every other mode)."""

    name = "raw"

    def hold(self, keys: torch.Tensor, values: torch.Tensor, *, start: int) -> RawBlock:
        # contiguous copies: a slice would keep the whole residual tensor it came from alive
        return RawBlock(keys.contiguous().clone(), values.contiguous().clone())


def tensor_nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it owns exactly its storage, else a compact copy (a view would pin the whole
    buffer it was cut from, e.g. the residual a block was sealed out of)."""
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and \
            tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once (also across calls sharing
    ``seen``): what the process really holds for them, including any larger buffer a view keeps alive."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def row_index(indices: object, rows: int | None, *, masks: bool = True) -> torch.Tensor:
    """Batch rows to keep, as a long CPU index, so K/V, blocks and token ids all select the same rows.

    Integers are rows in order (repeats allowed); a bool mask (``masks=True``, one entry per row) keeps
    its True rows, as ``DynamicCache.batch_select_indices`` does. ``rows=None``: no range check (nothing held).
    """
    index = torch.as_tensor(indices).detach().cpu()
    if index.ndim != 1:
        raise ValueError(f"batch indices must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype == torch.bool:
        if not masks:
            raise TypeError("reorder_cache needs integer beam indices, got a bool mask (as DynamicCache refuses)")
        if rows is not None and index.numel() != rows:
            raise IndexError(f"a bool mask of {index.numel()} entries does not fit a batch of {rows} rows")
        return index.nonzero().flatten()
    if index.is_floating_point() or index.is_complex():
        raise TypeError(f"batch indices must be integers or a bool mask, got dtype {index.dtype}")
    index = index.long()
    if rows is not None and index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
        raise IndexError(f"batch indices {index.tolist()} out of range for a batch of {rows}")
    return index
