"""Question (issue 34): does the ``huff`` coder decode streams with per-element statistics (a calibrated predictor's,
such as `below`'s) as fast as streams with per-channel statistics (`generic`'s)?

One layer's key blocks at 2,048 tokens as `below` hands them to the codec: 48 bf16 streams of 64 channels x 128
tokens, drawn around per-element means with per-element spreads (synthetic: the speed does not depend on the model),
decoded with those statistics and with per-channel ones (the mean over the tokens, the residuals' std); one thread,
the minimum of ``--repeats`` runs of `codec.decode_batch` and of each of its parts (the decode kernel, the contexts,
their fingerprints). Run it at another revision by putting that revision's package first on PYTHONPATH. Answer:
docs/results/lossless.md, "Calibrated coding in batches (issue 34)".

    python experiments/huff_element_speed.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from hf_kvcompress.codec import CodecConfig, decode_batch, encode_batch
from hf_kvcompress.codec.huff_coder import huff, kernels

STREAMS, CHANNELS, TOKENS = 48, 64, 128


def best_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def synthetic_blocks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 values of `STREAMS` streams of `CHANNELS` x `TOKENS` around per-element means with per-element spreads
    (seeded): ``x``, ``mean``, ``std``."""
    g = torch.Generator().manual_seed(0)
    shape = (STREAMS, CHANNELS, TOKENS)
    mean = torch.randn(shape, generator=g) * 2
    std = torch.rand(shape, generator=g) * 0.3 + 0.05
    return (mean + std * torch.randn(shape, generator=g)).to(torch.bfloat16), mean, std


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, mean, std = synthetic_blocks()
    channel_mean = mean.mean(-1, keepdim=True)
    channel_std = (x.float() - channel_mean).std(-1, keepdim=True)
    for label, m, s in (("per channel", channel_mean, channel_std), ("per element", mean, std)):
        print(f"{label}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in measure(x, m, s, args.repeats).items()))


def measure(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor, repeats: int) -> dict[str, float]:
    """Best milliseconds of one `decode_batch` of ``x`` coded with ``m`` / ``s``, and of its parts."""
    config, fmt = CodecConfig(coder="huff"), huff.format_of(x.dtype)
    blobs = encode_batch(x, m, s, config)
    assert torch.equal(decode_batch(blobs, m, s, config).view(torch.int16), x.view(torch.int16))
    job = huff.DecodeJob(blobs, m, s, None, True)
    cx = huff.contexts(m.numpy(), s.numpy(), fmt, x.shape[1:], x.shape[0])
    fps = np.empty(x.shape[0], np.uint32)
    parts = {"decode_batch": lambda: decode_batch(blobs, m, s, config, threads=1),
             "kernel": lambda: kernels.decode_streams(*job.args, 0, x.shape[0]),
             "contexts": lambda: huff.contexts(m.numpy(), s.numpy(), fmt, x.shape[1:], x.shape[0]),
             "fingerprints": lambda: kernels.fingerprints(cx.ctx, cx.crow, cx.rows, cx.run, fps)}
    return {name: best_ms(run, repeats) for name, run in parts.items()}

if __name__ == "__main__":
    main()
