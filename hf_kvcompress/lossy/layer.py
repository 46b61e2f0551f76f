"""`LossyLayer`: a cache layer that keeps sinks and a recent window exact and periodically summarises the rest.

Why a subclass of `CompressedLayer` and not a `Storage` plug-in: a `Storage` seals one fixed-size run of tokens
at a time from its keys and values alone (``hold(keys, values, start)``), while a summary replaces *every* old
block at once, within a byte budget for the whole layer, fitted on the queries of the forward in progress and on
the exact context around the region. So the layer keeps the base class's residual, block list, ``keys``/``values``
views, ``get_mask_sizes``, beam/batch row selection, offloading and crop of the exact tail (all through its
blocks' `Block` interface), and overrides:

- the update hooks ``_before_append`` (refuse a detached model, or a batch without one) and ``_after_append`` (mark a
  summary as due, instead of sealing fixed-size blocks);
- ``reset`` / ``crop`` / ``_select_rows`` / ``_move`` / ``_replace``: the base's work, plus this layer's own
  state (the residual's padding mask, the sink block, the kept queries);
- ``stats``: adds the summaries, their timings and the kept queries.

The summary step itself (sinks, region, reference queries, the method's call) and the per-entry biases live in
`summarize.SummaryMixin`; the refusals before any work (`require_model`) in `refusals`.

Its blocks are `LossyBlock` / `LowRankBlock` (``exact = False``, so a crop never reaches into them). It hands the
base class a `RawStorage`, which only reads the blocks back (``read_all``): ``update`` never seals.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..layer.hybrid import RecurrentStateMixin
from ..layer.layer import CompressedLayer
from ..layer.storage import RawStorage, owned, tensor_nbytes
from .attention_hook import ATTENTION_NAME, acquire, is_attached, release, set_active, take_active
from .blocks import LossyBlock
from .budget import budget_bytes, full_budget, token_bytes
from .methods import METHODS
from .queries import QueryBuffer, query_bytes
from .summarize import SummaryMixin

if TYPE_CHECKING:  # the state is KVzip's; the layer only holds it
    from .methods.kvzip import ReplayState


class LossyLayer(SummaryMixin, CompressedLayer):
    """One layer in lossy mode.

    Held entries, in order: a sink block (the first ``sinks`` real tokens of each row, exact, made at the first
    summary), the blocks the method made of everything older than the recent window, and the residual (recent
    tokens, exact). A summary runs when the layer holds more than its budget and more tokens than its sinks and
    recent window (`over_budget`), and either a multi-token forward (a prefill) just arrived or ``interval`` tokens
    came in since the last one. With a model attached it runs
    right after that forward's attention, on its queries; otherwise at the end of ``update`` on key proxies.

    Everything the layer holds counts (``held_bytes``), the queries it keeps for the next summary included: right
    after every summary it holds at most its budget less the room those queries will take; between summaries it
    may exceed its budget by the tokens that arrived since the last one (at most ``interval - 1`` decode steps).
    """

    keeps_generated_blocks = False  # summaries drop and merge tokens

    def __init__(self, cache: Any, *, layer_idx: int):
        # sliding-window layers are never lossy: their memory is bounded already, and the cache holds them as
        # plain windows (`CompressedCache._new_layer`)
        config = cache.config
        self.lossy = config.lossy
        #: the registered method (`registry.LossyMethod`) this layer's summaries run
        self.method = METHODS[self.lossy.method]
        model = getattr(cache, "model", None)
        keeps_queries = model is not None and self.method.needs_queries and not full_budget(self.lossy)
        # set before the base __init__: transformers' layer __init__ assigns `keys`, which resets the layer.
        # Between summaries only the queries the next fit can use are kept (a summary forgets them)
        self.query_buffer = QueryBuffer(min(self.lossy.kept_queries, self.lossy.interval) if keeps_queries else 0)
        self.residual_valid: torch.Tensor | None = None
        self.sink_block: LossyBlock | None = None
        super().__init__(
            RawStorage(),
            block_tokens=config.block_tokens,
            residual_tokens=config.residual_tokens,
            layer_idx=layer_idx,
        )
        self.model = model
        text = None if model is None else model.config.get_text_config(decoder=True)
        self.q_heads = 0 if text is None else text.num_attention_heads
        #: the model's layer count, for a method with layer budgets (None without a model: uniform budgets)
        self.layer_count = None if text is None else getattr(text, "num_hidden_layers", None)
        self.attached = self.model is not None
        if self.attached:
            # the model gets its attention implementation back once every lossy layer using it is released
            weakref.finalize(self, release, weakref.ref(self.model), acquire(self.model))
        self.pending = False
        self.since_summary = 0
        #: a context replay in progress (`methods.kvzip.ReplayState`, KVzip's own: its phase, scores and queries);
        #: None: none. While one runs the layer summarises nothing; a scoring phase takes the forwards' queries
        self.replay_state: ReplayState | None = None
        #: the share of what the uniform budget leaves beyond sinks, window and queries this layer keeps (set by a
        #: prune across layers, KVzip's); None: the method's `layer_share`, or the uniform budget
        self.budget_share: float | None = None
        self.summary_seconds: list[float] = []
        self.scaling: float | None = None
        self._new_valid: torch.Tensor | None = None
        self.expected_kv = -1

    def __repr__(self) -> str:
        return (
            f"LossyLayer(method={self.lossy.method}, entries={self.entries if self.is_initialized else 0}, "
            f"tokens={self.seen_tokens}, summaries={len(self.summary_seconds)})"
        )

    # ------------------------------------------------------------------ transformers' layer interface

    def _before_append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse an update the layer cannot summarise right: its model detached, or a batch without a model."""
        if self.attached and not is_attached(self.model):
            raise RuntimeError(
                f"lossy layer {self.layer_idx}: the model no longer runs the lossy attention function "
                f"(its attention is {self.model.config._attn_implementation!r}, not {ATTENTION_NAME!r}: detach() was "
                "called); build a new CompressedCache with model=... to compress again"
            )
        if not self.attached and key_states.shape[0] > 1:
            raise ValueError(
                f"lossy layer {self.layer_idx}: a batch of {key_states.shape[0]} rows without a model: the cache cannot "
                "see the attention mask, so padding would be kept (and taken as attention sinks) like real tokens. "
                "Build the cache with CompressedCache(config, model=model), or run one row at a time."
            )

    def _after_append(self, keys: torch.Tensor, count: int) -> None:
        """Instead of sealing fixed-size blocks: mark a summary as due (it changes only what later forwards see) and
        run it now without a model, or register for the attention function's ``observe`` with one."""
        if self.residual_valid is not None:
            ones = torch.ones(self.rows, count, dtype=torch.bool, device=self.residual_valid.device)
            self.residual_valid = torch.cat([self.residual_valid, ones], dim=-1)
        self.since_summary += count
        self._new_valid = None
        self.expected_kv = keys.shape[-2]
        if self.replay_state is None and self.over_budget() and (count > 1 or self.since_summary >= self.lossy.interval):
            self.pending = True
        if self.attached:
            set_active(self.layer_idx, self)
        elif self.pending:
            self.summarize()

    def replay(
        self, key_states: torch.Tensor, value_states: torch.Tensor, query_states: torch.Tensor, scaling: float | None
    ) -> None:
        """What one unpadded forward does to this layer (``update``, then the attention function's ``observe``),
        from captured post-RoPE states: lets experiments share one full prefill across many lossy caches."""
        self.update(key_states, value_states)
        take_active(self.layer_idx)
        self.observe(query_states, scaling)

    # ------------------------------------------------------------------ called by the lossy attention function

    def expects(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether an attention call with these shapes is the one this layer's last ``update`` prepared (guards
        against a stale registration, e.g. an ``update`` whose attention never ran)."""
        return key.shape[-2] == self.expected_kv and query.shape[0] == self.rows

    def check_reads(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Refuse a query-scored method (before its first summary) where attention reads other keys or values than
        the cached ones (``[batch, heads, entries, width]`` of another head count or width: an MLA latent cache,
        up-projected after the cache), against which its scores and refits are not defined."""
        if not self.method.needs_queries or not self.compresses:
            return
        held_k, held_v = self.residual_keys, self.residual_values
        if (key.shape[1], key.shape[-1], value.shape[1], value.shape[-1]) != (
                held_k.shape[1], held_k.shape[-1], held_v.shape[1], held_v.shape[-1]):
            raise ValueError(
                f"lossy layer {self.layer_idx}: attention reads keys {list(key.shape[1::2])} and values "
                f"{list(value.shape[1::2])} ([heads, width]) computed from the cached keys {list(held_k.shape[1::2])} "
                f"and values {list(held_v.shape[1::2])} (a latent cache, as MLA's); method {self.lossy.method!r} scores "
                "entries by the model's queries, which is not defined on them: use method 'streaming' or 'svd', or "
                "mode='lossless'"
            )

    def attention_mask(
        self, query: torch.Tensor, kv_length: int, mask: torch.Tensor | None, *, additive: bool = False
    ) -> torch.Tensor | None:
        """The mask for this layer's attention: biases (fitted weights, ``-inf`` for padding) on the held entries,
        the model's causal/padding mask on the new ones. ``mask`` is transformers' sdpa-style mask (None or bool)
        for the *first* layer; only its last ``q`` columns (the new tokens, whose positions do not depend on what a
        layer holds) are used. ``additive``: always return a float mask to add to the logits (eager attention),
        never ``None`` or a bool mask."""
        b, heads, q, _ = query.shape
        held = kv_length - q
        if mask is not None:
            new = mask[..., -q:]
            new = new if new.dtype == torch.bool else new > torch.finfo(new.dtype).min / 2
            valid = new.any(dim=-2)[:, 0, :]  # a token is real if any query of its row may attend to it
            self._new_valid = None if bool(valid.all()) else valid
        else:
            new = None
        held_bias = self._held_bias(held)
        model_mask_fits = mask.shape[-1] == kv_length if mask is not None else (q == 1 or held == 0)
        if held_bias is None and model_mask_fits and not additive:
            return mask  # nothing to add: the model's own mask (or sdpa's causal shortcut) is right
        if new is None:
            new = torch.ones(q, q, dtype=torch.bool, device=query.device).tril(diagonal=0)[None, None]
        # a query that may see nothing (left padding) would spread its attention evenly over every column, later
        # tokens included: let it see itself only, so no output depends on a later token
        eye = torch.eye(q, dtype=torch.bool, device=query.device)
        new = new | (~new.any(dim=-1, keepdim=True) & eye)
        low = torch.finfo(query.dtype).min
        new_part = torch.where(new, 0.0, low).to(query.dtype).expand(b, heads, q, q)
        if held_bias is None:
            held_part = torch.zeros(b, heads, q, held, dtype=query.dtype, device=query.device)
        else:
            groups = heads // held_bias.shape[1]
            bias = torch.where(torch.isfinite(held_bias), held_bias, low).clamp_min(low)
            bias = bias.repeat_interleave(groups, dim=1).to(query.dtype)
            held_part = bias[:, :, None, :].expand(b, heads, q, held)
        return torch.cat([held_part, new_part], dim=-1)

    def observe(self, query: torch.Tensor, scaling: float | None) -> None:
        """Record this forward's queries (and which new tokens are padding); run a summary that is due."""
        if scaling is not None:
            self.scaling = float(scaling)
        count = query.shape[-2]
        if self._new_valid is not None:
            if self.residual_valid is None:
                self.residual_valid = torch.ones(
                    self.rows, self.residual_length, dtype=torch.bool, device=self.residual_keys.device
                )
            self.residual_valid[:, -count:] = self._new_valid.to(self.residual_valid.device)
        current = (query, self.seen_tokens - count, self._new_valid)
        self._new_valid = None
        if self.replay_state is not None and self.replay_state.scoring:
            self.replay_state.score(self, query, count)
        elif self.pending:
            self.summarize(current)  # this forward's queries are used where they are, never kept
        else:
            self.query_buffer.add(*current)

    # ------------------------------------------------------------------ budget

    @property
    def compresses(self) -> bool:
        """False at a budget fraction of 1.0: the whole cache fits, nothing is ever summarised (and no queries kept)."""
        return not full_budget(self.lossy)

    @property
    def token_bytes(self) -> int:
        """Bytes one text position costs per batch row in a full cache."""
        return token_bytes(self.residual_keys.shape[1], self.residual_keys.shape[-1], self.residual_keys.element_size(),
                           self.residual_values.shape[-1])

    def budget_bytes(self) -> int:
        """Bytes per batch row this layer may hold after a summary.

        A method with layer budgets (`registry.LossyMethod.layer_share`, PyramidKV) shares out what the uniform budget
        leaves beyond what every layer keeps anyway (sinks, recent window, the kept queries' room), as PyramidKV's
        budgets apply beyond its observation window: ``fixed + share * (uniform - fixed)``, so the layers together
        hold what uniform budgets would."""
        uniform = budget_bytes(self.lossy, self.seen_tokens, self.token_bytes)
        share = self.budget_share
        if share is None and self.method.layer_share is not None and self.layer_count:
            share = self.method.layer_share(self.layer_idx, self.layer_count, self.lossy.settings)
        fixed = self.fixed_bytes()
        if share is None or uniform <= fixed:
            return uniform
        return fixed + math.floor((uniform - fixed) * share)

    def over_budget(self) -> bool:
        """Whether a summary has something to do: the layer holds more than its budget, and more tokens than the
        sinks and the recent window a summary keeps exact anyway (``sinks + residual_tokens``). A shorter sequence
        stays as it is, as in a full cache: a fraction of a few tokens would otherwise cut into the window itself
        (a 13-token prompt at budget 0.3 kept 3 and changed the text from the second generated token)."""
        return (self.compresses and self.seen_tokens > self.lossy.sinks + self.residual_tokens
                and self.held_bytes() > self.budget_bytes())

    def fixed_bytes(self) -> int:
        """Bytes per row every layer keeps whatever its share: sinks, recent window, the kept queries' room."""
        return (self.lossy.sinks + self.residual_tokens) * self.token_bytes + self.query_reserve()

    def held_bytes(self) -> int:
        """Bytes per batch row held now: everything in `total_held_bytes`, spread over the rows."""
        return self.total_held_bytes() // max(self.rows, 1)

    def total_held_bytes(self) -> int:
        """Every byte this layer holds: blocks with their side data, residual and its padding mask, the kept
        queries, a KVzip replay's running scores and kept queries (between its replay and its pruning)."""
        total = sum(block.nbytes() for block in self.blocks)
        total += tensor_nbytes(self.residual_keys) + tensor_nbytes(self.residual_values)
        total += tensor_nbytes(self.residual_valid) + self.query_buffer.nbytes()
        return total + (self.replay_state.nbytes() if self.replay_state is not None else 0)

    def query_reserve(self) -> int:
        """Bytes per row kept free after a summary for the queries the layer keeps until the next one."""
        if self.query_buffer.capacity <= 0 or not self.is_initialized:
            return 0
        return self.query_buffer.capacity * query_bytes(self.q_heads, self.residual_keys.shape[-1], self.rows)

    # ------------------------------------------------------------------ a failed step

    STEP_FIELDS = (*CompressedLayer.STEP_FIELDS, "residual_valid", "sink_block", "pending", "since_summary",
                   "expected_kv", "_new_valid", "scaling", "summary_seconds", "replay_state", "budget_share")

    def checkpoint(self) -> dict[str, Any]:
        state = super().checkpoint()
        state["query_buffer"] = copy.copy(self.query_buffer)  # `QueryBuffer.add` replaces its tensors, never writes
        state["replay_state"] = copy.copy(self.replay_state)  # as `ReplayState.score`
        return state

    # ------------------------------------------------------------------ bookkeeping overrides

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(super().stats())
        if self.is_initialized:
            out["stored_bytes"] += tensor_nbytes(self.residual_valid)
        out["summaries"] = len(self.summary_seconds)
        out["summary_seconds"] = float(sum(self.summary_seconds))
        out["last_summary_seconds"] = self.summary_seconds[-1] if self.summary_seconds else 0.0
        out["query_bytes"] = self.query_buffer.nbytes()
        out["held_bytes"] = self.total_held_bytes() if self.is_initialized else 0
        return out

    def reset(self) -> None:
        super().reset()
        self.replay_state = self.budget_share = None
        self.residual_valid = None
        self.sink_block = None
        self.pending = False
        self.since_summary = 0
        self.query_buffer.clear()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if not self.is_initialized:
            return
        self.residual_keys, self.residual_values = owned(self.residual_keys), owned(self.residual_values)
        if self.residual_valid is not None:
            self.residual_valid = owned(self.residual_valid[:, : self.residual_length])
        self.query_buffer.drop_after(self.seen_tokens)

    def _select_rows(self, indices: torch.Tensor) -> None:
        super()._select_rows(indices)
        if not self.is_initialized:
            return
        index = indices.to(device=self.residual_keys.device, dtype=torch.long)
        if self.residual_valid is not None:
            self.residual_valid = self.residual_valid.index_select(0, index)
        if self.sink_block is not None:
            self.sink_block = self.blocks[0]  # re-selected by the base class
        self.query_buffer.select_rows(index)

    def _move(self, device: torch.device | str) -> None:
        super()._move(device)
        if self.residual_valid is not None:
            self.residual_valid = self.residual_valid.to(device)
        if self.sink_block is not None:
            self.sink_block = self.blocks[0]
        self.query_buffer.to(device)

    def _replace(self, tensor: torch.Tensor | None, which: int) -> None:
        # writing plain keys/values makes everything exact residual again (earlier summary biases are lost)
        super()._replace(tensor, which)
        self.residual_valid = None
        self.sink_block = None


class LossyHybridLayer(RecurrentStateMixin, LossyLayer):
    """A ``hybrid`` layer in lossy mode: transformers' recurrent states, untouched, beside a `LossyLayer`'s KV."""

    def __init__(self, cache: Any, *, layer_idx: int, number_of_states: int = 1):
        LossyLayer.__init__(self, cache, layer_idx=layer_idx)
        self._init_states(number_of_states)
