"""The ``hf-kvcompress`` command line.

``--version`` and ``--help`` answer without importing torch or transformers (seconds on a small CPU): this module
imports only the standard library at the top, and each command imports the library when it runs. Every command
but ``store`` first applies the library's thread plan (`hf_kvcompress.threads`: torch's threads and the codec's
workers within the cores this process may use; ``HF_KVCOMPRESS_THREADS=N`` overrides)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CliError
from .validation import int_arg, int_list_arg
from .version import __version__

if TYPE_CHECKING:
    import torch

    from .config import CompressionConfig

#: the evaluation harness: a separate top-level package (kept outside the library, as kvpress does), installed
#: from the same source tree; `hf-kvcompress eval` and `hf-kvcompress bench` import it on demand
EVAL_PACKAGE = "hf_kvcompress_eval"


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="hub id or local folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--dataset", default=None, help="hub dataset, local text/JSON files (default: Shakespeare)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


#: argparse types of the commands' numeric options (`validation.int_arg`): a bad value is a usage error at parse time
POSITIVE = int_arg(minimum=1)
COUNT = int_arg(minimum=0)


def _fitted_predictors(text: str) -> tuple[str, ...]:
    """``--predictors``: comma-separated names among those a calibration fits, or ``all`` (argparse converts the
    default too, after --help has answered: the registry, which imports torch, loads only for a real run)."""
    from .predictors.registry import FITTED

    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if names == ("all",):
        return FITTED
    unknown = [n for n in names if n not in FITTED]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {', '.join(FITTED)} (or all), "
                                         f"got {text!r}")
    return names


def _check_positions(model, tokens: int, what: str) -> None:
    """One forward of ``tokens`` positions must fit the model's position table (``max_position_embeddings``):
    past it RoPE models extrapolate silently and learned-position models fail deep in torch."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise CliError(f"{what} makes {tokens} positions, more than the model's max_position_embeddings ({limit})")


def _load(args: argparse.Namespace, split: str = "evaluation"):
    """The model and tokenizer; the ``--dataset`` is checked first, so a bad path fails before the slow load."""
    import torch

    from .data import check_source
    from .models import load_model

    try:
        check_source(args.dataset, split)
    except ValueError as err:
        raise CliError(str(err)) from err
    try:
        return load_model(args.model, dtype=getattr(torch, args.dtype))
    except (ValueError, OSError, RuntimeError) as err:  # RuntimeError: the default model's download failed
        raise CliError(str(err)) from err


def _prompt_ids(tokenizer, args: argparse.Namespace, n_tokens: int, split: str = "evaluation") -> torch.LongTensor:
    from .data import token_ids

    try:
        return token_ids(tokenizer, n_tokens, source=args.dataset, split=split)
    except ValueError as err:
        raise CliError(str(err)) from err


