"""Question (issue 48): how fast does the ``mhuff`` coder decode a calibrated predictor's blocks, against ``huff``
and ``lanes``?

One layer's key blocks at 2,048 tokens as `below` hands them to the codec: 48 bf16 streams of 64 channels x 128
tokens around per-element means with per-element spreads (experiments/huff_element_speed.py's synthetic data),
decoded with those statistics by `codec.decode_batch` on one thread, the minimum of ``--repeats`` runs each, with
mhuff at codes of 10 and 11 bits. Answer (2 cores shared, load ~3): huff 2.9-3.2 ms, mhuff 5.5-5.6 ms (11-bit codes
5.7-5.9), lanes 29-31 ms; mhuff's time is its decode loop (3.6 ms against huff's 1.7: four 4 KiB tables per stream),
not its tables (0.15 ms) or contexts.

    python experiments/mhuff_speed.py [--repeats 15]
"""

from __future__ import annotations

import argparse

import torch
from huff_element_speed import best_ms, synthetic_blocks  # experiments/ is the script's folder: sys.path[0]

from hf_kvcompress.codec import CodecConfig, decode_batch, encode_batch
from hf_kvcompress.codec.huff_coder import huff, mhuff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, mean, std = synthetic_blocks()
    for name in ("huff", "lanes", "mhuff"):
        cfg = CodecConfig(coder=name)
        blobs = encode_batch(x, mean, std, cfg)
        assert torch.equal(decode_batch(blobs, mean, std, cfg).view(torch.int16), x.view(torch.int16))
        ms = best_ms(lambda b=blobs, c=cfg: decode_batch(b, mean, std, c, threads=1), args.repeats)
        print(f"{name}: decode_batch {ms:.2f} ms, {8 * sum(map(len, blobs)) / x.numel():.3f} bits/scalar")
    spec = mhuff.spec(mhuff.K_BITS, 11)
    blobs = huff.encode_family(x, mean, std, spec)
    ms = best_ms(lambda: huff.decode_batch_impl(blobs, mean, std, threads=1, spec=spec), args.repeats)
    print(f"mhuff max_len=11: decode_batch {ms:.2f} ms")


if __name__ == "__main__":
    main()
