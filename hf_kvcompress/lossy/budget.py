"""Budget accounting: how many bytes a lossy layer may hold, and what an entry costs."""

from __future__ import annotations

import math

from ..config import LossyConfig


def token_bytes(kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes one text position costs in a full cache, per batch row (its key and value over all KV heads)."""
    return 2 * kv_heads * head_dim * element_size


def budget_bytes(config: LossyConfig, seen_tokens: int, per_token: int) -> int:
    """Bytes one batch row of a layer may hold after a summary.

    A float budget is a fraction of what the full cache would hold for ``seen_tokens`` positions; an int budget
    is a number of token-equivalents. Side data (biases, factors, masks) counts against it.
    """
    if isinstance(config.budget, float):
        return math.floor(config.budget * seen_tokens * per_token)
    return config.budget * per_token


def entry_bytes(kv_heads: int, head_dim: int, element_size: int, *, with_bias: bool, value_rank: int | None = None) -> int:
    """Bytes of one kept entry per batch row: its key, its value (or its row of value factors at ``value_rank``)
    and its bias when biases are stored."""
    value = head_dim if value_rank is None else value_rank
    return kv_heads * element_size * (head_dim + value + (1 if with_bias else 0))
