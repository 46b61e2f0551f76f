"""Reference queries: what summaries are fitted against.

The cache never sees queries, so when a model is attached, the lossy attention function (`attention.py`) hands
each layer the post-RoPE queries of every forward pass, exactly as attention used them. A summary is fitted on
the last ``reference_queries`` of them: those of the forward that triggers it (used where they are, never kept)
plus the ones the layer kept since its last summary. Between summaries a layer keeps at most
``min(kept_queries, interval)`` queries per query head in a `QueryBuffer` (int8 with a float16 scale per vector;
counted in ``held_bytes`` and reserved in the budget); after a summary it forgets them.

Past queries are not future queries: with RoPE, a query at position p scores a key at position j through
``p - j``, and the entries a summary keeps will be scored by queries at positions *after* the summary. So before
fitting, `reposition` rotates every buffered query from its own position to a position spread over the next
``query_horizon`` tokens (RoPE rotations compose: ``R(p') = R(p' - p) R(p)``). On SmolLM2 this halves the
held-out attention error of fitted summaries against using the raw past queries (see docs/lossy.md).

Without a model there are no queries: `CompressedCache` refuses the query-scored methods then
(`refusals.require_model`); `proxy_queries` (the cached keys as stand-ins, much weaker) serves only a `LossyLayer`
driven directly without a model.
"""

from __future__ import annotations

import torch

from .packed import Packed, pack


def query_bytes(q_heads: int, head_dim: int, rows: int) -> int:
    """Bytes one kept query costs per batch row: int8 vector + float16 scale per query head, its validity flag
    (one byte) and its share of the int64 position shared by all rows."""
    return q_heads * (head_dim + 2) + 1 + -(-8 // max(rows, 1))


class QueryBuffer:
    """The last ``capacity`` queries of one layer, ``[batch, q_heads, m, head_dim]`` as int8 with a float16 scale
    per vector (``[batch, q_heads, m, 1]``), with, per query, its physical index in the layer's token stream
    (``[m]``) and a validity mask (``[batch, m]``, False for padding)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.codes is None else self.codes.shape[-2]

    def add(self, queries: torch.Tensor, first_position: int, valid: torch.Tensor | None) -> None:
        """Keep the last ``capacity`` of ``queries`` (``[b, hq, q, d]``, physical positions ``first_position ...``)."""
        if self.capacity <= 0:
            return
        q, pos, ok = _tail(queries.detach(), first_position, valid, self.capacity)
        packed = pack(q, "int8")
        codes, scales = packed.codes, packed.scales
        if self.codes is None or self.codes.shape[:2] != codes.shape[:2]:
            self.codes, self.scales, self.positions, self.valid = codes, scales, pos, ok
            return
        keep = self.capacity
        # cat makes new tensors; slicing the last `keep` of them along dim -2 would pin the whole cat buffer
        self.codes = torch.cat([self.codes, codes], dim=-2)[..., -keep:, :].clone()
        self.scales = torch.cat([self.scales, scales], dim=-2)[..., -keep:, :].clone()
        self.positions = torch.cat([self.positions, pos])[-keep:].clone()
        self.valid = torch.cat([self.valid, ok], dim=-1)[:, -keep:].clone()

    def read(
        self, current: tuple[torch.Tensor, int, torch.Tensor | None] | None, limit: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(queries [b, hq, m, d] float32, positions [m], valid [b, m])``: the kept queries followed by
        ``current`` (``(queries, first_position, valid)`` of the forward in progress, used as they are), the last
        ``limit`` of them."""
        parts = []
        if self.codes is not None:
            parts.append((Packed(self.codes, self.scales, torch.float32).unpack(), self.positions, self.valid))
        if current is not None:
            q, pos, ok = _tail(current[0].detach(), current[1], current[2], limit)
            parts.append((q.float(), pos, ok))
        if not parts:
            raise ValueError("QueryBuffer.read: no queries kept and none given")
        queries = torch.cat([p[0].to(parts[-1][0].device) for p in parts], dim=-2)[..., -limit:, :]
        positions = torch.cat([p[1].to(parts[-1][1].device) for p in parts])[-limit:]
        valid = torch.cat([p[2].to(parts[-1][2].device) for p in parts], dim=-1)[:, -limit:]
        return queries, positions, valid

    def select_rows(self, index: torch.Tensor) -> None:
        if self.codes is not None:
            self.codes = self.codes.index_select(0, index.to(self.codes.device))
            self.scales = self.scales.index_select(0, index.to(self.scales.device))
            self.valid = self.valid.index_select(0, index.to(self.valid.device))

    def drop_after(self, position: int) -> None:
        """Forget queries at physical positions >= ``position`` (after a crop)."""
        if self.codes is not None:
            keep = self.positions < position
            self.codes, self.scales = self.codes[..., keep, :], self.scales[..., keep, :]
            self.positions, self.valid = self.positions[keep], self.valid[:, keep]

    def to(self, device: torch.device | str) -> None:
        if self.codes is not None:
            self.codes, self.scales, self.positions, self.valid = (
                t.to(device) for t in (self.codes, self.scales, self.positions, self.valid)
            )

    def clear(self) -> None:
        self.codes = self.scales = self.positions = self.valid = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this buffer holds."""
        return [t for t in (self.codes, self.scales, self.positions, self.valid) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _tail(
    queries: torch.Tensor, first_position: int, valid: torch.Tensor | None, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last ``count`` queries of a forward with their positions and validity."""
    q = queries[..., -count:, :]
    kept = q.shape[-2]
    start = first_position + queries.shape[-2] - kept
    pos = torch.arange(start, start + kept, device=q.device)
    ok = (
        torch.ones(q.shape[0], kept, dtype=torch.bool, device=q.device)
        if valid is None
        else valid[:, -kept:].to(q.device).clone()
    )
    return q, pos, ok


def rotate(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE'd vectors ``x`` (``[..., m, d]``) forward by ``shift`` (``[m]``) positions (half-split layout,
    as Llama/Qwen apply it). Only the first ``2 * len(inv_freq)`` channels rotate (partial rotary)."""
    # float64 angles: shifts of thousands of positions times inv_freq ~ 1 lose phase in float32
    angle = shift.to(torch.float64)[:, None] * inv_freq.to(device=x.device, dtype=torch.float64)[None, :]
    return apply_rope(x, angle.cos(), angle.sin())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., m, d]``) times the RoPE-shaped matrix with ``cos`` / ``sin`` (``[m, f]`` or ``[f]``, one per
    frequency) on each channel pair ``(i, i + f)`` (half-split layout): a rotation when ``cos**2 + sin**2 = 1``, an
    average of rotations otherwise (Expected Attention). Only the first ``2 f`` channels change (partial rotary)."""
    rot = 2 * cos.shape[-1]
    cos = torch.cat([cos, cos], dim=-1).to(x.dtype)
    sin = torch.cat([sin, sin], dim=-1).to(x.dtype)
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
