"""``hf-kvcompress eval --suite long``: the long-context suite's options and its command (`long_suite`,
`long_report`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hf_kvcompress.errors import CliError
from hf_kvcompress.validation import int_arg, number_arg

from .long_context import TEXT_TASKS
from .long_run import LongRun

if TYPE_CHECKING:
    import torch

# light at the top: `add_long_arguments` runs for every --help of the command line; the engine (`long_suite`,
# torch and transformers) loads in `cmd_long`

#: model (and cache) dtypes, torch's names
DTYPES = ("bfloat16", "float16", "float32")
#: the NLL text is read whole: a bound against a wrong path (a model file, a disk image)
MAX_TEXT_BYTES = 64 << 20


def add_long_arguments(parser: argparse.ArgumentParser) -> None:
    # the defaults without building a LongRun (its methods' default is the lossy registry, which imports torch)
    defaults = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(LongRun)})
    group = parser.add_argument_group("long-context suite (--suite long; --model, --out, --threads apply too)")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when there is one)")
    group.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="model (and cache) dtype")
    group.add_argument("--tasks", default=",".join(defaults.tasks), help="comma-separated tasks")
    group.add_argument("--lengths", default=_join(defaults.lengths), help="context lengths in tokens")
    group.add_argument("--samples", default=_join(defaults.samples),
                       help="samples per task: one count, or one per length")
    group.add_argument("--methods", default="all",
                       help="'none' (the full cache) and registered lossy methods (default: all: every one)")
    group.add_argument("--budgets", default=_join(defaults.budgets), help="budget fractions of the lossy methods")
    group.add_argument("--nll-lengths", default=_join(defaults.nll_lengths),
                       help="context lengths of the held-out text NLL rows ('' for none)")
    group.add_argument("--nll-samples", type=int_arg(minimum=0), default=defaults.nll_samples,
                       help="text windows per NLL length")
    group.add_argument("--continuation", type=int_arg(minimum=2), default=defaults.continuation,
                       help="NLL tokens per window")
    group.add_argument("--batch", type=int_arg(minimum=1), default=defaults.batch, help="samples per forward")
    group.add_argument("--own-prefill", default="", help="methods that get a real prefill instead of the shared one")
    group.add_argument("--verify-prefill", default=",".join(defaults.verify_prefill),
                       help="methods whose shared prefill is checked bit for bit against a real one first "
                       "(a mismatch gives the method real prefills)")
    group.add_argument("--min-full-score", type=number_arg(low=0.0, high=1.0), default=defaults.min_full_score,
                       help="run the lossy methods only on tasks the full cache scores at least this on (0: all)")
    group.add_argument("--max-seconds", type=number_arg(low=0.0, low_open=True), default=None,
                       help="stop (cleanly, between two methods) after this long; a rerun continues")
    group.add_argument("--text", default=None,
                       help="text file of the NLL rows and niah_text (default: the held-out Shakespeare)")
    group.add_argument("--report-only", action="store_true", help="only write report.md and the PNG from the results")


def _join(values) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _list(text: str, kind, name: str) -> tuple:
    try:
        return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        raise CliError(f"--{name} takes comma-separated {kind.__name__} values, got {text!r}") from None


def long_run(args: argparse.Namespace) -> LongRun:
    methods = {} if args.methods == "all" else {"methods": _list(args.methods, str, "methods")}
    try:
        return LongRun(
            tasks=_list(args.tasks, str, "tasks"), lengths=_list(args.lengths, int, "lengths"),
            samples=_list(args.samples, int, "samples"), **methods,
            budgets=_list(args.budgets, float, "budgets"), nll_lengths=_list(args.nll_lengths, int, "nll-lengths"),
            nll_samples=args.nll_samples, continuation=args.continuation, batch=args.batch,
            own_prefill=_list(args.own_prefill, str, "own-prefill"),
            verify_prefill=_list(args.verify_prefill, str, "verify-prefill"), max_seconds=args.max_seconds, min_full_score=args.min_full_score,
        )
    except (TypeError, ValueError) as err:
        raise CliError(str(err)) from err


def nll_text(path: str | None) -> str:
    """The text of the NLL rows: ``path``, or the held-out Shakespeare plays (from the library's cache folder)."""
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise CliError(f"--text {path!r}: no such regular file")
        if file.stat().st_size > MAX_TEXT_BYTES:
            raise CliError(f"--text {path!r}: larger than {MAX_TEXT_BYTES >> 20} MiB")
        return file.read_text(errors="replace")
    from hf_kvcompress.data import shakespeare_files

    return "\n\n".join(p.read_text(errors="replace") for p in sorted(shakespeare_files("evaluation")))


def device_of(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise CliError(f"--device {name!r}: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {name!r}: this torch sees no CUDA device")
    return device


def cmd_long(args: argparse.Namespace) -> int:
    import torch

    from .long_report import write_report
    from .long_suite import RESULTS, Engine, run_long

    run = long_run(args)
    out = Path(args.out) if args.out else Path("eval-results") / "long"
    results = out / RESULTS
    if args.report_only:
        if not results.is_file():
            raise CliError(f"--report-only: {results} does not exist (run the suite first)")
        print(f"wrote {write_report(results, out)}")
        return 0
    device = device_of(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = None
    if (run.nll_lengths and run.nll_samples) or any(task in TEXT_TASKS for task in run.tasks):
        try:
            text = nll_text(args.text)
        except (RuntimeError, OSError) as err:  # no Shakespeare in the cache folder and no network to fetch it
            print(f"WARNING: NLL rows (and real-text tasks) skipped: their text is not available ({err}); pass --text "
                  "FILE", file=sys.stderr)
    from hf_kvcompress.models import load_model

    try:
        model, tokenizer = load_model(args.model or None, dtype=getattr(torch, args.dtype))
    except ValueError as err:
        raise CliError(str(err)) from err
    model.to(device)
    start = time.time()
    done = run_long(Engine(model, tokenizer, run), out, text=text, progress=args.progress)
    log = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)), "argv": sys.argv[1:],
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "threads": torch.get_num_threads(), **done}
    out.mkdir(parents=True, exist_ok=True)
    with (out / "runs.jsonl").open("a") as f:
        f.write(json.dumps(log) + "\n")
    if done["prefill_check"]:
        print("shared prefill bit for bit a real one: " + ", ".join(f"{m} {ok}" for m, ok in done["prefill_check"].items())
              + f"; real prefills for: {', '.join(done['own_prefill']) or 'none'}")
    if done["left_out"]:
        print(f"full cache below --min-full-score {run.min_full_score:g}, lossy methods skipped: "
              + ", ".join(done["left_out"]))
    for note in done["notes"]:
        print(f"note: {note}")
    if done["errors"]:
        print("FAILED configurations (no rows): " + "; ".join(f"{k}: {v}" for k, v in done["errors"].items()))
    state = "stopped by --max-seconds (rerun to continue)" if done["stopped"] else "complete"
    print(f"long suite {state}: {done['rows_written']} rows in {done['seconds']:.0f} s -> {results}")
    if results.is_file():
        print(f"wrote {write_report(results, out)}")
    return 0
