"""The ``hf-kvcompress`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
from collections.abc import Callable, Sequence

import torch


class CliError(Exception):
    """A user-facing problem: printed as one line, exit status 2."""


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="hub id or local folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--dataset", default=None, help="hub dataset, local text/JSON files (default: Shakespeare)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def _load(args: argparse.Namespace):
    from .models import load_model

    try:
        return load_model(args.model, dtype=getattr(torch, args.dtype))
    except (ValueError, OSError) as err:
        raise CliError(f"unknown or unreadable model {args.model!r}: {err}") from err


def _prompt_ids(tokenizer, args: argparse.Namespace, n_tokens: int, split: str = "evaluation") -> torch.LongTensor:
    from .data import token_ids

    try:
        return token_ids(tokenizer, n_tokens, source=args.dataset, split=split)
    except ValueError as err:
        raise CliError(str(err)) from err


def cmd_demo(args: argparse.Namespace) -> int:
    """Generate with a CompressedCache on the default model and text; print the text and the cache stats."""
    from transformers import DynamicCache

    from . import CompressedCache, CompressionConfig
    from .generation import greedy_generate

    try:
        config = CompressionConfig(
            mode=args.mode, block_tokens=args.block_tokens, residual_tokens=args.residual_tokens
        )
    except (ValueError, TypeError) as err:
        raise CliError(str(err)) from err
    model, tokenizer = _load(args)
    ids = _prompt_ids(tokenizer, args, args.prompt_tokens)
    cache = CompressedCache(config, model=model)
    run = greedy_generate(model, ids, cache, args.new_tokens, progress=f"generating ({args.mode})")
    new_text = tokenizer.decode(run.sequences[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded)'}  dtype: {args.dtype}  mode: {args.mode}")
    print(f"prompt ({ids.shape[1]} tokens), last lines:")
    print(textwrap.indent(tokenizer.decode(ids[0, -60:]).strip(), "  | "))
    print(f"generated ({args.new_tokens} tokens, {run.tokens_per_second:.1f} tok/s):")
    print(textwrap.indent(new_text.strip(), "  > "))
    stats = cache.stats()
    stats.pop("per_layer")
    if args.check:
        ref = greedy_generate(model, ids, DynamicCache(), args.new_tokens, progress="reference (DynamicCache)")
        stats["identical_to_DynamicCache"] = bool(torch.equal(ref.sequences, run.sequences))
        stats["DynamicCache_tokens_per_s"] = round(ref.tokens_per_second, 2)
    stats["tokens_per_s"] = round(run.tokens_per_second, 2)
    print("cache stats:")
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:>26}: {shown}")
    if args.json:
        print(json.dumps(stats))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvcompress", description="KV-cache compression for transformers")
    parser.add_argument("-v", "--verbose", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate with CompressedCache on the default model and print its stats")
    _add_model_args(demo)
    demo.add_argument("--mode", default="lossless", choices=["none", "lossless", "lossy"])
    demo.add_argument("--prompt-tokens", type=int, default=300)
    demo.add_argument("--new-tokens", type=int, default=48)
    demo.add_argument("--block-tokens", type=int, default=64)
    demo.add_argument("--residual-tokens", type=int, default=32)
    demo.add_argument("--no-check", dest="check", action="store_false", help="skip the DynamicCache comparison")
    demo.add_argument("--json", action="store_true", help="also print the stats as one JSON line")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
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
