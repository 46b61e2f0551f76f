"""KVzip (Kim et al. 2025, https://arxiv.org/abs/2505.23416): score each cached entry by how much the model needs it
to *reconstruct the context*: after the context, feed a repeat prompt ("Repeat the previous context:") followed by
the context again; an entry's score is the largest attention weight any query of that replay (any query head of its
KV head's group) gives it; then prune across all layers and heads at once, keeping the best-scored entries of the
whole cache.

Two ways in:
- `compress_context(model, cache, context_ids, repeat_ids)`: the paper's method. The context is prefilled with no
  summary (held whole: KVzip needs the whole context before its replay; with ``chunk_size`` the prefill and the
  replay run in chunks, which bounds the activations, not the cache), the replay scores every held entry
  (`ReplayState.score`, each layer's replay state; the replay's own entries are cropped off afterwards), one threshold over the scores of
  every layer's region (all rows' selections averaged per layer) sets each layer's share of the budget
  (`LossyLayer.budget_share`), and each layer then keeps its best entries, per head as many as pass (heads hold
  different numbers: `blocks.RaggedBlock`). Batches must not be padded (refused).
- As a registered method (``LossyConfig(method="kvzip")``) in `generate` or a chunked prefill, with no replay: every
  summary scores the region by the largest attention weight the reference queries (the forward's own, at their
  positions) give each entry, the same max rule on the queries at hand, and prunes across the layer's heads (not
  across layers: the layers summarise one after the other inside the forward). After `compress_context` the later
  summaries (every ``interval`` tokens) keep each layer's share and score this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...layer.hybrid import RecurrentStateMixin
from ...layer.storage import Block, tensor_nbytes
from ..blocks import RaggedBlock
from ..budget import entry_bytes
from ..matching import Kernel
from ..queries import group_by_kv_head
from ..region import FitContext, Region
from ..registry import METHODS, MethodSettings, register
from ..summarize import NEG_INF
from .adakv import adaptive_keep

#: the repeat prompt of the paper (fed before the context's second pass; tokenize it with the model's tokenizer)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."


def max_attention(region: Region, ctx: FitContext) -> torch.Tensor:
    """``[b, h, n]``: the largest attention weight (softmax over everything the layer holds) any valid reference
    query of the KV head's group gives each region entry."""
    return Kernel(region, ctx).peak()


def _per_entry(region: Region, fmt: str) -> int:
    return entry_bytes(1, region.keys.shape[-1], region.keys.element_size(), with_bias=False, fmt=fmt,
                       value_dim=region.values.shape[-1])


@dataclass(frozen=True)
class KVzipSettings(MethodSettings):
    """KVzip's settings (Kim et al. 2025, https://arxiv.org/abs/2505.23416): the repeat prompt is `REPEAT_PROMPT`
    and the heads share one threshold (no per-head floor); nothing to set."""

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2505.23416"


