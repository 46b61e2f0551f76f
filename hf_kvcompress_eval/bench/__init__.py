"""``hf-kvcompress bench NAME``: the maintained benchmarks, one module each (``run(args) -> int``; its docstring is
its ``--help`` description), their options and ``--smoke`` values in `options` (light: ``--help`` imports no torch).
Results go to ``eval-results/bench/NAME/`` unless ``--out`` says otherwise."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from pathlib import Path

from hf_kvcompress.cli import Parser
from hf_kvcompress.threads import torch_threads

from .common import add_common_arguments
from .options import OPTIONS

#: name -> (module, what it measures)
BENCHES: dict[str, tuple[str, str]] = {
    "generate": ("hf_kvcompress_eval.bench.generate",
                 "lossless generation against DynamicCache: step time, bytes held, bits/scalar, peak RSS"),
    "codec": ("hf_kvcompress_eval.bench.codec",
              "the codec on a model's KV: rate and speed against baselines, windows, realistic streams, lanes"),
    "prefix": ("hf_kvcompress_eval.bench.prefix",
               "prefix reuse: PrefixStore and saved files against recomputing the prompt"),
    "lmcache": ("hf_kvcompress_eval.bench.lmcache",
                "the LMCache serde against LMCache's naive, fp8 and CacheGen (needs lmcache)"),
    "predictors": ("hf_kvcompress_eval.bench.predictors",
                   "the rate / speed frontier of every in-generation predictor side by side"),
    "kernels": ("hf_kvcompress_eval.bench.kernels",
                "the Triton kernels against their torch references and the memory bandwidth (GPU)"),
    "chunked": ("hf_kvcompress_eval.bench.chunked",
                "chunked lossy prefill: peak RSS, held bytes per chunk and time against DynamicCache"),
}


def bench_module(name: str):
    return importlib.import_module(BENCHES[name][0])


def _docstring(name: str) -> str | None:
    """Bench ``name``'s module docstring, read from its source: importing the module would import torch."""
    spec = importlib.util.find_spec(BENCHES[name][0])
    if spec is None or spec.origin is None:
        return None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text()), clean=False)


def bench_parser(name: str) -> argparse.ArgumentParser:
    parser = Parser(prog=f"hf-kvcompress bench {name}", description=_docstring(name),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, name)
    OPTIONS[name][0](parser)
    return parser


def parse_bench_args(name: str, argv: list[str]) -> argparse.Namespace:
    """The options of bench ``name``; with ``--smoke``, the bench's ``SMOKE`` values replace the defaults
    (options given on the command line are kept)."""
    parser = bench_parser(name)
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in OPTIONS[name][1].items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to the ``hf-kvcompress`` parser's subparsers."""
    listing = "\n".join(f"  {name:<9} {about}" for name, (_, about) in BENCHES.items())
    parser = subparsers.add_parser(
        "bench", help="run a maintained benchmark (generate, codec, prefix, lmcache, predictors, kernels, chunked)",
        description="Run one benchmark; `hf-kvcompress bench NAME --help` lists its options. Every benchmark "
        "takes --out (default: eval-results/bench/NAME) and --smoke (seconds, on a tiny random model).",
        epilog=f"benchmarks:\n{listing}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=list(BENCHES), help="the benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="its options (see hf-kvcompress bench NAME -h)")
    parser.set_defaults(func=cmd_bench, finish_parsing=finish_parsing)
    return parser


def finish_parsing(args: argparse.Namespace) -> None:
    """Parse the bench's own options (``--help`` answers here, before the command line sets up torch)."""
    args.bench_args = parse_bench_args(args.name, args.options)


def cmd_bench(args: argparse.Namespace) -> int:
    bench_args = getattr(args, "bench_args", None) or parse_bench_args(args.name, args.options)
    # a bench's --threads (0, or a bench without one: the library's thread plan), the caller's count back after
    with torch_threads(getattr(bench_args, "threads", 0)):
        return bench_module(args.name).run(bench_args)
