"""Stage 2 of a summary: refit what is kept so the reference queries see the same attention output.

For each reference query q the full layer gives ``o(q) = (N_ctx + N_reg) / (Z_ctx + Z_reg)`` where ``Z`` sums
``exp(logit)`` and ``N`` sums ``exp(logit) v`` over the exact context (sinks, recent window) and over the region.
The summary keeps entries ``j`` with key ``k_j``, weight ``w_j = exp(bias_j)`` and a new value ``c_j``:

1. weights (Attention Matching, Zweiger et al. 2026): non-negative least squares so the kept entries carry the
   region's attention mass, ``sum_j w_j e_qj ~ Z_reg(q)``, each query's residual scaled by ``1 / Z_tot(q)`` (what
   matters is the region's share of the query's attention). Only when the attention path applies biases.
2. values (the OLS "compensation" of the proposal `methods/summary.py` starts from): with ``Z^(q) = Z_ctx + sum_j w_j e_qj``, solve
   ``sum_j (w_j e_qj / Z^) c_j ~ o(q) - N_ctx / Z^`` by ridge least squares, shrinking ``c`` towards the kept
   entries' own values. This matches the total output, so it also works without biases.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from .products import linear, matmul
from .region import FitContext, Region
from .solvers import nnls, ridge_lstsq, ridge_solve, ridge_solve_wide, symmetric_gram


class Kernel:
    """Everything a summary needs about one batch row's reference queries against its region and context,
    computed once: ``region_exp`` ``[1, h, m, n]`` (``exp(logit + bias - top)``, 0 for dead entries),
    ``context_exp`` likewise for the exact context, per-query totals and (on first use) the full output."""

    def __init__(self, region: Region, ctx: FitContext):
        self.region = region
        self.ctx = ctx
        context_logits = ctx.logits(ctx.context_keys, ctx.context_bias)
        # the row maximum over both blocks without concatenating them (an empty block has none)
        context_top = context_logits.amax(-1, keepdim=True) if context_logits.shape[-1] else None
        if region.entries:
            self.region_exp, top = ctx.exp_logits(region.keys, region.bias, context_top)
        else:
            self.region_exp = context_logits.new_empty(*context_logits.shape[:-1], 0)
            top = torch.nan_to_num(context_top, neginf=0.0)  # a query with nothing live: anything finite will do
        self.context_exp = context_logits.sub_(top).exp_()
        self.region_z, self.context_z = self.region_exp.sum(-1), self.context_exp.sum(-1)
        self.query_weight = ctx.query_weight

    @cached_property
    def context_n(self) -> torch.Tensor:
        """``[1, h, m, d]``: the exact context's un-normalised output."""
        return matmul(self.context_exp, self.ctx.context_values.float())

    @cached_property
    def output(self) -> torch.Tensor:
        """``[1, h, m, d]``: the full layer's attention output for each reference query."""
        numerator = matmul(self.region_exp, self.region.values.float()) + self.context_n
        return numerator / self.full_z[..., None]

    @property
    def full_z(self) -> torch.Tensor:
        return self.region_z + self.context_z

    def mass(self) -> torch.Tensor:
        """``[1, h, n]`` mean attention weight per region entry over the valid queries (one mat-vec over the
        kernel, no ``[m, n]`` temporary)."""
        per_query = (self.query_weight / self.full_z)[..., None, :]  # [1, h, 1, m]
        return (per_query @ self.region_exp)[..., 0, :] / self.query_weight.sum(-1, keepdim=True).clamp_min(1e-12)

    def peak(self) -> torch.Tensor:
        """``[b, h, n]`` the largest attention weight any valid query gives each region entry (KVzip's max rule)."""
        weights = self.region_exp / self.full_z[..., None].clamp_min(1e-30)
        return weights.masked_fill(~(self.query_weight > 0)[..., None], 0.0).amax(dim=-2)

    def entropy(self) -> torch.Tensor:
        """``[1, h, n]`` entropy (nats) of each entry's attention over the queries (column-normalised)."""
        weights = self.region_exp / self.full_z[..., None] * self.query_weight[..., None]
        column = weights / weights.sum(-2, keepdim=True).clamp_min(1e-30)
        return -(column * column.clamp_min(1e-30).log()).sum(-2)