@register("kvzip", settings=KVzipSettings, needs_queries=True, own_positions=True, context_replay="scores")
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Keep the best-scored entries of all heads of ``region`` together within ``budget`` bytes per batch row: the
    replay's scores when a replay ran (`compress_context`), else the reference queries' largest weights."""
    _, h, n, _ = region.keys.shape
    if n == 0:
        return []
    total = min(h * n, (budget - h * 4) // _per_entry(region, ctx.config.entry_format))  # counts: int32 per head
    if total <= 0:
        return []
    score = max_attention(region, ctx) if ctx.scores is None else ctx.scores.to(region.keys.device).float()
    keep = adaptive_keep(score.masked_fill(~region.live, float("-inf")), total, safeguard=0.0)
    return [RaggedBlock.from_mask(region.keys, region.values, keep, tokens=region.tokens, fmt=ctx.config.entry_format)]


@torch.no_grad()
def compress_context(model, cache, context_ids: torch.Tensor, repeat_ids: torch.Tensor, *,
                     chunk_size: int | None = None) -> None:
    """Prefill ``context_ids`` (``[b, t]``, no padding) into ``cache`` (a lossy `CompressedCache` with method
    ``kvzip`` built with ``model``), replay ``repeat_ids`` (``[b, r]`` or ``[r]``: the tokenized `REPEAT_PROMPT`) and
    the context to score every entry, and prune the whole cache to its budget at once (see the module docstring).
    The same as `hold_context` around the prefill, then `replay` and `prune` (which an evaluation calls apart, to
    score a context once and prune copies of it to several budgets). Any method registered with ``context_replay``
    runs this way (`registry.LossyMethod`; the summary on the replay's queries, `methods.summary_replay`)."""
    if context_ids.dim() != 2 or context_ids.shape[-1] < 1:
        raise ValueError(f"compress_context: context_ids must be [batch, tokens] with tokens >= 1, got {list(context_ids.shape)}")
    with hold_context(cache):
        _forward(model, cache, context_ids, chunk_size or context_ids.shape[-1])
    found = replay(model, cache, context_ids, repeat_ids, chunk_size=chunk_size)
    prune(cache, found.scores, found.queries)


def kvzip_layers(cache) -> list[Any]:
    """The lossy layers of ``cache`` that run KVzip's replay (a method registered with ``context_replay``); refuses
    a cache with none, or with layers a replay would change in a way cropping cannot undo."""
    layers = [layer for layer in cache.layers if getattr(layer, "replay_state", False) is None
              and getattr(getattr(layer, "method", None), "context_replay", None) is not None]
    if not layers:
        names = " or ".join(repr(name) for name, method in METHODS.items() if method.context_replay is not None)
        raise ValueError(f"compress_context: the cache has no lossy layer with method {names} "
                         "(CompressedCache(CompressionConfig(mode='lossy', lossy=LossyConfig(method='kvzip')), model=model))")
    # the replay's tokens are cropped off afterwards: a sliding window would have let context entries go for them,
    # a recurrent state would keep them
    others = sorted({type(layer).__name__ for layer in cache.layers
                     if not any(layer is kept for kept in layers) or isinstance(layer, RecurrentStateMixin)})
    if others:
        raise ValueError(f"compress_context: the cache also holds {', '.join(others)} layers, which the replay would "
                         "change in a way cropping cannot undo (sliding windows drop context entries, recurrent "
                         "states absorb the replay); KVzip's replay needs full-attention layers only")
    return layers


@contextlib.contextmanager
def hold_context(cache) -> Iterator[list[Any]]:
    """While inside, ``cache``'s KVzip layers hold everything they get, summarising nothing (a prefill of the context
    by ``model(...)`` or by `hf_kvcompress_eval`'s replay of captured states); yields the layers."""
    layers = kvzip_layers(cache)
    try:
        for layer in layers:
            layer.replay_state = ReplayState("hold")
        yield layers
    finally:
        for layer in layers:
            layer.replay_state = None


#: logits one scoring step of a replay (`ReplayState.score`) holds: one batch row and KV head, as many replay rows
#: as fit. On CPU 2**20 float32 (4 MiB) stays in cache: a layer's scoring at 2,048 tokens, batch 10, went from 7.6 s
#: (256 rows of every batch row and head at once, broadcast matmul) to 2.2 s (docs/results/long_context.md, "The
#: replay's cost"); a GPU takes larger steps to keep its launches few
REPLAY_LOGITS = {"cpu": 1 << 20, "cuda": 1 << 26}
#: a replay's phases: the context held whole (no summary), the replay's forwards scoring what is held, the prune's
#: summary reading the scores
PHASES = ("hold", "score", "prune")


@dataclass
class ReplayState:
    """One layer's part of a context replay (`LossyLayer.replay_state` while one runs): its phase (`PHASES`);
    ``scores`` ``[b, h, held]`` float32, the most attention any replay query gave each entry held before the replay;
    ``picks`` ``[r]``, the physical positions of the replay queries to keep (a method registered with
    ``context_replay="queries"``); ``queries`` ``[b, q_heads, m, head_dim]`` float32, those kept so far, then the
    reference queries of the prune's summary (`SummaryMixin.summarize`)."""

    phase: str
    scores: torch.Tensor | None = None
    picks: torch.Tensor | None = None
    queries: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"ReplayState.phase must be one of {list(PHASES)}, got {self.phase!r}")

    @property
    def scoring(self) -> bool:
        """Whether the layer's forwards are the replay (they score the entries held before it)."""
        return self.phase == "score"

    def nbytes(self) -> int:
        """The bytes the state holds (counted in the layer's `held_bytes` between the replay and the prune)."""
        return sum(tensor_nbytes(t) for t in (self.scores, self.picks, self.queries))

    @torch.no_grad()
    def score(self, layer: Any, query: torch.Tensor, count: int) -> None:
        """A replay forward over ``layer``: keep, per entry held before the replay, the most attention any replay
        query (of any head of its group) gives it, softmax over everything the query sees (held entries, the replay
        so far).

        One batch row and KV head at a time, in steps of replay rows: each step's logits stay in cache (a batched
        step was memory-bound), a query's weights come as ``exp(logit - logsumexp)`` (no softmax tensor is
        written), and a step reads only the keys its rows can see (the replay is causal)."""
        keys = layer.keys  # every held entry, then the replay's tokens (all still exact in the residual)
        held = self.scores.shape[-1] if self.scores is not None else keys.shape[-2] - count
        total = keys.shape[-2]
        before = total - count  # the entries held before this forward
        bias = layer._held_bias(before)
        b, heads = keys.shape[:2]
        scale = layer.scaling or keys.shape[-1] ** -0.5
        grouped = group_by_kv_head(query.float() * scale, heads)  # [b, h, g * q, d]
        groups = grouped.shape[-2] // count
        grouped = grouped.view(b, heads, groups, count, -1)
        keys_t = keys.float().transpose(-1, -2)  # [b, h, d, total]
        limit = REPLAY_LOGITS["cuda" if keys.is_cuda else "cpu"]
        step = max(1, min(count, limit // max(1, groups * total)))
        # the query at replay position i sees every earlier entry and itself: causal within the step's own rows
        future = torch.ones(step, step, dtype=torch.bool, device=keys.device).triu(1)
        best = torch.full((b, heads, held), NEG_INF, device=keys.device)
        for row in range(b):
            for head in range(heads):
                top = best[row, head]
                for start in range(0, count, step):
                    end = min(count, start + step)
                    seen = before + end
                    logits = grouped[row, head, :, start:end] @ keys_t[row, head, :, :seen]  # [g, r, seen]
                    if bias is not None:
                        logits[..., :before] += bias[row, head]
                    logits[..., before + start :].masked_fill_(future[: end - start, : end - start], NEG_INF)
                    logits = logits[..., :held].sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
                    torch.maximum(top, logits.amax(dim=(0, 1)), out=top)
        best = best.exp_()
        # new tensors, never written in place: a checkpoint's shallow copy keeps the state before a failed step
        self.scores = best if self.scores is None else torch.maximum(self.scores, best)
        if self.picks is not None:  # the replay queries this layer's method fits on
            first = layer.seen_tokens - count
            picks = self.picks[(self.picks >= first) & (self.picks < first + count)] - first
            kept = query[..., picks.to(query.device), :].float()
            self.queries = kept if self.queries is None else torch.cat([self.queries, kept], -2)


@dataclass
class Replay:
    """What a context replay found, per replay layer of the cache (`kvzip_layers`): ``scores`` ``[b, h, held]``
    float32 (the most attention any replay query gives each held entry); ``queries`` ``[b, q_heads, m, head_dim]``
    float32, the replay queries a layer whose method keeps them (``context_replay="queries"``) sampled, evenly spaced
    over the replay, ``m = min(reference_queries, replay length)``; None for the other layers."""

    scores: list[torch.Tensor]
    queries: list[torch.Tensor | None]


@torch.no_grad()
def replay(model, cache, context_ids: torch.Tensor, repeat_ids: torch.Tensor, *,
           chunk_size: int | None = None) -> Replay:
    """Replay ``repeat_ids`` and the context over ``cache`` (which holds ``context_ids`` whole, `hold_context`) and
    return what the replay layers found (`Replay`). The replay's own entries are cropped off again: the cache is
    left as it was."""
    layers = kvzip_layers(cache)
    if context_ids.dim() != 2 or context_ids.shape[-1] < 1:
        raise ValueError(f"compress_context: context_ids must be [batch, tokens] with tokens >= 1, got {list(context_ids.shape)}")
    repeat_ids = repeat_ids.expand(context_ids.shape[0], -1) if repeat_ids.dim() == 1 else repeat_ids
    length = context_ids.shape[-1] + repeat_ids.shape[-1]
    step = chunk_size or length
    end = cache.get_seq_length()
    try:
        for layer in layers:
            layer.replay_state = ReplayState("score")
            if layer.method.context_replay == "queries":
                picks = torch.linspace(0, length - 1, min(layer.lossy.reference_queries, length), dtype=torch.float64)
                layer.replay_state.picks = end + picks.round().long().unique()
        _forward(model, cache, torch.cat([repeat_ids.to(context_ids.device), context_ids], dim=-1), step)
        cache.crop(end - cache.get_seq_length())  # the replay's own entries (exact, in the residual) go
        found = Replay([layer.replay_state.scores for layer in layers], [layer.replay_state.queries for layer in layers])
    finally:
        for layer in layers:
            layer.replay_state = None
    return found


def replay_scores(model, cache, context_ids: torch.Tensor, repeat_ids: torch.Tensor, *,
                  chunk_size: int | None = None) -> list[torch.Tensor]:
    """`replay`'s scores: per KVzip layer of ``cache`` ``[b, h, held]`` float32."""
    return replay(model, cache, context_ids, repeat_ids, chunk_size=chunk_size).scores


def prune(cache, scores: list[torch.Tensor], queries: list[torch.Tensor | None] | None = None) -> None:
    """Prune ``cache``'s KVzip layers (holding the context whole) to their budget across layers by ``scores``
    (`Replay.scores` of the same context; read, not changed, so one scoring serves several budgets); ``queries``
    (`Replay.queries`): the reference queries of the layers whose method keeps them."""
    layers = kvzip_layers(cache)
    queries = [None] * len(layers) if queries is None else queries
    if len(scores) != len(layers) or len(queries) != len(layers):
        raise ValueError(f"prune: {len(scores)} score tensors and {len(queries)} query tensors for {len(layers)} "
                         "KVzip layers")
    for layer, score, query in zip(layers, scores, queries):
        if score.shape[-1] != layer.residual_length + sum(block.entries for block in layer.blocks):
            raise ValueError(f"prune: layer {layer.layer_idx} holds other entries than its scores cover "
                             f"({score.shape[-1]} scores)")
        if (query is None) != (layer.method.context_replay != "queries"):
            raise ValueError(f"prune: layer {layer.layer_idx} (method {layer.method.name!r}) needs "
                             f"{'the replay queries' if query is None else 'no replay queries'}")
        layer.replay_state = ReplayState("prune", scores=score.clone(), queries=query)
    _share_budget(layers)
    for layer in layers:
        if layer.over_budget():
            layer.summarize()  # reads the state's scores and queries, and lets it go
        layer.replay_state = None


def _forward(model, cache, ids: torch.Tensor, step: int) -> None:
    for start in range(0, ids.shape[-1], step):
        model(ids[:, start : start + step], cache=cache, logits_to_keep=1)


def _share_budget(layers: list[Any]) -> None:
    """One threshold over every layer's region scores (per batch row; the rows' counts averaged per layer) sets each
    layer's `budget_share`: the layers together keep what their uniform budgets would."""
    parts, room = [], 0
    for layer in layers:
        layer.budget_share = None  # the uniform budget, to share out
        scores = layer.replay_state.scores
        sinks = layer.sink_block.entries if layer.sink_block is not None else min(layer.lossy.sinks, scores.shape[-1])
        window = min(layer.residual_tokens, scores.shape[-1] - sinks)
        keys, values = layer.residual_keys, layer.residual_values
        per_entry = entry_bytes(1, keys.shape[-1], keys.element_size(), with_bias=False,
                                fmt=layer.lossy.entry_format, value_dim=values.shape[-1])
        free = max(0, layer.budget_bytes() - layer.fixed_bytes())
        parts.append((layer, scores[..., sinks : scores.shape[-1] - window], free, per_entry))
        room += max(0, free - 4 * keys.shape[1])  # less the block's counts
    rows = parts[0][1].shape[0]
    flat = torch.cat([region.reshape(rows, -1) for _, region, _, _ in parts], dim=-1)
    per_entry = max(part[3] for part in parts)
    total = min(flat.shape[-1], room // per_entry)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if total > 0:
        keep.scatter_(-1, flat.topk(total, dim=-1).indices, True)
    at = 0
    for layer, region, free, _ in parts:
        count = region[0].numel()
        taken = keep[:, at : at + count].sum(-1).float().mean().item()
        at += count
        counts = 4 * layer.residual_keys.shape[1]
        # half a byte over: the layer's floor of ``free * share`` must not lose the last entry to rounding
        layer.budget_share = (taken * per_entry + counts + 0.5) / free if free > 0 else 1.0