def _writable(folder: Path, role: str) -> Path:
    from .downloads import writable_folder

    try:
        return writable_folder(folder, role)
    except OSError as err:
        raise CliError(str(err)) from err


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit sigma tables, predictor heads and marginals on calibration text; save them."""
    from .calibration import META_FILE, Calibration, calibration_dir

    if args.tokens < args.chunk:
        raise CliError(f"--tokens ({args.tokens}) must be >= --chunk ({args.chunk})")
    if args.out:  # before the model loads: a folder that cannot be written fails at once
        _writable(Path(args.out), "calibration folder")
    model, tokenizer = _load(args, split=args.split)
    _check_positions(model, args.chunk, f"--chunk {args.chunk}")
    probe = {}  # the library's default layers (those the model has) unless given
    if args.probe_layers is not None:
        # Calibration.fit keeps the layers in 1..n_layers - 1 (the probe reruns layers 0..k-1 and predicts the
        # deeper ones): a layer given outside them would be dropped without a word
        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        outside = [k for k in args.probe_layers if not 1 <= k < n_layers]
        if outside and "probe" in args.predictors:
            raise CliError(f"--probe-layers {outside}: this model's probe layers are 1..{n_layers - 1} "
                           f"(it has {n_layers} layers)")
        probe["probe_layers"] = args.probe_layers
    out = Path(args.out) if args.out else _writable(calibration_dir(model), "calibration folder")
    try:
        calibration = Calibration.fit(
            model, tokenizer, source=args.dataset, split=args.split, tokens=args.tokens, chunk=args.chunk,
            predictors=args.predictors, **probe,
        )
    except ValueError as err:
        raise CliError(str(err)) from err
    if (out / META_FILE).is_file():
        print(f"replacing the calibration in {out}: caches saved with the old one need a copy of it to load")
    calibration.save(out)
    print(f"calibration of {calibration.meta['model']['name']} ({calibration.meta['text']['tokens']} tokens, "
          f"{calibration.meta['seconds']} s) saved to {out}")
    for name, info in calibration.meta["predictors"].items():
        print(f"  {name:>8}: in-sample Gaussian estimate {info['in_sample_gaussian_bits_estimate']} bits/scalar")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Generate with a CompressedCache on the default model and text; print the text and the cache stats."""
    import torch
    from transformers import DynamicCache

    from .cache import CompressedCache
    from .calibration import META_FILE, CalibrationError
    from .config import CompressionConfig
    from .generation import greedy_generate
    from .models import default_model_converted

    try:
        config = CompressionConfig(
            mode=args.mode, block_tokens=args.block_tokens, residual_tokens=args.residual_tokens
        )
    except (ValueError, TypeError) as err:
        raise CliError(str(err)) from err
    calibration: str | Path | None = "auto"  # the model's default calibration, fitted on first use
    if args.calibration == "none":
        calibration = None
    elif args.calibration is not None:  # checked before the model loads
        calibration = Path(args.calibration).expanduser()
        if not (calibration / META_FILE).is_file():
            raise CliError(f"--calibration {args.calibration!r}: no calibration there (expected {META_FILE})")
    converting = args.model is None and not default_model_converted()  # load_model converts it first
    loaded = time.perf_counter()
    model, tokenizer = _load(args)
    loaded = time.perf_counter() - loaded
    _check_positions(model, args.prompt_tokens + args.new_tokens,
                     f"--prompt-tokens {args.prompt_tokens} with --new-tokens {args.new_tokens}")
    ids = _prompt_ids(tokenizer, args, args.prompt_tokens)
    try:
        cache = CompressedCache(config, model=model, calibration=calibration)
    except CalibrationError as err:
        raise CliError(str(err)) from err
    warm_up = _warm_up(model, ids, config, calibration) if args.mode != "none" else None
    compiled = kernel_compiles()
    run = greedy_generate(model, ids, cache, args.new_tokens, progress=f"generating ({args.mode})")
    compiled = kernel_compiles() - compiled  # kernels the warm-up did not reach: their compiling is in run's time
    ref = None
    if args.check:
        ref = greedy_generate(model, ids, DynamicCache(), args.new_tokens, progress="reference (DynamicCache)")
    new_text = tokenizer.decode(run.sequences[0, ids.shape[1] :], skip_special_tokens=True)
    converted = f" (first use: converted to safetensors, loaded in {loaded:.1f} s)" if converting else ""
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded)'}{converted}  dtype: {args.dtype}  "
          f"mode: {args.mode}")
    print(f"threads: {args.thread_plan} (override: HF_KVCOMPRESS_THREADS=N)")
    if args.mode == "lossless":
        print(f"calibration: {cache.calibration_note}")  # says "fitted on first use" when this run fitted it
    print(f"prompt ({ids.shape[1]} tokens), last lines:")
    print(textwrap.indent(tokenizer.decode(ids[0, -60:]).strip(), "  | "))
    print(f"generated ({args.new_tokens} tokens):")
    print(textwrap.indent(new_text.strip(), "  > "))
    timing = _timing(run, ref, warm_up)
    for line in _timing_lines(timing, args.mode, compiled):
        print(line)
    stats = cache.stats()
    if ref is not None:
        stats["identical_to_DynamicCache"] = bool(torch.equal(ref.sequences, run.sequences))
    print("cache stats:")
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:>26}: {shown}")
    if args.json:
        print(json.dumps({**stats, **timing}))
    return 0


