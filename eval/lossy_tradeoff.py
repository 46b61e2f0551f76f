"""Speed against quality of summary variants (docs/lossy.md, *Speed and queries*): every variant is a set of
`LossyConfig` fields on top of the defaults, compared in one process on the same captured prefills.

- ``--quality``: the reduced setting of that section (SmolLM2, one segment of the evaluation split: 1,024 context
  + 256 continuation tokens, summaries every 128, window 64, 4 sinks, budget 0.3): attention error of held-out
  queries, perplexity of the continuation, held bytes after the context / full cache.
- speed (default): one captured prefill of ``--context`` tokens replayed into a fresh cache per variant,
  ``--rounds`` times in alternating order; prints the median CPU seconds (``time.thread_time``) of the
  summaries of all layers (the part of `eval/lossy_speed.py`'s prefill that differs from `DynamicCache`).

    python eval/lossy_tradeoff.py --variant base '{}' --variant rq128 '{"reference_queries": 128}'
    python eval/lossy_tradeoff.py --quality --dtype float32 --variant base '{}' ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress_eval.capture import capture, replay
from hf_kvcompress_eval.lossy import (
    _raw_bytes,
    attention_errors,
    continuation_nll,
    lossy_setting,
    physical_bytes,
)


def quality(model, tokenizer, variants: dict[str, dict], args) -> None:
    context, continuation = args.context, args.continuation
    ids = token_ids(tokenizer, context + continuation, split="evaluation")
    full = capture(model, ids, logits_to_keep=continuation + 1)
    states = full.slice(0, context)
    nll_full = torch.nn.functional.cross_entropy(full.logits[0, :-1].float(), ids[0, context:])
    print(f"{'variant':<16} {'memory':>7} {'attn err':>9} {'ppl':>8} {'summary s':>9}")
    print(f"{'full':<16} {1.0:>7.3f} {0.0:>9.4f} {nll_full.exp().item():>8.3f}")
    for name, fields in variants.items():
        setting = lossy_setting(model, name, fields, args.budget, window=args.window, interval=args.interval,
                                sinks=4)
        start = time.thread_time()
        cache = replay(setting.make(), states)
        seconds = time.thread_time() - start
        memory = physical_bytes(cache) / _raw_bytes(states)
        err = sum(attention_errors(cache, full, context, 4)) / len(full.states)
        nll = continuation_nll(model, cache, ids, context, args.interval, full.logits[:, 0]).mean()
        print(f"{name:<16} {memory:>7.3f} {err:>9.4f} {nll.exp().item():>8.3f} {seconds:>9.2f}", flush=True)


def speed(model, tokenizer, variants: dict[str, dict], args) -> None:
    ids = token_ids(tokenizer, args.context, split="evaluation")
    states = capture(model, ids)
    times: dict[str, list[float]] = {name: [] for name in variants}
    settings = {name: lossy_setting(model, name, fields, args.budget, window=args.window, interval=256, sinks=4)
                for name, fields in variants.items()}
    for r in range(args.rounds):
        order = list(settings) if r % 2 == 0 else list(settings)[::-1]
        for name in order:
            cache = settings[name].make()
            start = time.thread_time()
            replay(cache, states)
            times[name].append(time.thread_time() - start)
            del cache
    print(f"{args.context} tokens, budget {args.budget}, {args.rounds} rounds: median CPU s of replay (summaries)")
    for name, t in times.items():
        print(f"{name:<16} {statistics.median(t):>7.3f}   runs {' '.join(f'{x:.2f}' for x in t)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "JSON"), required=True,
                        help="a name and LossyConfig fields as JSON (repeatable)")
    parser.add_argument("--quality", action="store_true")
    parser.add_argument("--context", type=int)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--interval", type=int, default=128)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    args.context = args.context or (1024 if args.quality else 2048)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    variants = {name: json.loads(fields) for name, fields in args.variant}
    with torch.inference_mode():
        (quality if args.quality else speed)(model, tokenizer, variants, args)


if __name__ == "__main__":
    main()
