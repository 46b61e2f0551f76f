"""The summary fitted on KVzip's context replay (issue 36): KVzip (Kim et al. 2025, https://arxiv.org/abs/2505.23416)
keeps the entries the model needs to re-read its context; the summary (`methods.summary`) keeps the entries its
reference queries attend to and refits them so those queries see the same attention output. With the prompt's own
recent queries as references the summary drops what the end of the prompt does not look at (a needle far back, when
the question comes after compression); this method takes the replay's instead:

- under `methods.kvzip.compress_context` (or an evaluation's `kvzip.replay` + `kvzip.prune`), the context is held
  whole, re-read after the repeat prompt, and every layer's budget is set by KVzip's one threshold across layers;
  each layer then keeps, per head, the entries with the highest replay score (``selection="max"``: KVzip's score, the
  largest weight any replay query gives the entry; ``"mass"``: the mean weight of the sampled replay queries). With
  ``refit`` / ``truncate`` (off by default: `ReplaySummarySettings`) the summary's stages 2 and 3 then refit their
  logit biases and values and cut the values' rank against the attention outputs of ``reference_queries`` replay
  queries per query head, evenly spaced over the replay, at their own positions. Unlike KVzip, every head of a layer
  keeps as many entries (the summary's block layout); the layer's count is KVzip's.
- without a replay (`generate`, a chunked prefill, the summaries after `compress_context`): the replay needs the
  whole context, which a chunked prefill never holds, so this is the summary on the prompt's own queries
  (``"max"``: selected by their largest weight, KVzip's rule without a replay; ``"mass"``: the summary exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...layer.storage import Block
from ...validation import check_bool, check_choice, checked
from ..matching import Kernel
from ..region import FitContext, Region
from ..registry import register
from .summary import SummarySettings, summarise


@dataclass(frozen=True)
class ReplaySummarySettings(SummarySettings):
    """The summary's settings (`methods.summary.SummarySettings`) with the replay's selections.

    Attributes:
        selection: stage 1: ``"max"`` (KVzip's replay score: the largest weight any replay query gives the entry)
            or ``"mass"`` (the mean weight of the sampled replay queries).
        refit: run stage 2 (biases and values refitted on the replay queries).
        truncate: run stage 3 (the values cut to the rank the replay queries allow, the bytes freed spent on more
            entries).

    Both are off by default, measured on SmolLM2 (docs/results/long_context.md, "The refit against the needles"
    and "Stage 3 and the layout"): each fits a sample of replay queries, few of which read a needle, and costs
    needles the selection kept (the refit: passkey 0.4 / 0.6 against 1.0 / 1.0 at budgets 0.25 / 0.125; the
    truncation: passkey 0.7 against 1.0 at 0.5). The kept entries then stay exact: KVzip's selection in the
    summary's layout, which still loses real-text needles to KVzip (every head keeps as many entries).
    """

    PAPER: ClassVar[str] = "https://arxiv.org/abs/2505.23416"
    SELECTIONS: ClassVar[tuple[str, ...]] = ("max", "mass")

    selection: str = checked("max", check_choice, choices=SELECTIONS)
    refit: bool = checked(False, check_bool)
    truncate: bool = checked(False, check_bool)


@register("summary_replay", settings=ReplaySummarySettings, needs_queries=True, context_replay="queries")
def compress(region: Region, budget: int, ctx: FitContext) -> list[Block]:
    """Summarise ``region`` into at most ``budget`` bytes per batch row on the replay's queries (see the module
    docstring)."""
    return summarise(region, budget, ctx, ctx.config.settings, replay_score)


def replay_score(kernel: Kernel, region: Region, ctx: FitContext, cfg: ReplaySummarySettings) -> torch.Tensor:
    """Stage 1 of one batch row: ``[1, h, n]``, higher = keep (see `ReplaySummarySettings.selection`)."""
    if cfg.selection == "mass":
        score = kernel.mass()
    elif ctx.scores is not None:
        score = ctx.scores.to(region.keys.device).float()
    else:
        score = kernel.peak()
    return score.masked_fill(~region.live, float("-inf"))
