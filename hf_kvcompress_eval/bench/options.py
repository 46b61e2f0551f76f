"""Every benchmark's options and ``--smoke`` values (`OPTIONS`), apart from the benchmarks themselves: building a
bench's parser (``hf-kvcompress bench NAME --help``) must not import torch or transformers, which each benchmark's
module does at its top. Numeric options are checked at parse time (`hf_kvcompress.validation`'s argparse types)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from hf_kvcompress.threads import MAX_WORKERS
from hf_kvcompress.validation import int_arg, number_arg

POSITIVE = int_arg(minimum=1)
COUNT = int_arg(minimum=0)
#: the codec bench's sections (``--sections``)
SECTIONS = ("rate", "windows", "realistic", "lanes", "fast")


# ---------------------------------------------------------------------- generate

SMOKE_GENERATE = {"contexts": "32", "steps": 2, "budgets": "0.5", "block_tokens": 8, "residual_tokens": 4,
         "calibration_tokens": 64}


def _generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--steps", type=POSITIVE, default=5)
    parser.add_argument("--budgets", default="0,0.05,0.5", help="LosslessConfig.decoded_budget values")
    parser.add_argument("--predictors", default="all",
                        help="comma-separated predictors a cache generates with, or all (default: every one)")
    parser.add_argument("--coders", default="huff,lanes",
                        help="LosslessConfig.coder values, each beside the others (default: the fast coder and lanes)")
    parser.add_argument("--block-tokens", type=POSITIVE, default=None,
                        help="CompressionConfig.block_tokens (default: the lossless default)")
    parser.add_argument("--residual-tokens", type=COUNT, default=None,
                        help="CompressionConfig.residual_tokens (default: the lossless default)")
    parser.add_argument("--calibration-tokens", type=POSITIVE, default=2048)
    parser.add_argument("--threads", type=COUNT, default=1,
                        help="torch threads for every configuration (the shared machine: 1; 2 = both cores; "
                             "0 = the library's thread plan)")
    parser.add_argument("--workers", type=int_arg(minimum=1, maximum=MAX_WORKERS), default=None,
                        help="LosslessConfig.workers: codec threads per block batch (default: the config's, "
                             "i.e. the thread plan's: every core the process may run on, or HF_KVCOMPRESS_THREADS)")


# ---------------------------------------------------------------------- codec

SMOKE_CODEC = {"tokens": 64, "calib_tokens": 64, "realistic_tokens": 64, "block_tokens": 16, "repeats": 1,
         "lanes_repeats": 1, "layer": 1}


def _codec(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=POSITIVE, default=2048, help="prefill length of the coded cache")
    ap.add_argument("--calib-tokens", type=POSITIVE, default=2048, help="tokens of calibration text for mean/std")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the saved JSON")
    ap.add_argument("--sections", default="all",
                    help=f"comma-separated, of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--realistic-tokens", type=POSITIVE, default=512, help="realistic: tokens of text")
    ap.add_argument("--block-tokens", type=POSITIVE, default=256, help="realistic: the cache's block tokens")
    ap.add_argument("--streams", default=None, help="realistic: captured streams (.pt) to load, or to save to")
    ap.add_argument("--repeats", type=POSITIVE, default=3, help="realistic: timing rounds (best is reported)")
    ap.add_argument("--lanes-repeats", type=POSITIVE, default=7, help="lanes: timing repeats (best is reported)")
    ap.add_argument("--batch", type=POSITIVE, default=1, help="lanes: blocks of 6 streams coded per call")
    ap.add_argument("--real", action="store_true", help="lanes: the model's K/V instead of synthetic values")
    ap.add_argument("--layer", type=COUNT, default=10, help="lanes --real: the layer")


# ---------------------------------------------------------------------- prefix

SMOKE_PREFIX = {"prefixes": "256"}


def _prefix(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefixes", default="512,2048,8192")
    parser.add_argument("--repeats", type=POSITIVE, default=5)
    parser.add_argument("--threads", type=COUNT, default=2,
                        help="torch threads (2 as docs/results/prefix.md measured; 0 = the library's thread plan)")
    parser.add_argument("--offset", type=COUNT, default=3000, help="first token of the held-out text used")
    parser.add_argument("--calibrated", default="context,below",
                        help="calibrated predictors given store and load routes beside generic's (comma-separated)")
    parser.add_argument("--no-context", action="store_true", help="skip the calibrated routes (--calibrated '')")
    parser.add_argument("--sliding-window", type=COUNT, default=0,
                        help="run the model as a sliding-window architecture of this window (its weights in a "
                             "Mistral config; calibrated routes skipped: calibrations cover full attention only); "
                             "0: as it is")


# ---------------------------------------------------------------------- lmcache

SMOKE_LMCACHE = {"tokens": 256, "calib_tokens": 64}


def _lmcache(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=POSITIVE, default=1024, help="evaluation tokens (chunks of 256)")
    parser.add_argument("--calibration", help="a saved calibration with the context predictor")
    parser.add_argument("--calib-tokens", type=POSITIVE, default=16384)


# ---------------------------------------------------------------------- predictors

SMOKE_PREDICTORS = {"tokens": 48, "steps": 2, "held_tokens": 64, "block_tokens": 8, "fit_tokens": 64}


def _predictors(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--predictors", default="generic,none,context,below,below:huff",
                        help="comma-separated predictors a cache generates with (not the storage-only ones), each "
                             "optionally name:coder; generic first (the ratios' base)")
    parser.add_argument("--tokens", type=POSITIVE, default=2048)
    parser.add_argument("--steps", type=POSITIVE, default=5)
    parser.add_argument("--repeats", type=POSITIVE, default=3)
    parser.add_argument("--held-tokens", type=COUNT, default=8192, help="0: skip the held bytes at a longer prompt")
    parser.add_argument("--held-predictors", default="generic,below")
    parser.add_argument("--threads", type=COUNT, default=1)
    parser.add_argument("--block-tokens", type=POSITIVE, default=128)
    parser.add_argument("--fit-tokens", type=POSITIVE, default=None,
                        help="calibration tokens (default: calibration.FIRST_USE_TOKENS, a first use's)")


# ---------------------------------------------------------------------- kernels

SMOKE_KERNELS: dict = {}  # --smoke picks its own sizes (SIZES) and one repeat


def _kernels(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeat", type=POSITIVE, default=5)


# ---------------------------------------------------------------------- chunked

SMOKE_CHUNKED = {"contexts": "96", "chunk": 32, "methods": "summary", "oneshot": "streaming", "window": 8}


def _chunked(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="8192,16384", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--chunk", type=POSITIVE, default=512, help="tokens per forward of the chunked prefills")
    parser.add_argument("--budget", type=number_arg(low=0.0, high=1.0, low_open=True), default=0.25, help="the lossy caches' budget (LossyConfig.budget)")
    parser.add_argument("--window", type=COUNT, default=64, help="the lossy caches' exact recent window")
    parser.add_argument("--methods", default="all", help="methods prefilled in chunks, comma-separated, or 'all'")
    parser.add_argument("--oneshot", default="summary", help="methods also prefilled in one forward ('' for none)")
    parser.add_argument("--no-dynamic", action="store_true", help="skip the DynamicCache rows")
    parser.add_argument("--threads", type=COUNT, default=1, help="torch threads of each setting's process")
    parser.add_argument("--fresh", action="store_true", help="forget the rows of earlier runs in the folder")
    parser.add_argument("--worker", help=argparse.SUPPRESS)


#: bench name -> (its ``add_arguments(parser)``, ``SMOKE``: the option values ``--smoke`` puts in place of the defaults)
OPTIONS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], dict]] = {
    "generate": (_generate, SMOKE_GENERATE), "codec": (_codec, SMOKE_CODEC), "prefix": (_prefix, SMOKE_PREFIX),
    "lmcache": (_lmcache, SMOKE_LMCACHE), "predictors": (_predictors, SMOKE_PREDICTORS),
    "kernels": (_kernels, SMOKE_KERNELS), "chunked": (_chunked, SMOKE_CHUNKED),
}
