"""The summary: (1) select, (2) refit by least squares, (3) truncated SVD, within the byte budget.

The three stages are those of the proposal this mode started from (entropy-guided selection, OLS compensation,
truncated SVD; a prototype shared in a Hacker News discussion, no paper); docs/lossy.md measures it as proposed
("summary-seed") and with the changes below, which are what made it beat Top-K. The per-entry weights of stage 2
are Attention Matching's (Zweiger et al. 2026, https://arxiv.org/abs/2602.16284).

1. Selection. ``selection="mass"`` (default) keeps the entries with the most attention from the reference queries.
   ``selection="entropy"`` is the proposal's criterion: entries whose attention entropy (over the reference queries)
   exceeds ``entropy_threshold`` are marked compressible and the lowest-entropy entries are kept first. Measured
   on SmolLM2 it keeps the wrong entries (sinks and heavy hitters are attended diffusely, so they look
   "low-information"); it stays available to reproduce that finding.
2. Compensation (`matching.fit_row`): what the dropped entries contributed is folded into the kept ones:
   per-entry logit biases by NNLS (when the attention path applies biases) and values by ridge least squares.
3. SVD: the refitted values are truncated to the smallest rank whose attention-output error on the reference
   queries stays within ``error_tolerance``; if storing them at that rank frees enough bytes for more entries, the
   summary is refitted with more entries and stored as value factors (only with a model attached: the entry count
   then differs between layers, which only the lossy attention function's own masks allow).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...layer.storage import Block
from ...validation import check_bool, check_choice, check_number, checked
from ..blocks import kept_block
from ..budget import entry_bytes, tiered
from ..matching import Fit, Kernel, fit_row, row, row_context
from ..region import FitContext, Region, dead_bias_or_none, gather_entries
from ..registry import MethodSettings, register
from ..scores import top_entries
from ..solvers import truncated_svd


@dataclass(frozen=True)
class SummarySettings(MethodSettings):
    """The summary's own settings (the stages are those of the module docstring; the per-entry weights of stage 2
    are Attention Matching's, Zweiger et al. 2026, https://arxiv.org/abs/2602.16284).

    Attributes:
        entropy_threshold: attention entropy (nats) above which a cached entry counts as compressible
            (``selection="entropy"`` only).
        error_tolerance: relative attention-output error that picks the smallest sufficient SVD rank (stage 3).
        selection: stage 1: ``"mass"`` (keep the most attended entries) or ``"entropy"`` (the criterion of the
            proposal docs/lossy.md tests: entries above ``entropy_threshold`` are compressible, the lowest-entropy
            ones are kept).
        fit_bias: fit a per-entry logit bias (Attention Matching) for summary entries; needs a model attached.
        ridge: ridge strength of the value refit, relative to the mean diagonal of its normal matrix (0 = plain
            least squares, solved with ``gelsd``).
    """

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2602.16284"
    SELECTIONS: ClassVar[tuple[str, ...]] = ("mass", "entropy")

    entropy_threshold: float = checked(2.5, check_number, low=0.0, high=100.0)
    error_tolerance: float = checked(0.05, check_number, low=0.0, high=1.0, low_open=True)
    selection: str = checked("mass", check_choice, choices=SELECTIONS)
    fit_bias: bool = checked(True, check_bool)
    ridge: float = checked(1e-3, check_number, low=0.0, high=1e6)


#: stage 1's scores of one batch row (``(kernel, region, ctx, settings) -> [1, h, n]``, higher = keep): `selection_score`
#: here, the replay's scores in `methods.summary_replay`
Selection = Callable[[Kernel, Region, FitContext, SummarySettings], torch.Tensor]


@register("summary", settings=SummarySettings, needs_queries=True)
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Summarise ``region`` into at most ``budget`` bytes per batch row."""
    return summarise(region, budget, ctx, ctx.config.settings, lambda kernel, sub, _, cfg: selection_score(kernel, sub, cfg))


