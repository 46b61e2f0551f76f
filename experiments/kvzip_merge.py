"""Does a small share of merged entries beside KVzip's exact selection help? (issue 36's restated goal)

KVzip (https://arxiv.org/abs/2505.23416) keeps, per head, the entries its context replay needs and drops the rest;
the attention mass the dropped entries held goes to the kept ones. The summary (docs/lossy.md) compensates for what
it drops, but its layout (as many entries in every head) and its refit cost the needles KVzip keeps
(docs/results/long_context.md, "Stage 3 and the layout"). This probe keeps KVzip's selection exact and ragged, and
spends ``merged`` entries per head of the budget on merged stand-ins for the dropped entries: the dropped entries of
a head, in position order, are cut into ``merged`` runs; each run becomes one entry whose key and value are the
weighted means of the run's and whose logit bias gives it the run's attention mass:

- ``fit="queries"``: weights = the attention the sampled replay queries give each entry; the bias matches the
  queries' summed attention to the run (``log sum_q w_q sum_j a_qj - log sum_q w_q a_q(merged)``);
- ``fit="count"``: plain means and ``log(run length)`` (no queries).

It registers the variants as lossy methods in this process and runs the long-context suite on them beside
``kvzip`` (the same shared prefill and replay), then prints the report's rows for the methods compared.

    python experiments/kvzip_merge.py --out /tmp/merge --samples 10 --budgets 0.125
"""

from __future__ import annotations

import argparse
import math
import pathlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from hf_kvcompress.lossy.blocks import LossyBlock, RaggedBlock
from hf_kvcompress.lossy.budget import entry_bytes
from hf_kvcompress.lossy.matching import row, row_context
from hf_kvcompress.lossy.methods.adakv import adaptive_keep
from hf_kvcompress.lossy.methods.kvzip import max_attention
from hf_kvcompress.lossy.region import FitContext, Region
from hf_kvcompress.lossy.registry import MethodSettings, register
from hf_kvcompress.validation import check_choice, check_int, checked

VARIANTS = {"merge_q4": ("queries", 4), "merge_q16": ("queries", 16), "merge_c16": ("count", 16)}


def _settings(fit: str, count: int) -> type[MethodSettings]:
    fit_default = fit

    @dataclass(frozen=True)
    class MergeSettings(MethodSettings):
        PAPER: ClassVar[str] = "https://arxiv.org/abs/2505.23416"
        fit_by: str = checked(fit_default, check_choice, choices=("queries", "count"))
        merged: int = checked(count, check_int, minimum=1, maximum=4096)

    return MergeSettings


def _merge_row(sub: Region, ctx: FitContext, drop: torch.Tensor, merged: int, fit: str):
    """Merged keys / values ``[1, h, merged, d]`` and biases ``[1, h, merged]`` (-inf for an empty run) of one row."""
    _, h, _, d = sub.keys.shape
    keys = sub.keys.new_zeros(1, h, merged, d)
    values = sub.values.new_zeros(1, h, merged, sub.values.shape[-1])
    bias = torch.full((1, h, merged), float("-inf"))
    if fit == "queries":
        logits = ctx.logits(sub.keys, sub.bias)[0]  # [h, m, n]
        both = torch.cat([logits, ctx.logits(ctx.context_keys, ctx.context_bias)[0]], dim=-1)
        lse = torch.logsumexp(both, dim=-1, keepdim=True)  # [h, m, 1]: the full softmax's normaliser
        weight = ctx.query_weight[0][..., None]  # [h, m, 1]
    for head in range(h):
        index = drop[head].nonzero()[:, 0]
        for slot, run in enumerate(torch.tensor_split(index, merged)):
            if run.numel() == 0:
                continue
            k, v = sub.keys[0, head, run].float(), sub.values[0, head, run].float()
            if fit == "count":
                share = torch.full((run.numel(),), 1.0 / run.numel())
                bias[0, head, slot] = math.log(run.numel())
            else:
                attn = (logits[head][:, run] - lse[head]).exp() * weight[head]  # [m, run]
                col = attn.sum(0)
                share = col / col.sum() if float(col.sum()) > 0 else torch.full_like(col, 1.0 / run.numel())
            key = share @ k
            keys[0, head, slot], values[0, head, slot] = key.to(keys.dtype), (share @ v).to(values.dtype)
            if fit == "queries":
                target = float(col.sum())
                own = ((ctx.queries[0, head] * ctx.scaling) @ key - lse[head][:, 0]).exp() * weight[head][:, 0]
                got = float(own.sum())
                bias[0, head, slot] = math.log(target / got) if target > 0 and got > 0 else math.log(run.numel())
    return keys, values, bias


def compress(region: Region, budget: int, ctx: FitContext) -> list:
    """KVzip's ragged selection within the budget less ``merged`` entries per head, and the merged runs."""
    b, h, n, d = region.keys.shape
    if n == 0:
        return []
    if ctx.config.entry_format != "model":
        raise ValueError("kvzip_merge (experiment): entry_format 'model' only")
    cfg = ctx.config.settings
    elem, dv = region.keys.element_size(), region.values.shape[-1]
    exact = entry_bytes(1, d, elem, with_bias=False, value_dim=dv)
    per_merged = entry_bytes(h, d, elem, with_bias=True, value_dim=dv)
    merged = min(cfg.merged, budget // (4 * per_merged))  # at most a quarter of the budget
    total = min(h * n, (budget - h * 4 - merged * per_merged) // exact)
    if total <= 0:
        return []
    score = max_attention(region, ctx) if ctx.scores is None else ctx.scores.to(region.keys.device).float()
    keep = adaptive_keep(score.masked_fill(~region.live, float("-inf")), total, safeguard=0.0)
    blocks = [RaggedBlock.from_mask(region.keys, region.values, keep, tokens=region.tokens, fmt="model")]
    drop = region.live & ~keep
    if not merged or not bool(drop.any()):
        return blocks
    parts = [_merge_row(row(region, r), row_context(ctx, r), drop[r], merged, cfg.fit_by) for r in range(b)]
    keys, values, bias = (torch.cat([p[i] for p in parts]) for i in range(3))
    blocks.append(LossyBlock(keys, values, bias.to(keys.dtype), tokens=0))
    return blocks


def register_variants() -> None:
    for name, (fit, merged) in VARIANTS.items():
        register(name, settings=_settings(fit, merged), needs_queries=True, context_replay="queries")(compress)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", default="10")
    parser.add_argument("--budgets", default="0.125")
    parser.add_argument("--methods", default="none,kvzip," + ",".join(VARIANTS))
    parser.add_argument("--tasks", default="passkey,niah_single,niah_text")
    parser.add_argument("--nll-samples", default="4")
    parser.add_argument("--threads", default="2")
    args = parser.parse_args()
    register_variants()
    from hf_kvcompress.cli import main as cli

    cli(["eval", "--suite", "long", "--device", "cpu", "--dtype", "float32", "--threads", args.threads, "--tasks",
         args.tasks, "--lengths", "2048", "--samples", args.samples, "--batch", "10", "--budgets", args.budgets,
         "--methods", args.methods, "--nll-lengths", "2048", "--nll-samples", args.nll_samples, "--verify-prefill",
         ",".join(VARIANTS), "--out", args.out])
    rows = pathlib.Path(args.out, "results.jsonl").read_text().splitlines()
    print(f"{len(rows)} rows in {args.out}/results.jsonl; report: {args.out}/report.md")


if __name__ == "__main__":
    main()