def _timing(run, ref, warm_up: tuple[float, int] | None) -> dict[str, float | int | bool | None]:
    """The demo's timing figures (``--json``'s keys): each cache's prefill seconds (to the first new token) and
    decode speed (the other tokens), the decode step's ratio to DynamicCache's, and the warm-up."""

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    timing: dict[str, float | int | bool | None] = {
        "tokens_per_s": round(run.tokens_per_second, 2),
        "prefill_s": round(run.prefill_seconds, 3),
        "decode_tokens": run.decode_tokens,
        "decode_tokens_per_s": rounded(run.decode_tokens_per_second, 2),
        "decode_ms_per_token": rounded(run.decode_ms_per_step, 2),
    }
    if ref is not None:
        timing.update({
            "DynamicCache_tokens_per_s": round(ref.tokens_per_second, 2),
            "DynamicCache_prefill_s": round(ref.prefill_seconds, 3),
            "DynamicCache_decode_tokens_per_s": rounded(ref.decode_tokens_per_second, 2),
            "DynamicCache_decode_ms_per_token": rounded(ref.decode_ms_per_step, 2),
        })
        ours, theirs = run.decode_ms_per_step, ref.decode_ms_per_step
        # how many DynamicCache decode steps one compressed step costs: what the overall tok/s hid
        timing["decode_step_ratio"] = round(ours / theirs, 2) if ours is not None and theirs else None
    if warm_up is not None:
        timing["warm_up_s"] = round(warm_up[0], 2)
        timing["warm_up_kernels_compiled"] = warm_up[1]
    return timing


def _timing_lines(timing: dict, mode: str, compiled: int) -> list[str]:
    """The timing figures as a few lines: the warm-up (saying "first use" only when it compiled kernels), then
    prefill and decode per cache, then the decode ratio."""
    lines = []
    if "warm_up_s" in timing:
        first = timing["warm_up_kernels_compiled"]
        note = f" (first use: {first} kernels compiled and cached)" if first else ""
        lines.append(f"warm-up: {timing['warm_up_s']:.1f} s{note}")
    later = f"; {compiled} kernels compiled during it" if compiled else ""
    lines.append(f"timing (prefill: the prompt to the first token; decode: the {timing['decode_tokens']} tokens "
                 f"after it{later}):")
    rows = [(f"CompressedCache ({mode})", "")]
    if "DynamicCache_prefill_s" in timing:
        rows.append(("DynamicCache", "DynamicCache_"))
    for name, prefix in rows:
        ms, rate = timing[f"{prefix}decode_ms_per_token"], timing[f"{prefix}decode_tokens_per_s"]
        decode = "-" if ms is None else f"{ms:.1f} ms/token ({rate:.1f} tok/s)"
        lines.append(f"  {name:>26}: prefill {timing[f'{prefix}prefill_s']:.2f} s, decode {decode}")
    if timing.get("decode_step_ratio") is not None:
        lines.append(f"  {'decode step ratio':>26}: {timing['decode_step_ratio']:.2f}x DynamicCache's")
    return lines


def kernel_compiles() -> int:
    """How many numba compilations the library's kernels have done in this process (their dispatchers'
    ``stats.cache_misses``: with ``cache=True`` a signature found in the on-disk cache counts as a hit, one
    compiled and saved as a miss). 0 while numba is not loaded: nothing can have been compiled then."""
    if "numba" not in sys.modules:
        return 0
    from numba.core.dispatcher import Dispatcher

    found: dict[int, Dispatcher] = {}
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "hf_kvcompress" or name.startswith("hf_kvcompress.")):
            for value in vars(module).values():
                if isinstance(value, Dispatcher):
                    found[id(value)] = value
    return sum(sum(d.stats.cache_misses.values()) for d in found.values())