@dataclass
class Fit:
    """A fitted summary of one row: float32 ``values`` ``[1, h, t, d]``, ``bias`` ``[1, h, t]``; the normalised
    attention the reference queries give the kept entries is ``columns * weight / summary_z`` (``[1, h, m, t]``,
    see `weights`; None after reordering)."""

    values: torch.Tensor
    bias: torch.Tensor
    columns: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    summary_z: torch.Tensor | None = None
    #: ``[h, t, t]`` the Gram of the kept entries' scaled kernel columns (what `fit_row` reuses for a superset)
    gram: torch.Tensor | None = None

    @property
    def weights(self) -> torch.Tensor:
        """``[1, h, m, t]``: the kept entries' normalised attention weights."""
        return self.columns * self.weight[..., None, :] / self.summary_z[..., None]

    def weights_times(self, u: torch.Tensor) -> torch.Tensor:
        """``weights @ u`` for ``u`` ``[1, h, t, k]`` without the ``[m, t]`` weights."""
        return matmul(self.columns, self.weight[..., None] * u) / self.summary_z[..., None]


#: multiplicative NNLS updates per fit: measured offline on SmolLM2 (docs/lossy.md, *Numerics*), 25 instead of 100 iterations cost
#: +0.0002 in held-out attention error; the kept entries' earlier weights are the warm start
NNLS_ITERS = 25


def fit_row(
    kernel: Kernel,
    region: Region,
    index: torch.Tensor,
    *,
    use_bias: bool,
    ridge: float,
    iters: int = NNLS_ITERS,
    prefix: Fit | None = None,
    weights: bool = True,
    refit: bool = True,
) -> Fit:
    """Fit the entries ``index`` (``[1, h, t]``) of one row's ``region``.

    ``refit``: False keeps the entries as they are (their values and biases; ``use_bias`` must be False): only the
    weights the later stages read are computed.

    ``prefix``: an earlier fit of the same kernel whose entries are the first ``index`` entries of every head: its
    Gram is that block of this one, so only the new entries' rows of the Gram are computed (the value-rank refit
    with more entries). ``weights``: also return the kept entries' normalised attention weights."""
    kept = region.gather(index)
    live = kept.live
    if not refit and use_bias:
        raise ValueError("fit_row: refit=False keeps the biases, use_bias must be False")
    if not refit and not weights:  # the entries as they are, their biases -inf where dead (as a fit leaves them)
        return Fit(kept.values.float(), torch.where(live, kept.bias, torch.full_like(kept.bias, float("-inf"))))
    # the kept entries' kernel columns without their old bias (plain exp(logit - top)); 0 where dead
    base = torch.gather(kernel.region_exp, -1, index[..., None, :].expand(*kernel.region_exp.shape[:-1], -1))
    if bool(kept.bias.any()):  # plain tokens (bias 0) need no pass
        base.mul_(torch.where(live, (-kept.bias).exp(), torch.zeros_like(kept.bias))[..., None, :])
    root_w = kernel.query_weight.sqrt()
    weight = torch.where(live, kept.bias.exp(), torch.zeros_like(kept.bias))
    # each query's rows scaled by sqrt(query weight) / Z: the NNLS design, and (times the weights) the value
    # refit's; one Gram serves both (the refit's is diag(w) G diag(w))
    row_scale = root_w / kernel.full_z
    scaled = base * row_scale[..., None]
    # more kept entries than reference queries (a chunked prefill's later summaries, a long one-shot one): the
    # t x t Gram has rank m at most; NNLS and the ridge solve run on the m x m side instead (`ridge_solve_wide`)
    wide = scaled.shape[-1] > scaled.shape[-2]
    # [h, t, m]: the products below read the kept entries' columns as rows (`products.linear` takes x @ w.T)
    columns = None if wide else scaled[0].transpose(-1, -2).contiguous()
    gram = None
    if refit and (ridge > 0 or use_bias) and not wide:  # no refit: nothing solves with a Gram
        known = None if prefix is None else prefix.gram
        gram = symmetric_gram(columns) if known is None else _extend_gram(known, columns)
    if use_bias and bool((kernel.query_weight > 0).any()):
        target = (kernel.region_z * row_scale)[0]
        weight = nnls(scaled[0], target, init=weight[0], iters=iters, gram=gram)[None].float() * live
    bias = torch.where(weight > 0, weight.clamp_min(1e-30).log(), torch.full_like(weight, float("-inf")))
    # one product per head (a batched [m, t] x [t, 1] matmul took 7x longer)
    summary_z = kernel.context_z + linear(base, weight[..., None, :])[..., 0]
    prior = kept.values.float()
    if not refit:
        return Fit(prior, bias, base, weight, summary_z, gram)
    try:
        if ridge == 0:
            # the proposal's plain OLS, as written: rows weighted by sqrt(query weight) / Z^
            design = base * weight[..., None, :] * (root_w / summary_z)[..., None]
            target = (kernel.output - kernel.context_n / summary_z[..., None]) * root_w[..., None]
            values = ridge_lstsq(design[0], target[0], ridge=0, prior=prior[0])[None].float()
        else:
            # sum_j (w_j e_qj / Z^) c_j ~ o - N_ctx / Z^, each query's row multiplied by sqrt(query weight) Z^ / Z:
            # the same model, the queries weighted by sqrt(w) / Z instead of sqrt(w) / Z^ (Z^ ~ Z once NNLS has
            # fitted the mass), so the Gram is the NNLS one: design diag(w), Gram diag(w) G diag(w)
            target = (kernel.output * summary_z[..., None] - kernel.context_n) * row_scale[..., None]
            values = _refit_values(scaled[0], columns, gram, weight[0], target[0], prior[0], ridge)[None]
    except FloatingPointError:
        values = prior
    # an ill-conditioned fit (ridge=0) can still overflow: such heads keep their entries' own values
    finite = torch.isfinite(values).all(-1).all(-1)[..., None, None]
    values = torch.where(finite, values, prior)
    if not weights:
        return Fit(values, bias, gram=gram)
    return Fit(values, bias, base, weight, summary_z, gram)


