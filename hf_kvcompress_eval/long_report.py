"""The long suite's report: from ``results.jsonl`` (`long_suite`), a markdown table of every method's mean and
standard error per task, length and budget with its measured held bytes as a fraction of the full cache's, the
tasks the full cache cannot do (left out of the ranking), and a PNG of score and NLL against the budget."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from .long_suite import FULL, NLL, read_rows
from .report import _plt

#: a task whose full-cache score is below this at a length is reported and left out of the ranking (issue 36)
KEEP_FULL_SCORE = 0.30
#: the methods issue 36's goal is about ("the summary best, or within one standard error of the best"): the best of
#: these at each length and budget is set against the best method there (`verdicts`)
SUMMARY_METHODS = ("summary", "summary_replay")


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n); 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def summarise(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """``(task, length, method, budget) -> {"n", "mean", "se", "held"}``: the score (NLL for the ``nll`` rows) and the
    held bytes as a fraction of the full cache's, over samples."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["task"], row["length"], row["method"], row["budget"])].append(row)
    out = {}
    for key, mine in groups.items():
        values = [r["nll"] if key[0] == NLL else r["score"] for r in mine]
        mean, se = mean_se(values)
        held = sum(r["held_bytes"] / r["full_bytes"] for r in mine) / len(mine)
        out[key] = {"n": len(mine), "mean": mean, "se": se, "held": held}
    return out


def kept_tasks(stats: dict[tuple, dict[str, Any]]) -> tuple[dict[int, list[str]], dict[int, dict[str, float]]]:
    """Per length, the tasks the full cache scores at least `KEEP_FULL_SCORE` on, and every task's full score."""
    kept: dict[int, list[str]] = defaultdict(list)
    full: dict[int, dict[str, float]] = defaultdict(dict)
    for (task, length, method, _), s in sorted(stats.items()):
        if method == FULL and task != NLL:
            full[length][task] = s["mean"]
            if s["mean"] >= KEEP_FULL_SCORE:
                kept[length].append(task)
    return kept, full


def _cell(s: dict[str, Any] | None, digits: int = 3) -> str:
    return "-" if s is None else f"{s['mean']:.{digits}f} ± {s['se']:.{digits}f}"