def _warm_up(model, ids: torch.LongTensor, config: CompressionConfig, calibration) -> tuple[float, int]:
    """Seconds of a throwaway cache like the demo's through one sealed block and one decode step, and the
    kernels it compiled: the codec's one-time costs (numba compiling or loading its kernels, building its
    tables) land here, not in the timing of the generation. Compiling happens where numba's on-disk cache
    lacks a kernel (first use, or after an upgrade); otherwise it loads them, in about a second."""
    import torch

    from .cache import CompressedCache

    compiled = kernel_compiles()
    start = time.perf_counter()
    cache = CompressedCache(config, model=model, calibration=calibration)
    with torch.inference_mode():
        prompt = ids[:, : config.block_tokens + config.residual_tokens + 1]
        out = model(prompt, cache=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    return time.perf_counter() - start, kernel_compiles() - compiled


def _human(size: int) -> str:
    """``size`` bytes in binary units: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def cmd_store(args: argparse.Namespace) -> int:
    """List, measure or clear the prefix store's folder (`hf_kvcompress.PrefixStore`): one subfolder per model
    and settings, holding its chunks (``*.kvp``) and killed writers' temporary files (``*.tmp``)."""
    from .cache.store import clear as clear_prefixes
    from .cache.store import folder_model, folder_usage
    from .downloads import cache_dir

    root = Path(args.path).expanduser() if args.path else cache_dir() / "prefixes"
    if root.exists() and not root.is_dir():
        raise CliError(f"--path {str(root)!r} is not a folder")
    if args.action == "clear":
        try:
            removed = clear_prefixes(root)
        except ValueError as err:  # a folder that is not a store's: nothing removed
            raise CliError(str(err)) from err
        print(f"removed {_human(removed)} ({removed} bytes) of stored prefixes from {root}")
        return 0
    usage = folder_usage(root)
    if args.action == "du":
        total, chunks = sum(e["bytes"] for e in usage), sum(e["chunks"] for e in usage)
        temporary = sum(e["temporary_files"] for e in usage)
        print(f"{root}: {_human(total)} ({total} bytes) in {chunks} chunks, {len(usage)} model folders, "
              f"{temporary} temporary files")
        return 0
    if not usage:
        print(f"{root}: no stored prefixes")
        return 0
    print(f"{'folder':<32}  {'chunks':>7}  {'MiB':>9}  {'last used':<19}  {'temporary':>9}  model (from its chunks)")
    for e in usage:
        last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["last_used"])) if e["last_used"] else "-"
        model = folder_model(root / e["folder"]) or "-"
        print(f"{e['folder']:<32}  {e['chunks']:>7}  {e['bytes'] / 2**20:>9.2f}  {last:<19}  "
              f"{e['temporary_files']:>9}  {model}")
    return 0


#: each command's one-line help (the top-level ``--help`` lists them without building their parsers)
COMMANDS = {
    "demo": "generate with CompressedCache on the default model and print its stats",
    "calibrate": "fit sigma tables, predictor heads and marginals on calibration text",
    "store": "list, measure or clear the prefix store (PrefixStore) on disk",
    "eval": "measure what compression costs",
    "bench": "run a maintained benchmark (generate, codec, prefix, lmcache, kernels)",
}


