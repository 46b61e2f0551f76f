"""What a `LossyLayer` does when a summary runs (`SummaryMixin`): take the sinks out, cut the region between them
and the recent window, gather the reference queries, hand all of it to the method and hold what it returns; and the
per-entry biases the summary and the attention mask read. A mixin of `LossyLayer` (``lossy/layer.py``), kept apart so
that the layer class holds the cache interface and this the summary step; it reads the layer's state (residual,
blocks, sink block, query buffer, budget) and is not used on its own."""

from __future__ import annotations

import time
import weakref

import torch

from ..layer.storage import Block, owned
from .blocks import LossyBlock, block_bias
from .queries import group_by_kv_head, proxy_queries, reposition
from .region import FitContext, Region, gather_entries

NEG_INF = float("-inf")


class SummaryMixin:
    """The summary step and the per-entry biases of a `LossyLayer` (see the module docstring)."""

    @torch.no_grad()
    def summarize(self, current: tuple[torch.Tensor, int, torch.Tensor | None] | None = None) -> None:
        """Shrink this layer to its budget now (less the room its kept queries will take until the next summary):
        sinks and the recent window stay exact, the method replaces the rest. ``current``: the queries of the
        forward in progress (``(queries, first_position, valid)``), fitted on with the kept ones and then
        forgotten with them. Records the wall time in ``summary_seconds``."""
        start = time.perf_counter()
        self.pending = False
        self.since_summary = 0
        budget = max(0, self.budget_bytes() - self.query_reserve())
        per_token = self.token_bytes
        # a prune's replay scores and queries (KVzip's `ReplayState`), used by this summary and then let go
        replay, self.replay_state = self.replay_state, None
        scores, replayed = (None, None) if replay is None else (replay.scores, replay.queries)
        if self.sink_block is None:
            prior = sum(block.entries for block in self.blocks)
            rest = self._make_sink_block(budget // per_token)
            if scores is not None and rest is not None:  # the sinks left the residual: so do their scores
                scores = torch.cat([scores[..., :prior], torch.gather(
                    scores[..., prior:], 2, rest[:, None, :].expand(-1, scores.shape[1], -1))], dim=-1)
        elif scores is not None:
            scores = scores[..., self.sink_block.entries:]
        sink_bytes = 0 if self.sink_block is None else self.sink_block.nbytes() // max(self.rows, 1)
        window = min(self.residual_tokens, self.residual_length)
        # the padding mask is kept (and paid for, one byte per token) only while the window still holds padding
        held_pad = self.residual_valid is not None and window > 0 and not bool(self.residual_valid[:, -window:].all())
        valid_bytes = int(held_pad)
        window = max(0, min(window, (budget - sink_bytes) // (per_token + valid_bytes)))
        region = self._region(window)
        context_keys, context_values, context_bias = self._context(window)
        positions = None
        if replayed is not None:
            # the replay's queries (`methods.kvzip.replay`): unpadded rows, at their own positions, which lie after
            # the context like those of the queries that will read the summary
            queries = group_by_kv_head(replayed, self.residual_keys.shape[1])
            weight = torch.ones(queries.shape[:-1], device=queries.device)
        elif self.method.needs_queries:
            queries, weight, positions = self._reference_queries(current)
        else:  # streaming and plain SVD never look at queries
            queries = weight = torch.zeros(self.rows, self.residual_keys.shape[1], 0, device=self.residual_keys.device)
        ctx = FitContext(
            queries,
            weight,
            context_keys,
            context_values,
            context_bias,
            self.scaling or self.residual_keys.shape[-1] ** -0.5,
            self.attached,
            self.lossy,
            positions,
            self.seen_tokens,
            _rope_inv_freq(self.model),
            None if scores is None else scores[..., : region.entries],
        )
        middle = max(0, budget - sink_bytes - window * (per_token + valid_bytes))
        made = self.method.compress(region, middle, ctx)
        self.blocks = ([self.sink_block] if self.sink_block is not None else []) + made
        self.block_starts = [0] * len(self.blocks)
        keep = self.residual_length - window
        self.residual_keys = owned(self.residual_keys[..., keep:, :])
        self.residual_values = owned(self.residual_values[..., keep:, :])
        if self.residual_valid is not None:
            self.residual_valid = owned(self.residual_valid[:, keep:])
            if bool(self.residual_valid.all()):
                self.residual_valid = None
        self.query_buffer.clear()
        self.summary_seconds.append(time.perf_counter() - start)

    def _make_sink_block(self, max_tokens: int) -> torch.Tensor | None:
        """The first ``sinks`` real (non-padding) tokens of each row, taken out of the residual for good; returns the
        residual entries that stay (``[b, length - sinks]`` indices), None if no sink was taken."""
        length = self.residual_length
        old = length - min(self.residual_tokens, length)
        count = min(self.lossy.sinks, old, max(0, max_tokens))
        if count <= 0:
            return None
        live = self._residual_live()
        order = torch.arange(length, device=live.device).expand(live.shape[0], -1)
        # real tokens of the old part first, in order: the first `count` are each row's sinks
        late = (~live) | (order >= old)
        index = (order + late.long() * length).argsort(dim=-1)[:, :count].sort(dim=-1).values
        taken = torch.zeros_like(live).scatter(1, index, True)
        rest = (order + taken.long() * length).argsort(dim=-1)[:, : length - count].sort(dim=-1).values
        sink_live = torch.gather(live, 1, index)
        heads = self.residual_keys.shape[1]
        bias = torch.where(sink_live, 0.0, NEG_INF)[:, None, :].expand(-1, heads, -1)
        self.sink_block = LossyBlock(
            _gather_rows(self.residual_keys, index),
            _gather_rows(self.residual_values, index),
            None if bool(sink_live.all()) else bias.to(self.dtype).contiguous(),
            tokens=count,
        )
        self.residual_keys = _gather_rows(self.residual_keys, rest)
        self.residual_values = _gather_rows(self.residual_values, rest)
        if self.residual_valid is not None:
            self.residual_valid = torch.gather(self.residual_valid, 1, rest)
        return rest

    def _region(self, window: int) -> Region:
        """Everything between the sinks and the last ``window`` residual tokens."""
        blocks = [block for block in self.blocks if block is not self.sink_block]
        old = self.residual_length - window
        keys = [block.read()[0] for block in blocks] + [self.residual_keys[..., :old, :]]
        values = [block.read()[1] for block in blocks] + [self.residual_values[..., :old, :]]
        bias = [self._bias_of(block) for block in blocks] + [self._residual_bias()[..., :old]]
        sink_tokens = 0 if self.sink_block is None else self.sink_block.tokens
        return Region(
            torch.cat(keys, dim=-2), torch.cat(values, dim=-2), torch.cat(bias, dim=-1),
            tokens=self.seen_tokens - window - sink_tokens,
        )

    def _context(self, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The exact entries a summary keeps around the region: sinks and the recent window."""
        old = self.residual_length - window
        keys = [self.residual_keys[..., old:, :]]
        values = [self.residual_values[..., old:, :]]
        bias = [self._residual_bias()[..., old:]]
        if self.sink_block is not None:
            keys.insert(0, self.sink_block.keys)
            values.insert(0, self.sink_block.values)
            bias.insert(0, self._bias_of(self.sink_block))
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2), torch.cat(bias, dim=-1)

    def _reference_queries(
        self, current: tuple[torch.Tensor, int, torch.Tensor | None] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``([b, h, m, d] float32, [b, h, m], positions)``: queries (moved to future positions, or at their own for a
        method registered with ``own_positions``, then with their ``[m / groups]`` positions) and their weights."""
        heads = self.residual_keys.shape[1]
        if self.attached and (current is not None or len(self.query_buffer)):
            queries, positions, valid = self.query_buffer.read(current, self.lossy.reference_queries)
        else:
            # no model: the most recent keys stand in for queries
            queries = proxy_queries(self.residual_keys, self.lossy.reference_queries).float()
            count = queries.shape[-2]
            positions = torch.arange(self.seen_tokens - count, self.seen_tokens, device=queries.device)
            valid = self._residual_live()[:, -count:]
        if not self.method.own_positions:
            queries = reposition(
                queries, positions, now=self.seen_tokens, horizon=self.lossy.query_horizon,
                inv_freq=_rope_inv_freq(self.model),
            )
        grouped = group_by_kv_head(queries, heads)
        groups = grouped.shape[-2] // valid.shape[-1]
        weight = valid.float().repeat(1, groups)[:, None, :].expand(-1, heads, -1)
        return grouped, weight, positions if self.method.own_positions else None

    # ------------------------------------------------------------------ biases

    def _residual_live(self) -> torch.Tensor:
        if self.residual_valid is None:
            return torch.ones(self.rows, self.residual_length, dtype=torch.bool, device=self.residual_keys.device)
        return self.residual_valid

    def _residual_bias(self) -> torch.Tensor:
        live = self._residual_live()
        heads = self.residual_keys.shape[1]
        return torch.where(live, 0.0, NEG_INF)[:, None, :].expand(-1, heads, -1).float()

    def _bias_of(self, block: Block) -> torch.Tensor:
        bias = block_bias(block)
        if bias is None:
            return torch.zeros(self.rows, self.residual_keys.shape[1], block.entries, device=self.residual_keys.device)
        return bias.float()

    def _held_bias(self, held: int) -> torch.Tensor | None:
        """``[b, h, held]`` float32 biases of the entries held before this forward's tokens, or None if all zero."""
        if all(block_bias(block) is None for block in self.blocks) and self.residual_valid is None:
            return None
        bias = torch.cat([self._bias_of(block) for block in self.blocks] + [self._residual_bias()], dim=-1)
        return bias[..., :held]


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Entries ``index`` (``[b, t]``, per batch row, shared by all heads) of ``x`` (``[b, h, n, d]``)."""
    return gather_entries(x, index[:, None, :].expand(-1, x.shape[1], -1))


#: attached model -> its rotary embedding module (or None): looked up once per model, not at every summary of every
#: layer (walking SmolLM2's modules 30 times cost 0.03 s of a 2,048-token prefill's summaries); its ``inv_freq`` is
#: read at each summary (dynamic RoPE variants update it)
_ROTARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rope_inv_freq(model: torch.nn.Module | None) -> torch.Tensor | None:
    """The RoPE frequencies of an attached model (None without a model or rotary embedding)."""
    if model is None:
        return None
    if model not in _ROTARY:
        _ROTARY[model] = next((module for name, module in model.named_modules()
                               if name.endswith("rotary_emb") and hasattr(module, "inv_freq")), None)
    rotary = _ROTARY[model]
    return None if rotary is None else rotary.inv_freq.detach().float().cpu()
