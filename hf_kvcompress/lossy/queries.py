"""Reference queries: what summaries are fitted against.

The cache never sees queries, so when a model is attached, the lossy attention function (`attention.py`) hands
each layer the post-RoPE queries of every forward pass, exactly as attention used them. A layer keeps the most
recent ``reference_queries`` of them (per query head) in a `QueryBuffer`.

Past queries are not future queries: with RoPE, a query at position p scores a key at position j through
``p - j``, and the entries a summary keeps will be scored by queries at positions *after* the summary. So before
fitting, `reposition` rotates every buffered query from its own position to a position spread over the next
``query_horizon`` tokens (RoPE rotations compose: ``R(p') = R(p' - p) R(p)``). On SmolLM2 this halves the
held-out attention error of fitted summaries against using the raw past queries (see docs/lossy.md).

Without a model (``CompressedCache(config)`` alone) there are no queries: `proxy_queries` uses the cached keys
themselves as stand-ins, which is much weaker.
"""

from __future__ import annotations

import torch


class QueryBuffer:
    """The last ``capacity`` queries of one layer: ``[batch, q_heads, m, head_dim]`` with, per query, its physical
    index in the layer's token stream (``[m]``) and a validity mask (``[batch, m]``, False for padding)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.queries: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.queries is None else self.queries.shape[-2]

    def add(self, queries: torch.Tensor, first_position: int, valid: torch.Tensor | None) -> None:
        """Append ``queries`` (``[b, hq, q, d]``) of physical positions ``first_position ...``."""
        q = queries.detach()[..., -self.capacity :, :]
        count = q.shape[-2]
        start = first_position + queries.shape[-2] - count
        pos = torch.arange(start, start + count, device=q.device)
        ok = (
            torch.ones(q.shape[0], count, dtype=torch.bool, device=q.device)
            if valid is None
            else valid[:, -count:].to(q.device)
        )
        if self.queries is None or self.queries.shape[:2] != q.shape[:2]:
            self.queries, self.positions, self.valid = q.clone(), pos, ok
        else:
            self.queries = torch.cat([self.queries, q], dim=-2)[..., -self.capacity :, :]
            self.positions = torch.cat([self.positions, pos])[-self.capacity :]
            self.valid = torch.cat([self.valid, ok], dim=-1)[:, -self.capacity :]

    def select_rows(self, index: torch.Tensor) -> None:
        if self.queries is not None:
            self.queries = self.queries.index_select(0, index.to(self.queries.device))
            self.valid = self.valid.index_select(0, index.to(self.valid.device))

    def drop_after(self, position: int) -> None:
        """Forget queries at physical positions >= ``position`` (after a crop)."""
        if self.queries is not None:
            keep = self.positions < position
            self.queries, self.positions, self.valid = self.queries[..., keep, :], self.positions[keep], self.valid[:, keep]

    def to(self, device: torch.device | str) -> None:
        if self.queries is not None:
            self.queries, self.positions, self.valid = (t.to(device) for t in (self.queries, self.positions, self.valid))

    def clear(self) -> None:
        self.queries = self.positions = self.valid = None

    def nbytes(self) -> int:
        if self.queries is None:
            return 0
        return self.queries.numel() * self.queries.element_size() + self.valid.numel() + 8 * self.positions.numel()


def rotate(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE'd vectors ``x`` (``[..., m, d]``) forward by ``shift`` (``[m]``) positions (half-split layout,
    as Llama/Qwen apply it). Only the first ``2 * len(inv_freq)`` channels rotate (partial rotary)."""
    rot = 2 * inv_freq.shape[0]
    # float64 angles: shifts of thousands of positions times inv_freq ~ 1 lose phase in float32
    angle = shift.to(torch.float64)[:, None] * inv_freq.to(device=x.device, dtype=torch.float64)[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1).to(x.dtype)
    head, tail = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated_half = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    return torch.cat([head * cos + rotated_half * sin, tail], dim=-1)


def reposition(
    queries: torch.Tensor,
    positions: torch.Tensor,
    *,
    now: int,
    horizon: int,
    inv_freq: torch.Tensor | None,
    seed: int = 0,
) -> torch.Tensor:
    """Move queries from their own positions to positions spread evenly (in a fixed shuffled order) over
    ``[now, now + horizon)``: the positions the queries that will read this summary actually have."""
    if inv_freq is None or horizon <= 0:
        return queries
    m = queries.shape[-2]
    gen = torch.Generator().manual_seed(seed)
    targets = now + (torch.arange(m, dtype=torch.float64) * horizon / max(m, 1)).floor()
    targets = targets[torch.randperm(m, generator=gen)]
    return rotate(queries, targets.to(positions.device) - positions.to(torch.float64), inv_freq)


def group_by_kv_head(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, hq, m, d]`` -> ``[b, kv_heads, groups * m, d]``: the queries each KV head serves (GQA)."""
    b, hq, m, d = queries.shape
    groups = hq // kv_heads
    return queries.reshape(b, kv_heads, groups * m, d)


def proxy_queries(keys: torch.Tensor, count: int) -> torch.Tensor:
    """Without a model: the most recent ``count`` keys stand in for queries (``[b, h, m, d]``)."""
    return keys[..., -count:, :]
