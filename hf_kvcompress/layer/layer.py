"""`CompressedLayer`: one model layer's cache as a list of sealed blocks plus a residual of recent tokens."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import BUILD_WITH_MODEL, LayerKindError
from .storage import Block, Storage, owned, row_index, storage_bytes, tensor_nbytes


def _whole_layer(which: int, name: str) -> property:
    """The ``keys`` (``which=0``) or ``values`` (1) property: every held entry as one plain tensor (None before
    the first update), as on `DynamicLayer`; setting it makes the whole layer residual (`_replace`)."""

    def get(layer: CompressedLayer) -> torch.Tensor | None:
        return torch.cat(held_parts(layer)[which], dim=-2) if layer.is_initialized else None

    def put(layer: CompressedLayer, tensor: torch.Tensor | None) -> None:
        layer._replace(tensor, which=which)

    return property(get, put, doc=f"Every held {name[:-1]} of this layer, ``[batch, kv_heads, entries, head_dim]``.")


class CompressedLayer(CacheLayerMixin):
    """A full-attention cache layer whose old tokens are sealed into blocks held by a pluggable `Storage`.

    New tokens land in a plain-tensor residual. Once the residual holds ``residual_tokens + block_tokens``
    tokens, its oldest ``block_tokens`` are handed to the storage and kept only in the form it returns.
    ``keys`` / ``values`` read (and write) the whole layer as plain tensors, as on `DynamicLayer`, so tools
    that inspect or prune caches keep working.

    Subclasses change what happens around an update through named hooks, as transformers'
    `DynamicSlidingWindowLayer` derives from `DynamicLayer`: ``_before_append`` (checks), ``_after_append``
    (seal, drop, schedule), ``_hidden_entries`` (held rows attention no longer sees), ``_drop_out_of_window``,
    ``_shown_tokens``. `SlidingWindowLayer` (``layer/sliding.py``) is the sliding window, `LossyLayer`
    (``lossy/layer.py``) the lossy mode.
    """

    is_compileable = False

    #: transformers' layer attributes: None / False on a full-attention layer (`SlidingWindowLayer` sets them)
    sliding_window: int | None = None
    is_sliding = False
    #: whether updates seal blocks (a sliding window too small to be worth coding does not)
    seals = True
    #: whether the layer holds K/V as generation codes it: every token from position 0, sealed into
    #: ``block_tokens`` blocks and none dropped, with nothing else held (`holds_as_generated`). False on a
    #: sliding window (drops blocks), a lossy layer (drops tokens) and a hybrid (also holds a recurrent state)
    keeps_generated_blocks = True

    def __getattr__(self, name: str):
        # only reached for an attribute the layer lacks: a model calling a method of its own cache layer class
        # (DeepSeek-V4's compressor) gets a reason instead of a bare AttributeError from inside its forward
        if name.startswith("_"):
            raise AttributeError(name)
        raise LayerKindError(
            f"CompressedCache: the model asked cache layer {self.__dict__.get('layer_idx')} ({type(self).__name__}, "
            f"attention K/V) for {name!r}, which it does not have: the model expects a cache layer of a kind of its "
            "own there. A CompressedCache built without model= (or model_config=) makes every layer an attention "
            "layer. " + BUILD_WITH_MODEL
        )

    def __init__(self, storage: Storage, *, block_tokens: int, residual_tokens: int, layer_idx: int | None = None):
        self.storage = storage
        #: as on `DynamicSlidingWindowLayer`: keep tokens that leave the window until the next `crop`
        self.record_past = False
        self.block_tokens = block_tokens
        self.residual_tokens = residual_tokens
        self.layer_idx = layer_idx
        self.blocks: list[Block] = []
        self.block_starts: list[int] = []
        self.residual_keys: torch.Tensor | None = None
        self.residual_values: torch.Tensor | None = None
        self.seen_tokens = 0
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        super().__init__()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(storage={self.storage.name}, blocks={len(self.blocks)}, "
            f"residual={self.residual_length}, tokens={self.seen_tokens})"
        )

    # ------------------------------------------------------------------ transformers' layer interface

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        shape = (*key_states.shape[:2], 0, key_states.shape[-1])
        self.residual_keys = key_states.new_empty(shape)
        self.residual_values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens; return every cached entry of this layer followed by the new ones."""
        self._before_append(key_states, value_states)
        keys, values = self._append(key_states, value_states)
        self._after_append(keys, key_states.shape[-2])
        return keys, values

    def _before_append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Hook: refuse an update before anything changes (the states' shapes are checked in `_append`)."""

    def _after_append(self, keys: torch.Tensor, count: int) -> None:
        """Hook: what follows the append of ``count`` tokens (``keys``: what attention gets): seal full blocks, drop
        what a window no longer shows."""
        self._seal_full_blocks()
        self._drop_out_of_window()

    def activate_past_recording(self) -> None:
        """Keep tokens that leave the sliding window until the next `crop` (transformers' assisted decoding
        rolls a window back this way); no effect on a full-attention layer, which keeps every token anyway."""
        self.record_past = True

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Check and append new tokens to the residual; return every held entry followed by the new ones."""
        check_states(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = held_with(self, key_states, value_states)
        self.residual_keys = torch.cat([self.residual_keys, key_states], dim=-2)
        self.residual_values = torch.cat([self.residual_values, value_states], dim=-2)
        self.seen_tokens += key_states.shape[-2]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        visible = self.entries
        return visible + query_length, self.seen_tokens - visible

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return all(block.exact for block in self.blocks)

    def reset(self) -> None:
        self.blocks, self.block_starts = [], []
        self.residual_keys = self.residual_values = None
        self.seen_tokens = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as for DynamicCache."
            )
        self._crop_tail(-tokens_to_remove)

    def _crop_tail(self, remove: int) -> None:
        """Remove the last ``remove`` tokens, unsealing exact blocks where the residual holds too few."""
        if remove == 0 or not self.is_initialized:
            return
        if remove > self.seen_tokens:
            raise ValueError(f"crop: cannot remove {remove} tokens from a layer holding {self.seen_tokens}")
        while self.residual_length < remove and self.blocks:
            block = self.blocks[-1]
            if not block.exact:
                raise ValueError(
                    f"crop: removing {remove} tokens reaches into a lossy summary block of layer "
                    f"{self.layer_idx}; only the {self.residual_length} most recent tokens can be removed."
                )
            k, v = self.storage.read_all([block])[0]  # a coded block reads through its storage
            self.blocks.pop()
            self.block_starts.pop()
            self.residual_keys = torch.cat([k, self.residual_keys], dim=-2)
            self.residual_values = torch.cat([v, self.residual_values], dim=-2)
        keep = self.residual_length - remove
        if keep < 0:
            raise ValueError(f"crop: layer {self.layer_idx} no longer holds the tokens to remove")
        self.residual_keys = owned(self.residual_keys[..., :keep, :])
        self.residual_values = owned(self.residual_values[..., :keep, :])
        self.seen_tokens -= remove

    def restore(self, keys: torch.Tensor, values: torch.Tensor, seen_tokens: int) -> None:
        """Hold ``keys`` / ``values`` as the last of ``seen_tokens`` positions, sealed as updates would have sealed
        them (a loaded file: a sliding layer's window is the tail of a longer text, `SlidingWindowLayer`)."""
        if not 0 < keys.shape[-2] <= seen_tokens:
            raise ValueError(f"layer {self.layer_idx}: {keys.shape[-2]} tokens cannot be the last of {seen_tokens}")
        self.reset()
        check_states(self, keys, values)
        self.lazy_initialization(keys, values)
        self.residual_keys, self.residual_values = owned(keys), owned(values)
        self.seen_tokens = seen_tokens
        self._seal_full_blocks()
        self._drop_out_of_window()

    def adopt(self, blocks: list[Block], keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        """Hold ``blocks`` as this layer's sealed blocks, taken as they are (a loaded file or a stored prefix whose
        blocks are already coded the way this layer's storage codes them: not decoded and coded again), then
        ``keys`` / ``values`` (``[batch, kv_heads, tokens, dim]``; None: no newer tokens) as the newest tokens. A
        full-attention layer only, each block ``block_tokens`` long from position 0, as updates seal them; the
        blocks say their rows, heads, widths, dtype and device (`CodedBlock`)."""
        if keys is None or values is None:
            first = blocks[0]
            shape = (len(first.rows), first.heads, 0)
            keys = torch.empty((*shape, first.dim), dtype=first.dtype, device=first.device)
            values = torch.empty((*shape, first.value_dim), dtype=first.dtype, device=first.device)
        if any(block.tokens != self.block_tokens for block in blocks):
            raise ValueError(f"layer {self.layer_idx}: adopted blocks must hold {self.block_tokens} tokens each, got "
                             f"{[block.tokens for block in blocks]}")
        self.reset()
        check_states(self, keys, values)
        self.lazy_initialization(keys, values)
        self.blocks = list(blocks)
        self.block_starts = [i * self.block_tokens for i in range(len(blocks))]
        self.residual_keys, self.residual_values = owned(keys), owned(values)
        self.seen_tokens = len(blocks) * self.block_tokens + keys.shape[-2]
        self._seal_full_blocks()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(row_index(beam_idx, self.rows, masks=False))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(row_index(indices, self.rows))

    def offload(self) -> None:
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self.residual_keys.device != self.device:
            self._move(self.device)

    # ------------------------------------------------------------------ a failed step (`CompressedCache.update`)

    #: what an update changes: `checkpoint` keeps these (references; lists copied) and `rollback` sets them back
    STEP_FIELDS: tuple[str, ...] = ("blocks", "block_starts", "residual_keys", "residual_values", "seen_tokens",
                                    "is_initialized", "dtype", "device")

    def checkpoint(self) -> dict[str, Any]:
        """This layer as it is now, for `rollback`: references, not copies (an update replaces its tensors and
        blocks, never writes into them), so a checkpoint costs no K/V bytes of its own."""
        state = {name: getattr(self, name) for name in self.STEP_FIELDS}
        return {name: list(value) if isinstance(value, list) else value for name, value in state.items()}

    def rollback(self, state: dict[str, Any]) -> None:
        """Put this layer back as it was at `checkpoint` (a step that failed after or during this layer's update)."""
        for name, value in state.items():
            setattr(self, name, value)

    # ------------------------------------------------------------------ DynamicLayer-style tensors

    keys = _whole_layer(0, "keys")
    values = _whole_layer(1, "values")

    # ------------------------------------------------------------------ sizes

    @property
    def residual_length(self) -> int:
        return 0 if self.residual_keys is None else self.residual_keys.shape[-2]

    @property
    def held_entries(self) -> int:
        """K/V rows this layer holds (a sliding layer may hold a few tokens its window no longer shows)."""
        return sum(block.entries for block in self.blocks) + self.residual_length

    @property
    def entries(self) -> int:
        """K/V rows attention sees from this layer right now (a sliding layer: at most ``sliding_window - 1``)."""
        return self.held_entries - self._hidden_entries()

    def _hidden_entries(self, shown: bool = False) -> int:
        """Hook: held rows attention no longer sees (none here; a sliding window's oldest, `SlidingWindowLayer`);
        with ``shown``, those ``keys`` / ``values`` do not show."""
        return 0

    def _shown_tokens(self) -> int:
        """Hook: text positions attention sees from this layer (every one seen here), what ``raw_bytes`` counts."""
        return self.seen_tokens

    @property
    def rows(self) -> int:
        """Batch rows held (0 before the first update)."""
        return 0 if self.residual_keys is None else self.residual_keys.shape[0]

    def stats(self) -> dict[str, int]:
        """Tokens, entries and bytes of this layer (see `CompressedCache.stats`)."""
        if not self.is_initialized:
            return {"tokens": 0, "entries": 0, "raw_bytes": 0, "stored_bytes": 0, "scalars": 0, "held_bytes": 0,
                    "residual_bytes": 0}
        batch, heads, _, dim = self.residual_keys.shape
        scalars = batch * heads * (dim + self.residual_values.shape[-1]) * self._shown_tokens()  # K and V widths may differ
        blocks = sum(block.nbytes() for block in self.blocks)
        stored = blocks + tensor_nbytes(self.residual_keys) + tensor_nbytes(self.residual_values)
        residual = storage_bytes([self.residual_keys, self.residual_values])  # whole buffers, views included
        return {
            "tokens": self.seen_tokens,
            "entries": self.entries,
            "raw_bytes": scalars * self.residual_keys.element_size(),
            "stored_bytes": stored,
            "scalars": scalars,
            "held_bytes": blocks + residual,
            "residual_bytes": residual,
        }

    # ------------------------------------------------------------------ internals

    def _seal_full_blocks(self) -> None:
        """Seal every full block the residual holds beyond ``residual_tokens``, all in one `Storage.hold_blocks`
        call: a prefill or a load seals many at once, which a coding storage codes in one batch."""
        count = (self.residual_length - self.residual_tokens) // self.block_tokens if self.seals else 0
        if count <= 0:
            return
        n = count * self.block_tokens
        start = self.seen_tokens - self.residual_length
        self.blocks.extend(self.storage.hold_blocks(self.residual_keys[..., :n, :], self.residual_values[..., :n, :],
                                                    start=start, tokens=self.block_tokens))
        self.block_starts.extend(range(start, start + n, self.block_tokens))
        # copies: a slice would keep the whole pre-seal residual alive
        self.residual_keys = owned(self.residual_keys[..., n:, :])
        self.residual_values = owned(self.residual_values[..., n:, :])

    def _drop_out_of_window(self, force: bool = False) -> None:
        """Hook: drop what no future query can reach (nothing on a full-attention layer)."""

    def _select_rows(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = row_index(indices, self.rows).to(self.residual_keys.device)
        self.blocks = [block.select_rows(index) for block in self.blocks]
        self.residual_keys = self.residual_keys.index_select(0, index)
        self.residual_values = self.residual_values.index_select(0, index)

    def _move(self, device: torch.device | str) -> None:
        self.blocks = [block.to(device) for block in self.blocks]
        self.residual_keys = self.residual_keys.to(device, non_blocking=True)
        self.residual_values = self.residual_values.to(device, non_blocking=True)

    def _replace(self, tensor: torch.Tensor | None, which: int) -> None:
        """Overwrite keys (which=0) or values (which=1) with plain tensors, DynamicLayer style."""
        if tensor is None:
            if which == 0:
                self.reset()
            return
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 4:
            raise ValueError("CompressedLayer.keys/values must be set to a 4-D [batch, heads, tokens, dim] tensor")
        if not self.is_initialized:
            self.lazy_initialization(tensor, tensor)
        # everything becomes residual; the untouched side is materialised first so it stays consistent
        other_k, other_v = held_parts(self)
        self.blocks, self.block_starts = [], []
        if which == 0:
            self.residual_keys = tensor
            self.residual_values = torch.cat(other_v, dim=-2)
        else:
            self.residual_keys = torch.cat(other_k, dim=-2)
            self.residual_values = tensor
        self.seen_tokens = self.residual_keys.shape[-2]



def held_with(layer: CompressedLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every entry of ``layer`` attention sees followed by the new states, as two new tensors (what `DynamicLayer`'s concatenation
    gives): the storage writes the blocks into them (`Storage.read_into`), so a decoding storage needs no
    copy of its own. Keys and values share one buffer when their shapes agree (one destination for a
    codec call that decodes both)."""
    hidden = layer._hidden_entries()
    blocks, skip = _visible_blocks(layer, hidden)
    held = sum(block.entries for block in blocks) - skip
    residual_k, residual_v = _visible_residual(layer, hidden)
    parts_k = [residual_k, key_states]
    parts_v = [residual_v, value_states]
    tokens = held + sum(t.shape[-2] for t in parts_k)
    k_shape = (*key_states.shape[:2], tokens, key_states.shape[3])
    v_shape = (*value_states.shape[:2], tokens, value_states.shape[3])
    if k_shape == v_shape:
        both = key_states.new_empty((2, *k_shape))
        keys, values = both[0], both[1]  # not unbind: autograd refuses in-place writes to its views
    else:
        keys, values = key_states.new_empty(k_shape), value_states.new_empty(v_shape)
    if skip:  # the oldest block shows only its last tokens: read it alone, copy them
        (k, v), = layer.storage.read_all(blocks[:1])
        n = blocks[0].entries - skip
        keys[..., :n, :].copy_(k[..., skip:, :])
        values[..., :n, :].copy_(v[..., skip:, :])
        blocks = blocks[1:]
    else:
        n = 0
    if blocks:
        layer.storage.read_into(blocks, keys[..., n:held, :], values[..., n:held, :])
    at = held
    for k, v in zip(parts_k, parts_v):
        n = k.shape[-2]
        keys[..., at : at + n, :].copy_(k)
        values[..., at : at + n, :].copy_(v)
        at += n
    return keys, values


def holds_as_generated(layer: object) -> bool:
    """Whether ``layer`` holds K/V as generation codes it (`CompressedLayer.keeps_generated_blocks`): the one test
    before a save writes, a load adopts or the prefix store takes a layer's coded blocks as they are."""
    return isinstance(layer, CompressedLayer) and layer.keeps_generated_blocks


def held_parts(layer: CompressedLayer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What attention sees of ``layer``, in parts (blocks, then the residual)."""
    hidden = layer._hidden_entries(shown=True)
    blocks, skip = _visible_blocks(layer, hidden)
    keys, values = [], []
    for k, v in layer.storage.read_all(blocks):
        keys.append(k[..., skip:, :])
        values.append(v[..., skip:, :])
        skip = 0
    residual_k, residual_v = _visible_residual(layer, hidden)
    keys.append(residual_k)
    values.append(residual_v)
    return keys, values


def _visible_blocks(layer: CompressedLayer, hidden: int) -> tuple[list[Block], int]:
    """The blocks left once the ``hidden`` oldest entries are, and how many leading entries of the first are."""
    blocks = layer.blocks
    while blocks and hidden >= blocks[0].entries:
        hidden -= blocks[0].entries
        blocks = blocks[1:]
    if not blocks:
        return [], 0
    return list(blocks), hidden


def _visible_residual(layer: CompressedLayer, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual tokens left once the ``hidden`` oldest entries of the layer are."""
    hidden -= sum(block.entries for block in layer.blocks)
    if hidden <= 0:
        return layer.residual_keys, layer.residual_values
    return layer.residual_keys[..., hidden:, :], layer.residual_values[..., hidden:, :]

def check_states(layer: CompressedLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Refuse states that are not 4-D float tensors agreeing with each other and with what ``layer`` holds."""
    where = f"layer {layer.layer_idx}" if layer.layer_idx is not None else "layer"
    for name, t in (("key_states", key_states), ("value_states", value_states)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{where}: {name} must be 4-D [batch, kv_heads, tokens, head_dim], got {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{where}: {name} must be a floating-point tensor, got dtype {t.dtype}")
    if key_states.shape[:3] != value_states.shape[:3]:
        raise ValueError(
            f"{where}: key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} "
            "disagree on batch, heads or tokens"
        )
    if key_states.dtype != value_states.dtype:
        raise TypeError(f"{where}: key dtype {key_states.dtype} differs from value dtype {value_states.dtype}")
    if layer.is_initialized:
        if key_states.dtype != layer.dtype:
            raise TypeError(f"{where}: got dtype {key_states.dtype}, but this layer holds {layer.dtype}")
        held_k, held_v = layer.residual_keys, layer.residual_values
        if (key_states.shape[0], key_states.shape[1], key_states.shape[3]) != (
            held_k.shape[0],
            held_k.shape[1],
            held_k.shape[3],
        ) or value_states.shape[3] != held_v.shape[3] or value_states.shape[1] != held_v.shape[1]:
            raise ValueError(
                f"{where}: new states {tuple(key_states.shape)} / {tuple(value_states.shape)} do not match the "
                f"cached [batch, heads, *, dim] = {tuple(held_k.shape)} / {tuple(held_v.shape)}"
            )
