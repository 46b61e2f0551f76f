"""``hf-kvcompress eval``: run an evaluation suite from the command line."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from hf_kvcompress.errors import CliError
from hf_kvcompress.validation import int_arg

# light at the top (`add_eval_parser` runs for every --help of the command line): the suite's runner, which imports
# torch and transformers, loads in `cmd_eval`
from .long_cli import add_long_arguments

SECTIONS = ("lossless", "generation", "lossy")


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to the ``hf-kvcompress`` parser's subparsers."""
    parser = subparsers.add_parser(
        "eval",
        help="measure what compression costs: lossless and lossy tables, plots and JSON in a results folder",
        # the quick suite: 6.7 min on 2 cores at load ~1 (2026-12-07, calibration fit included), 11.3 min at load
        # 2-6 (issue 47)
        description="Run an evaluation suite (quick: ~7-12 min on 2 CPU cores, depending on their load; full: about "
        "an hour) and write "
        "results.json, report.md and PNG plots into the results folder.",
    )
    parser.add_argument("--suite", default="quick",
                        help="quick, full, long (the long-context suite: options below), or a path to a suite .toml file")
    parser.add_argument("--out", default=None, help="results folder (default: eval-results/<suite name>, untracked)")
    parser.add_argument("--model", default=None, help="model of the run: hub id or local folder (overrides the suite)")
    parser.add_argument("--dataset", default=None,
                        help="text of the run: hub dataset or local .txt/.json/.jsonl files (overrides the suite)")
    parser.add_argument("--calibration", default=None,
                        help="auto, fit, or a calibration folder (overrides the suite's [calibration] use)")
    parser.add_argument("--threads", type=int_arg(minimum=0), default=None, help="torch threads (overrides the suite; 0 = the library's thread plan)")
    parser.add_argument("--only", default=None, help=f"comma-separated sections to run, among {','.join(SECTIONS)}")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    add_long_arguments(parser)
    parser.set_defaults(func=cmd_eval)
    return parser


def cmd_eval(args: argparse.Namespace) -> int:
    from .runner import EvalError, failed_rows, run_suite
    from .suite import SuiteError, load_suite

    if args.suite == "long":
        from .long_cli import cmd_long

        return cmd_long(args)
    try:
        suite = load_suite(args.suite)
    except SuiteError as err:
        raise CliError(str(err)) from err
    if args.model is not None:
        suite.model.name = args.model
    if args.dataset is not None:
        suite.data.source = args.dataset
    if args.calibration is not None:
        suite.calibration.use = args.calibration
    if args.threads is not None:
        suite.threads = args.threads
    if args.only is not None:
        chosen = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(chosen) - set(SECTIONS))
        if unknown or not chosen:
            raise CliError(f"--only takes sections among {list(SECTIONS)}, got {args.only!r}")
        for name in SECTIONS:
            getattr(suite, name).enabled = getattr(suite, name).enabled and name in chosen
    # by default outside the tracked results/ (the published runs write there with --out results/eval/<suite>)
    out = Path(args.out) if args.out else Path("eval-results") / re.sub(r"[^A-Za-z0-9_.-]+", "_", suite.name)
    try:
        results = run_suite(suite, out, progress=args.progress)
    except EvalError as err:
        raise CliError(str(err)) from err
    failed = failed_rows(results)
    if failed:
        raise CliError(f"{len(failed)} configuration(s) failed (results written to {out}): {failed[0]}")
    return 0