def _installed(name: str) -> str:
    """A distribution's version from its metadata (importing torch or transformers for it takes seconds)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (the command, the problem, where the options are) and exit
    status 2, as `CliError`'s are; the usage itself is what ``--help`` shows. Subcommands' parsers are of this class
    too (argparse makes them of their parent's)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (options: {self.prog} --help)\n")


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = Parser(prog="hf-kvcompress", description="KV-cache compression for transformers")
    parser.add_argument("-v", "--verbose", action="store_true", help="show full tracebacks")
    parser.add_argument("--version", action="version",
                        version=f"hf-kvcompress {__version__} (transformers {_installed('transformers')}, "
                                f"torch {_installed('torch')})")
    return parser, parser.add_subparsers(dest="command", required=True)


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: every command's options. Building it imports neither torch nor transformers (nor the
    harness's heavy modules), so every ``<command> --help`` answers at once."""
    parser, sub = _top_parser()
    demo = sub.add_parser("demo", help=COMMANDS["demo"])
    _add_model_args(demo)
    demo.add_argument("--mode", default="lossless", choices=["none", "lossless", "lossy"])
    demo.add_argument("--prompt-tokens", type=POSITIVE, default=300)
    demo.add_argument("--new-tokens", type=POSITIVE, default=48)
    demo.add_argument("--block-tokens", type=POSITIVE, default=64)
    demo.add_argument("--residual-tokens", type=COUNT, default=32)
    demo.add_argument("--no-check", dest="check", action="store_false", help="skip the DynamicCache comparison")
    demo.add_argument("--json", action="store_true", help="also print the stats as one JSON line")
    demo.add_argument("--calibration", default=None,
                      help="calibration folder, or 'none' (default: the model's, fitted on first use)")
    demo.set_defaults(func=cmd_demo)

    cal = sub.add_parser("calibrate", help=COMMANDS["calibrate"])
    _add_model_args(cal)
    cal.add_argument("--split", default="calibration", help="text split (default: calibration)")
    cal.add_argument("--tokens", type=POSITIVE, default=16384, help="calibration tokens")
    cal.add_argument("--chunk", type=int_arg(minimum=16), default=1024, help="tokens per independent forward pass")
    cal.add_argument("--predictors", type=_fitted_predictors, default="all",
                     help="comma-separated names of the predictors whose heads a calibration fits (default: all; "
                          "a wrong name is refused, listing them)")
    cal.add_argument("--probe-layers", type=int_list_arg(minimum=1), default=None,
                     help="k values of the probe predictor, each in 1..the model's layers - 1 (default: 8,15,22, "
                          "those the model has)")
    cal.add_argument("--out", default=None, help="output folder (default: ~/.cache/hf_kvcompress/calibrations/<model>)")
    cal.set_defaults(func=cmd_calibrate)

    store = sub.add_parser("store", help=COMMANDS["store"])
    store.add_argument("action", choices=["ls", "du", "clear"],
                       help="ls: one line per model folder; du: total bytes and chunks; clear: remove every chunk")
    store.add_argument("--path", default=None,
                       help="the store's folder (default: ~/.cache/hf_kvcompress/prefixes, or $HF_KVCOMPRESS_CACHE/prefixes)")
    store.set_defaults(func=cmd_store)

    _add_harness_parsers(sub)
    return parser


def _add_harness_parsers(sub) -> None:
    """The ``eval`` and ``bench`` subcommands from the harness package, or two that say how to install it."""
    try:  # optional: the harness lives outside the library
        from hf_kvcompress_eval.bench import add_bench_parser
        from hf_kvcompress_eval.cli import add_eval_parser
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != EVAL_PACKAGE:
            raise
        for name in ("eval", "bench"):
            missing = sub.add_parser(name, help=f"{COMMANDS[name]} (needs the {EVAL_PACKAGE} package)")
            missing.set_defaults(func=_eval_missing)  # takes any arguments (see main): the error is about the package
        return
    add_eval_parser(sub)
    add_bench_parser(sub)


def _eval_missing(args: argparse.Namespace) -> int:
    raise CliError(f"the evaluation harness ({EVAL_PACKAGE}) is not installed: install hf_kvcompress from its "
                   "source tree, which holds both packages, with pip install -e \".[eval]\"")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg in COMMANDS for arg in argv):  # --version, --help, nothing: answered without the library
        top, sub = _top_parser()
        for name, text in COMMANDS.items():
            sub.add_parser(name, help=text)
        top.parse_args(argv)  # prints and exits: a command is required
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.func is not _eval_missing:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # what parse_args says
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    finish = getattr(args, "finish_parsing", None)
    if finish is not None:  # a command's own options (bench NAME's): their --help answers before torch loads
        finish(args)
    try:
        if args.command != "store":  # eval and bench then set torch's threads their measurements use
            from .threads import configure_threads

            args.thread_plan = configure_threads()
        return func(args)
    except CliError as err:
        if args.verbose:
            raise
        print(f"hf-kvcompress {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