def markdown(rows: list[dict[str, Any]], png: str | None = None) -> str:
    """The report's markdown (tables per length: tasks, then the NLL rows)."""
    stats = summarise(rows)
    kept, full = kept_tasks(stats)
    lossy = [m for m in dict.fromkeys(r["method"] for r in rows) if m != FULL]
    budgets = sorted({key[3] for key in stats if key[3] is not None}, reverse=True)
    parts = ["Score: RULER's string_match_all (share of the expected answers in the greedy answer), mean ± standard "
             "error over samples; held: bytes the cache holds after the context (its own count, `stats()`), as a "
             f"fraction of the full cache's. Tasks the full cache scores below {KEEP_FULL_SCORE:.0%} on are shown but "
             "left out of the ranking (\"kept mean\": the mean over the kept tasks' samples; methods ranked by it per budget). "
             "samples: rows behind a line (a run stopped by its time bound may hold fewer for some methods).", ""]
    for length in sorted(full):
        tasks = sorted(full[length])
        left_out = [f"{t} ({full[length][t]:.2f})" for t in tasks if t not in kept[length]]
        parts += [f"### {length} tokens", ""]
        if left_out:
            parts += ["Left out of the ranking (full-cache score below the bar): " + ", ".join(left_out) + ".", ""]
        counts = ", ".join(f"{t} {stats[(t, length, FULL, None)]['n']}" for t in tasks)
        parts += [f"Samples per task: {counts}.", ""]
        head = ["method", "budget", "held", "samples", *tasks, "kept mean"]
        parts += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        configs = [(FULL, None)] + [(m, b) for b in budgets for m in _ranked(rows, lossy, length, b, kept[length])]
        for method, budget in configs:
            held = [stats[k]["held"] for t in tasks if (k := (t, length, method, budget)) in stats]
            if not held:
                continue
            cells = [_cell(stats.get((t, length, method, budget))) for t in tasks]
            pooled = _pooled(rows, length, method, budget, kept[length])
            count = sum(stats[k]["n"] for t in tasks if (k := (t, length, method, budget)) in stats)
            parts.append("| " + " | ".join([method if method != FULL else "full cache", "-" if budget is None else
                                             f"{budget:g}", f"{sum(held) / len(held):.3f}", str(count), *cells,
                                             _cell(pooled)]) + " |")
        parts.append("")
        parts += verdicts({(m, b): _samples(rows, length, m, b, kept[length]) for m in lossy for b in budgets},
                          budgets, higher=True)
    nll_lengths = sorted({key[1] for key in stats if key[0] == NLL})
    if nll_lengths:
        parts += ["### NLL of held-out text after the context", "",
                  "Mean NLL (nats per token) of the continuation after a context of the given length, mean ± standard "
                  "error over text windows (held: at the first length).", ""]
        head = ["method", "budget", "held", "windows", *[f"{n} tokens" for n in nll_lengths]]
        parts += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method, budget in [(FULL, None)] + [(m, b) for b in budgets for m in lossy]:
            cells = [_cell(stats.get((NLL, n, method, budget))) for n in nll_lengths]
            first = next((stats[(NLL, n, method, budget)] for n in nll_lengths if (NLL, n, method, budget) in stats), None)
            if first is None:
                continue
            count = sum(stats[k]["n"] for n in nll_lengths if (k := (NLL, n, method, budget)) in stats)
            parts.append("| " + " | ".join([method if method != FULL else "full cache", "-" if budget is None else
                                             f"{budget:g}", f"{first['held']:.3f}", str(count), *cells]) + " |")
        parts.append("")
        for n in nll_lengths:
            parts += verdicts({(m, b): _samples(rows, n, m, b, None) for m in lossy for b in budgets}, budgets,
                              higher=False, what=f"NLL at {n} tokens")
    if png:
        parts += [f"![long-context scores]({png})", ""]
    return "\n".join(parts)


def verdicts(values: dict[tuple[str, float], dict[tuple, float]], budgets: list[float], *, higher: bool,
             what: str = "kept mean") -> list[str]:
    """Issue 36's goal per budget: the best of `SUMMARY_METHODS` against the best method. ``values``: ``(method,
    budget) -> {sample key: score or NLL}``. The gap is judged on the samples both have, paired (the standard error of
    the per-sample differences: every method sees the same contexts, so the samples' own spread cancels), or, with
    fewer than two shared samples, against ``sqrt(se_best^2 + se_summary^2)``."""
    lines = []
    for budget in budgets:
        mine = {m: v for (m, b), v in values.items() if b == budget and v}
        ours = [m for m in mine if m in SUMMARY_METHODS]
        if not ours or len(mine) < 2:
            continue
        sign = 1.0 if higher else -1.0
        mean = {m: sum(v.values()) / len(v) for m, v in mine.items()}
        best = max(mine, key=lambda m: sign * mean[m])
        summary = max(ours, key=lambda m: sign * mean[m])
        shared = sorted(set(mine[best]) & set(mine[summary]), key=str)
        if len(shared) >= 2:
            gap, se = mean_se([sign * (mine[best][k] - mine[summary][k]) for k in shared])
            how = f"paired over {len(shared)} samples"
        else:
            gap = sign * (mean[best] - mean[summary])
            se = math.hypot(mean_se(list(mine[best].values()))[1], mean_se(list(mine[summary].values()))[1])
            how = "unpaired"
        if best == summary:
            verdict = "the summary is best"
        elif gap <= se:
            verdict = f"within one standard error of the best ({best}; gap {gap:.3f} ± {se:.3f}, {how})"
        else:
            size = f"{gap / se:.1f} standard errors" if se > 0 else "every sample"
            verdict = f"**{best} wins by {size}** (gap {gap:.3f} ± {se:.3f}, {how})"
        lines.append(f"- {what}, budget {budget:g}: {summary} {mean[summary]:.3f}, best {best} {mean[best]:.3f}: "
                     f"{verdict}")
    return ["Goal (issue 36: the summary best, or within one standard error of the best):", "", *lines, ""] if lines else []


