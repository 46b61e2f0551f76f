"""What a chunked lossy prefill leaves resident after each chunk (issue 36): SmolLM2 bf16, ``--context`` tokens of the
evaluation split in chunks of 512 at budget 0.25, one thread; after every chunk ``gc`` and ``malloc_trim`` run, then
the process's RSS and the bytes of every tensor Python can reach (the model's parameters and buffers left out) are
printed. Growth of the RSS with no growth of the live tensors is memory the native libraries keep (oneDNN's
primitive cache: rerun with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` in the environment to compare).

    python experiments/chunked_rss_growth.py --method summary --context 2560
"""

from __future__ import annotations

import argparse
import ctypes
import gc

import torch

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.generation import prefill_in_chunks
from hf_kvcompress.models import load_model


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="summary")
    parser.add_argument("--context", type=int, default=2560)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(dtype=torch.bfloat16, attn_implementation="sdpa")
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    ids = token_ids(tokenizer, args.context, split="evaluation")
    lossy = LossyConfig(method=args.method, budget=0.25)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=64, lossy=lossy), model=model)
    with torch.inference_mode():
        for at in range(0, args.context, 512):
            prefill_in_chunks(model, ids[:, at : at + 512], cache, 512)
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in own}
            print(f"{args.method} chunk {at // 512}: rss {rss_mb():.0f} MB, live tensors "
                  f"{sum(storages.values()) / 1e6:.1f} MB, held {cache.stats()['held_bytes'] / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
