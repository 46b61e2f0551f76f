"""The architecture matrix of issue 26 as a table: every decoder-only architecture x mode, exact or not.

Runs the checks of ``tests/cache/test_architectures.py`` (the same functions, not a copy) on every architecture of
``tests/architectures.py``'s matrix, float32 and bfloat16, one row and a left-padded batch of 2, and prints a
markdown table: per architecture its cache layer kinds and, per mode, ``exact`` (every check in every dtype and
batch passes), or the worst outcome with the checks it came from: ``differs`` (the largest logit difference),
``refused`` (hf_kvcompress's own ValueError/TypeError/NotImplementedError: its first line) or ``crashed`` (any
other exception: type and first line). The ``no-model`` column is `CompressedCache()` without ``model=``:
``exact``, ``refused at <where>: <the refusal>`` (what the issue accepts: our own refusal at construction, or
without a model at the first update) or the outcome. Every failing cell follows the
table, one line each.

    python experiments/architecture_table.py [--arch llama,gemma3_text] [--checks greedy,save] [--dtypes float32]
        [--batches 2] [--write] [--json results/architectures.json]

``--write`` writes docs/results/architectures_table.md. Torch runs on one thread (tiny models: far faster on a shared
machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cache")]

import torch  # noqa: E402
import transformers  # noqa: E402
from architectures import SKIPPED, layer_kinds, matrix_architectures, not_decoder_only  # noqa: E402
from test_architectures import BATCHES, CHECKS, DTYPES, Outcome, passes, run_check  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

COLUMNS = ("none", "lossless", "lossy", "no-model")
RANK = {"exact": 0, "n/a": 0, "differs": 1, "refused": 2, "crashed": 3}


def cells(archs, dtypes, batches, checks):
    """Every (arch, dtype, batch, check, mode) to run."""
    return [(arch, dtype, batch, check, mode) for arch in archs for dtype in dtypes for batch in batches
            for check in checks for mode in CHECKS[check]]


def column(check: str, mode: str) -> str:
    return "no-model" if check == "no-model" else mode


def run(todo) -> list[dict]:
    rows = []
    bar = tqdm(todo, desc="architecture matrix", unit="check")
    for arch, dtype, batch, check, mode in bar:
        bar.set_postfix_str(f"{arch} {dtype} b{batch} {check} {mode}", refresh=False)
        start = time.perf_counter()
        try:
            outcome = run_check(arch, dtype, batch, check, mode)
        except Exception as err:  # building the model or the DynamicCache reference: not the cache's doing
            text = str(err).strip()
            outcome = Outcome("crashed", f"{type(err).__name__}: {text.splitlines()[0][:240] if text else ''}",
                              "reference")
        rows.append({"arch": arch, "dtype": dtype, "batch": batch, "check": check, "mode": mode,
                     "status": outcome.status, "where": outcome.where, "detail": outcome.detail,
                     "passes": passes(check, outcome), "seconds": round(time.perf_counter() - start, 3)})
    return rows


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _label(row: dict) -> str:
    return f"{row['check']} {row['dtype']} b{row['batch']}"


def cell_text(rows: list[dict]) -> str:
    """One table cell: ``exact``, or the worst outcome among the failing rows with the checks it came from."""
    failing = [row for row in rows if not row["passes"]]
    if not failing:
        refused = [row for row in rows if row["status"] == "refused"]
        text = "exact"
        if refused:  # a refusal the issue accepts: say what it says
            text = f"refused at {refused[0]['where']}: {refused[0]['detail'][:200]}"
        missing = sorted({row["check"] for row in rows if row["status"] == "n/a"})
        return text + (f" ({', '.join(missing)}: n/a)" if missing else "")
    worst = max(failing, key=lambda row: RANK[row["status"]])
    checks = sorted({row["check"] for row in failing if row["status"] == worst["status"]})
    share = f"{len(failing)}/{len(rows)}"
    if worst["status"] == "differs":
        diffs = [float(row["detail"].split("max logit diff ")[1].split()[0]) for row in failing
                 if "max logit diff" in row["detail"]]
        amount = f"max logit diff {max(diffs):.3g}" if diffs else worst["detail"]
        return f"differs ({amount}; {', '.join(checks)}; {share})"
    where = f" at {worst['where']}" if worst["where"] else ""
    return f"{worst['status']}{where} ({', '.join(checks)}; {share}): {_escape(worst['detail'])[:160]}"


def table(rows: list[dict], seconds: float, command: str) -> str:
    by_cell: dict[tuple[str, str], list[dict]] = defaultdict(list)
    archs: list[str] = []
    for row in rows:
        if row["arch"] not in archs:
            archs.append(row["arch"])
        by_cell[row["arch"], column(row["check"], row["mode"])].append(row)
    columns = [c for c in COLUMNS if any((arch, c) in by_cell for arch in archs)]
    exact = sum(all(row["passes"] for c in columns for row in by_cell[arch, c]) for arch in archs)
    lines = [
        "# CompressedCache on every decoder-only architecture",
        "",
        "> **Generated report: do not edit by hand** (`python experiments/architecture_table.py --write` writes it). "
        "What the matrix covers: [../model_support.md](../model_support.md); the measurements: "
        "[model_support.md](model_support.md).",
        "",
        f"Generated by `{command}` (experiments/architecture_table.py) in {seconds / 60:.1f} min: transformers "
        f"{transformers.__version__}, torch {torch.__version__}; {len(archs)} architectures, {len(rows)} checks, "
        f"{sum(row['passes'] for row in rows)} passing; {exact} architectures pass every check.",
        "",
        "Each check compares a `CompressedCache` (blocks of 8 tokens, 8 raw) with `DynamicCache(config=...)` on a "
        "tiny random model (tests/architectures.py), float32 and bfloat16, one row and a left-padded batch of 2 "
        "(tests/cache/test_architectures.py says what each check asks): `greedy`, `beam` (2 beams), `crop`, "
        "`crop-recorded` (after `activate_past_recording()`), `save` (save, load, continue) in modes `none` and "
        "`lossless`; `lossy` (budget 0.5: finite logits, first step bit-equal); `no-model` (`CompressedCache()` "
        "without `model=`: exact, or refused asking for `model=`). A cell is `exact` when every check of its "
        "column passes; otherwise its worst outcome, the checks that gave it and the share of failing checks. "
        "`n/a`: DynamicCache itself fails that check there (listed after the failures).",
        "",
        "| architecture | layer kinds | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for arch in archs:
        try:
            kinds = layer_kinds(arch)
        except Exception as err:
            kinds = f"({type(err).__name__})"
        lines.append(f"| {arch} | {kinds} | " + " | ".join(cell_text(by_cell[arch, c]) if by_cell[arch, c] else ""
                                                          for c in columns) + " |")
    failing = [row for row in rows if not row["passes"]]
    lines += ["", f"## Failing checks ({len(failing)})", ""]
    lines += [f"- {row['arch']} / {row['mode']} / {_label(row)}: {row['status']}"
              + (f" at {row['where']}" if row["where"] else "") + f": {_escape(row['detail'])}" for row in failing]
    missing = [row for row in rows if row["status"] == "n/a"]
    lines += ["", f"## Not applicable: DynamicCache itself fails ({len(missing)})", ""]
    lines += [f"- {row['arch']} / {row['mode']} / {_label(row)}: {_escape(row['detail'])}" for row in missing]
    lines += ["", "## Left out", "", "Measured (`python tests/architectures.py` re-measures):", ""]
    lines += [f"- {name}: {reason}" for name, reason in SKIPPED.items()]
    lines += ["", "Not decoder-only language models (from transformers' registries and config classes):", ""]
    lines += [f"- {name}: {reason}" for name, reason in not_decoder_only().items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="", help="comma-separated architectures (default: the whole matrix)")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated checks")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--write", action="store_true", help="write docs/results/architectures_table.md")
    parser.add_argument("--json", type=Path, help="also write every check's outcome here")
    args = parser.parse_args(argv)

    import warnings

    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    archs = [a for a in args.arch.split(",") if a] or list(matrix_architectures())
    unknown = [a for a in archs if a not in matrix_architectures()]
    if unknown:
        parser.error(f"not in the matrix: {unknown} (SKIPPED or not decoder-only: see tests/architectures.py)")
    checks = [c for c in args.checks.split(",") if c]
    todo = cells(archs, [d for d in args.dtypes.split(",") if d], [int(b) for b in args.batches.split(",") if b],
                 checks)
    start = time.perf_counter()
    rows = run(todo)
    seconds = time.perf_counter() - start
    given = list(argv if argv is not None else sys.argv[1:])
    if "--json" in given:  # where the raw outcomes went changes nothing in the table
        del given[given.index("--json"):given.index("--json") + 2]
    command = "python experiments/architecture_table.py " + " ".join(arg for arg in given if not arg.startswith("--json="))
    text = table(rows, seconds, command.strip())
    print(text)
    if args.write:
        path = ROOT / "docs" / "results" / "architectures_table.md"
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seconds": seconds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