def _refit_values(
    scaled: torch.Tensor,
    columns: torch.Tensor | None,
    gram: torch.Tensor | None,
    w: torch.Tensor,
    target: torch.Tensor,
    prior: torch.Tensor,
    ridge: float,
) -> torch.Tensor:
    """The ridge refit of the values (``[h, t, d]``) for the design ``scaled diag(w)`` (``scaled`` ``[h, m, t]``):
    from the NNLS Gram (``diag(w) G diag(w)``), or without a Gram where the design is wide (``gram`` None,
    `ridge_solve_wide`)."""
    if gram is None:
        return ridge_solve_wide(scaled * w[..., None, :], target, ridge=ridge, prior=prior)
    rhs = w[..., None] * linear(columns, target.transpose(-1, -2))
    # diag(w) G diag(w) with one t x t temporary, not two
    return ridge_solve((gram * w[..., :, None]).mul_(w[..., None, :]), rhs, ridge=ridge, prior=prior,
                       design=lambda: scaled * w[..., None, :], target=target).float()


def _extend_gram(known: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``columns columns^T`` (``[h, t, m]``: the Gram of the columns of ``scaled``) when ``known`` is already that
    of the first ``t0`` columns."""
    t0, t = known.shape[-1], columns.shape[-2]
    gram = columns.new_empty(columns.shape[0], t, t)
    gram[:, :t0, :t0] = known
    rows = linear(columns[:, t0:], columns)  # [h, t - t0, t]
    gram[:, t0:, :] = rows
    gram[:, :t0, t0:] = rows[..., :t0].transpose(-1, -2)
    return gram


def row(region: Region, index: int) -> Region:
    """Batch row ``index`` of ``region`` (kept 4-D)."""
    sl = slice(index, index + 1)
    return Region(region.keys[sl], region.values[sl], region.bias[sl], region.tokens)


def row_context(ctx: FitContext, index: int) -> FitContext:
    """Batch row ``index`` of ``ctx``."""
    sl = slice(index, index + 1)
    return replace(
        ctx, queries=ctx.queries[sl], query_weight=ctx.query_weight[sl], context_keys=ctx.context_keys[sl],
        context_values=ctx.context_values[sl], context_bias=ctx.context_bias[sl],
        scores=None if ctx.scores is None else ctx.scores[sl],
    )