def _samples(rows, length: int, method: str, budget, tasks: list[str] | None) -> dict[tuple, float]:
    """``{(task, seed): score}`` over ``tasks`` (None: the NLL rows, ``{(nll, seed): nll}``)."""
    if tasks is None:
        return {(r["task"], r["seed"]): r["nll"] for r in rows if r["task"] == NLL and r["length"] == length
                and r["method"] == method and r["budget"] == budget}
    return {(r["task"], r["seed"]): r["score"] for r in rows if r["length"] == length and r["method"] == method
            and r["budget"] == budget and r["task"] in tasks}


def _pooled(rows, length: int, method: str, budget, tasks: list[str]) -> dict[str, Any] | None:
    values = [r["score"] for r in rows if r["length"] == length and r["method"] == method and r["budget"] == budget
              and r["task"] in tasks]
    if not values:
        return None
    mean, se = mean_se(values)
    return {"mean": mean, "se": se}


def _ranked(rows, methods: list[str], length: int, budget: float, tasks: list[str]) -> list[str]:
    """``methods`` best first by their mean over the kept tasks at this length and budget."""
    def key(method: str) -> float:
        pooled = _pooled(rows, length, method, budget, tasks)
        return -pooled["mean"] if pooled else math.inf

    return sorted(methods, key=key)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Kept-task score (one panel per length) and NLL (one per NLL length) against the budget, a line per method."""
    plt = _plt()
    stats = summarise(rows)
    kept, full = kept_tasks(stats)
    lengths = sorted(full)
    nll_lengths = sorted({key[1] for key in stats if key[0] == NLL})
    panels = [("score", n) for n in lengths] + [(NLL, n) for n in nll_lengths]
    if not panels:
        return
    legend_in = 1.8  # inches to the right of the panels for the legend
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + legend_in, 4.2), squeeze=False)
    lossy = [m for m in dict.fromkeys(r["method"] for r in rows) if m != FULL]
    # one look per method across panels; tab10 has 10 colours, so the marker and line style tell more methods apart
    look = {m: {"color": plt.get_cmap("tab10")(i % 10), "marker": "os^DvPX*<>"[i % 10],
                "linestyle": "-" if i < 10 else "--"} for i, m in enumerate(lossy)}
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for ax, (kind, length) in zip(axes[0], panels):
        for method in [FULL, *lossy]:
            points = []
            for budget in [None] if method == FULL else budgets:
                if kind == NLL:
                    s = stats.get((NLL, length, method, budget))
                else:
                    s = _pooled(rows, length, method, budget, kept[length] or sorted(full[length]))
                if s is not None:
                    points.append((budget, s["mean"], s["se"]))
            if not points:
                continue
            if method == FULL:
                ax.axhline(points[0][1], color="black", linestyle=":", label="full cache")
            else:
                ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                            capsize=2, label=method, **look[method])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (fraction of the full cache)")
        title = "continuation NLL" if kind == NLL else "kept-task score" if kept[length] else "score (no task kept)"
        ax.set_title(f"{title}, {length} tokens")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")  # beside the panels: inside, it hid the low lines
    fig.tight_layout(rect=(0, 0, 1 - legend_in / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: Path, out: Path, *, png_name: str = "long_context.png") -> Path:
    """``report.md`` and the PNG next to it in ``out`` from a ``results.jsonl``; returns the markdown's path."""
    rows = read_rows(results)
    if not rows:
        raise ValueError(f"{results}: no result rows yet")
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / png_name)
    path = out / "report.md"
    path.write_text(markdown(rows, png_name) + "\n")
    return path
