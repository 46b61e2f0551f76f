"""The data a compression method works on: the compressible region of one layer and the fit context."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .products import linear, linear_each
from .settings import LossyConfig

LOG2E = 1.0 / math.log(2.0)


@dataclass
class Region:
    """Entries of one layer that a summary may replace (everything older than the recent window, sinks excluded).

    ``keys``/``values``: ``[batch, kv_heads, n, head_dim]`` in the cache dtype; ``bias``: ``[batch, kv_heads, n]``
    float32 logit biases (0 for plain tokens, fitted log-weights for earlier summary entries, ``-inf`` for dead
    entries such as padding); ``tokens``: text positions the region stands for.
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    tokens: int

    @property
    def entries(self) -> int:
        return self.keys.shape[-2]

    @property
    def live(self) -> torch.Tensor:
        """``[b, h, n]`` bool: entries attention can actually see."""
        return torch.isfinite(self.bias)

    def gather(self, index: torch.Tensor) -> Region:
        """The entries ``index`` (``[b, h, t]``) of every row and head, in that order."""
        return Region(
            gather_entries(self.keys, index),
            gather_entries(self.values, index),
            torch.gather(self.bias, 2, index),
            self.tokens,
        )


@dataclass
class FitContext:
    """What a method may use besides the region itself.

    ``queries``: ``[batch, kv_heads, m, head_dim]`` float32 reference queries per KV head (already moved to future
    positions), ``query_weight``: ``[batch, kv_heads, m]`` (0 for padding queries); ``context_*``: the entries that
    stay exact (sinks and recent window) in the same layout as a `Region`, so fits can weight each query by how much
    of its attention the region really gets; ``scaling``: the attention scale; ``attached``: a model is attached,
    so the lossy attention function applies per-entry biases and builds each layer's mask (layers may then hold
    different numbers of entries; without it every layer must hold the same number); ``config``: the lossy
    parameters. For a method registered with ``own_positions`` (`registry.LossyMethod`): the queries stay at their
    own positions, ``positions`` (``[m']``, ``m' = query count / query-head group``: the same for every head of a
    group, whose queries lie group after group along the query axis) says which, ``now`` is the number of
    positions seen and ``inv_freq`` the model's RoPE frequencies (None without RoPE). ``scores``: ``[b, h, n]`` the
    region's scores from a context replay (KVzip, `methods.kvzip.compress_context`), None without one.
    """

    queries: torch.Tensor
    query_weight: torch.Tensor
    context_keys: torch.Tensor
    context_values: torch.Tensor
    context_bias: torch.Tensor
    scaling: float
    attached: bool
    config: LossyConfig
    positions: torch.Tensor | None = None
    now: int = 0
    inv_freq: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    def logits(self, keys: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, h, m, n]`` float32 attention logits of the reference queries against ``keys``."""
        # the scale goes on the [m, d] queries, not on the [m, n] product
        out = linear(self.queries * self.scaling, keys.float())
        # plain tokens have bias 0 (a 2,048-token prefill's regions): skip an [m, n] pass
        return out if bias is None or not bool(bias.any()) else out.add_(bias[..., None, :])

    def exp_logits(
        self, keys: torch.Tensor, bias: torch.Tensor | None, floor: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(exp(logits - top) [b, h, m, n], top [b, h, m, 1])`` for the `logits` against ``keys`` (``n > 0``),
        ``top`` the row maximum of these logits and of ``floor`` (``[b, h, m, 1]``, the row maximum of the other
        entries the queries see, or None); a row with nothing live gets ``top = 0``.

        One head at a time: its bias, row maximum, shift and exp run while its ``[m, n]`` product is in cache, and
        the exp writes straight into the output (assembling every head's product first cost one more pass over
        the logits: 0.08 s of a 2,048-token prefill's summaries; docs/results/lossy.md, *Fourth look*). In base 2:
        ``exp(l - top) = exp2(l log2(e) - top log2(e))``, the factor folded into the queries' scale, because
        ``torch.exp2`` ran 4.5x faster than ``torch.exp`` on this project's CPU (0.22 against 0.98 ms for
        ``768 x 1980``; both vectorised, within about 1 ulp)."""
        q = self.queries * (self.scaling * LOG2E)
        lead, m, n = q.shape[:-2], q.shape[-2], keys.shape[-2]
        out = q.new_empty(*lead, m, n)
        top = q.new_empty(*lead, m, 1)
        flat_out, flat_top = out.view(-1, m, n), top.view(-1, m, 1)
        flat_bias = bias.reshape(-1, n).float() * LOG2E if bias is not None and bool(bias.any()) else None
        flat_floor = None if floor is None else floor.reshape(-1, m, 1) * LOG2E
        for i, part in linear_each(q, keys.float()):
            if flat_bias is not None:
                part.add_(flat_bias[i])
            row_top = part.amax(-1, keepdim=True)
            if flat_floor is not None:
                row_top = torch.maximum(row_top, flat_floor[i])
            flat_top[i] = torch.nan_to_num(row_top, neginf=0.0)  # a query with nothing live: anything finite
            torch.exp2(part.sub_(flat_top[i]), out=flat_out[i])
        return out, top.mul_(math.log(2.0))


def gather_entries(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, h, index[b, h, j], :]``: entries ``index`` (``[b, h, t]``) of ``x`` (``[b, h, n, d]``) as
    ``[b, h, t, d]``. Whole rows by one ``index_select`` over the flattened entries: ``torch.gather`` with the index
    expanded over ``d`` reads an index per element and took 10x longer (0.24 ms against 0.02 ms for 529 of 1,980
    bfloat16 entries of 3 heads; 40x for the 2,044 of 2,048 rows the sink block leaves in the residual)."""
    b, h, n, d = x.shape
    if index.numel() == 0 or n == 0:
        return x.new_empty(b, h, index.shape[-1], d)
    offsets = torch.arange(b * h, device=index.device).view(b, h, 1) * n
    flat = (index.to(device=x.device, dtype=torch.long) + offsets.to(x.device)).reshape(-1)
    return x.reshape(b * h * n, d).index_select(0, flat).view(b, h, index.shape[-1], d)


def dead_bias_or_none(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A stored bias in the cache dtype, or None where every entry has bias 0 (nothing to store)."""
    if bool((bias == 0).all()):
        return None
    return bias.to(dtype)