def summarise(region: Region, budget: int, ctx: FitContext, cfg: SummarySettings, select: Selection) -> list[Block]:
    """The three stages on ``region`` within ``budget`` bytes per batch row, fitted on ``ctx``'s reference queries
    with ``cfg``, selecting by ``select``."""
    b, h, n, d = region.keys.shape
    dv = region.values.shape[-1]  # the values' width (the keys' unless the model's differ)
    elem = region.keys.element_size()
    # stages 2 and 3 can be switched off only in `methods.summary_replay`'s settings: a field here would change the
    # default lossy config that every lossless file's header holds
    refit, truncate = getattr(cfg, "refit", True), getattr(cfg, "truncate", True)
    use_bias = ctx.attached and cfg.fit_bias and refit
    store_bias = use_bias or not bool(region.live.all())
    fmt = ctx.config.entry_format
    count = min(n, budget // entry_bytes(h, d, elem, with_bias=store_bias, fmt=fmt, value_dim=dv))
    if count <= 0:
        return []
    # the kernel and the selection scores of each row are computed once and shared by every fit below
    rows = [(row(region, r), row_context(ctx, r)) for r in range(b)]
    kernels = [Kernel(sub, sub_ctx) for sub, sub_ctx in rows]
    scores = [select(kernel, sub, sub_ctx, cfg) for kernel, (sub, sub_ctx) in zip(kernels, rows)]
    if count >= n:
        # nothing is dropped, so nothing needs compensating: the entries stay as they are (only their format
        # changes), as a quantized cache would hold them
        return [_block(region, torch.cat(scores), budget, fmt, store_bias)]
    fits, worst = [], torch.zeros(min(count, dv) + 1)
    for kernel, score, (sub, _) in zip(kernels, scores, rows):
        index = top_entries(score, count)
        fit = fit_row(kernel, sub, index, use_bias=use_bias, ridge=cfg.ridge, refit=refit, weights=truncate)
        fits.append((index, fit))
        if truncate:
            worst = torch.maximum(worst, truncation_errors(kernel, fit))
    rank = smallest_rank(worst, cfg.error_tolerance) if truncate else dv
    # more entries than the plain count only where layers may differ in length (a model attached)
    if rank < dv and ctx.attached:
        per_entry = entry_bytes(h, d, elem, with_bias=store_bias, value_rank=rank, fmt=fmt)
        more = min(n, (budget - h * rank * dv * elem) // per_entry)
        if more > count:
            # the refit keeps the first fit's entries and adds the next best: only the added entries' rows of the
            # Gram are new; the entries are put back in position order afterwards
            refits = []
            for kernel, score, (sub, _), (first, fit) in zip(kernels, scores, rows, fits):
                taken = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, first, True)
                added = top_entries(score.masked_fill(taken, float("-inf")), more - first.shape[-1])
                index = torch.cat([first, added], dim=-1)
                wider = fit_row(kernel, sub, index, use_bias=use_bias, ridge=cfg.ridge, prefix=fit, weights=False,
                                refit=refit)
                refits.append(_in_position_order(index, wider))
            fits = refits
            keys, values, bias = _stack(region, fits)
            factors = truncated_svd(values, rank, region.values.dtype)
            bias = _stored_bias(bias, keys.dtype, store_bias)
            return [kept_block(keys, factors, bias, tokens=region.tokens, fmt=fmt)]
    keys, values, bias = _stack(region, fits)
    fitted = Region(keys, values.to(region.values.dtype), bias, region.tokens)
    score = torch.cat([torch.gather(s, -1, index) for s, (index, _) in zip(scores, fits)])
    return [_block(fitted, score, budget, fmt, store_bias)]


def _block(kept: Region, score: torch.Tensor, budget: int, fmt: str, store_bias: bool) -> Block:
    """The kept entries as one block in entry format ``fmt``; ``mixed``: the highest ``score`` (``[b, h, t]``) first,
    in the better tiers as far as the budget leaves room."""
    kept, tiers = tiered(kept, score, budget, fmt, with_bias=store_bias)
    bias = _stored_bias(kept.bias, kept.keys.dtype, store_bias)
    return kept_block(kept.keys, kept.values, bias, tokens=kept.tokens, fmt=fmt, tiers=tiers)


def selection_score(kernel: Kernel, region: Region, cfg) -> torch.Tensor:
    """Stage 1: higher = keep. Attention mass, or (the proposal's) low entropy first with compressible entries
    last."""
    if cfg.selection == "entropy":
        entropy = kernel.entropy()
        compressible = entropy > cfg.entropy_threshold
        # below-threshold entries first (by entropy), then the marked ones, least diffuse first
        score = torch.where(compressible, -entropy - 1e6, -entropy)
    else:
        score = kernel.mass()
    return score.masked_fill(~region.live, float("-inf"))


def truncation_errors(kernel: Kernel, fit: Fit) -> torch.Tensor:
    """Stage 3 check: for every rank r, the worst head's relative change of the reference queries' attention
    output (Frobenius over queries, against the full output) when the fitted values are cut to rank r.

    float32 throughout: the errors are compared with a tolerance of a few percent, far above float32's resolution
    of the tail energies (float64 here cost 2.3 s of a 2,048-token prefill: docs/lossy.md, *Speed and queries*)."""
    qw = kernel.query_weight[..., None]
    u, s, _ = torch.linalg.svd(fit.values.float(), full_matrices=False)
    parts = fit.weights_times(u) * s[..., None, :]  # [1, h, m, k]: each component's output contribution
    energy = (parts.pow(2) * qw).sum(-2)  # [1, h, k]
    tail = torch.cat([energy.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(energy[..., :1])], dim=-1)
    total = (kernel.output.pow(2) * qw).sum((-1, -2)).clamp_min(1e-30)[..., None]
    return (tail / total).clamp_min(0).sqrt().amax(dim=(0, 1))


def smallest_rank(errors: torch.Tensor, tolerance: float) -> int:
    """The first rank whose error is within ``tolerance`` (the full rank if none is)."""
    ok = (errors <= tolerance).nonzero()
    return int(ok[0]) if len(ok) else errors.shape[0] - 1


def _in_position_order(index: torch.Tensor, fit: Fit) -> tuple[torch.Tensor, Fit]:
    order = index.argsort(dim=-1)
    values = gather_entries(fit.values, order)
    return torch.gather(index, -1, order), Fit(values, torch.gather(fit.bias, -1, order))


def _stack(region: Region, fits: list[tuple[torch.Tensor, Fit]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    index = torch.cat([i for i, _ in fits])
    keys = region.gather(index).keys
    return keys, torch.cat([f.values for _, f in fits]), torch.cat([f.bias for _, f in fits])


def _stored_bias(bias: torch.Tensor, dtype: torch.dtype, store: bool) -> torch.Tensor | None:
    return dead_bias_or_none(bias, dtype) if store else None
