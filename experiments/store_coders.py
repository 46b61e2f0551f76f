"""Question (issue 39): does a `PrefixStore` of `huff` blocks give the first token sooner than one of `lanes` blocks?

A 2,048-token held-out prefix stored once per coder, then three interleaved runs of `cache_for` + one forward of
the 64-token suffix per store (torch on 2 threads), and one recompute after. Answer: docs/results/codec.md 13.4.

    python experiments/store_coders.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_kvcompress import CompressedCache, CompressionConfig, PrefixStore
from hf_kvcompress_eval.bench.common import workload

PREFIX, SUFFIX, REPEATS = 2048, 64, 3


def main() -> None:
    torch.set_num_threads(2)
    model = workload(False).model
    ids = workload(False).ids(PREFIX + SUFFIX, offset=3000)
    head = ids[:, :PREFIX]
    times: dict[str, list[tuple[float, float]]] = {}
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {}
        for coder in ("huff", "lanes"):
            config = CompressionConfig(mode="lossless", lossless={"coder": coder})
            filled = CompressedCache(config, model=model)
            with torch.no_grad():
                model(input_ids=head, cache=filled, use_cache=True)
            folder = Path(tmp) / coder
            PrefixStore(model, path=folder, config=config).put(head, filled)
            stores[coder] = (folder, config, PrefixStore(model, path=folder, config=config).stats()["bytes"])
            times[coder] = []
        for _ in range(REPEATS):
            for coder, (folder, config, _) in stores.items():
                t, c = time.perf_counter(), time.process_time()
                cache = PrefixStore(model, path=folder, config=config).cache_for(ids)
                with torch.no_grad():
                    out = model(input_ids=ids[:, cache.get_seq_length():], cache=cache, use_cache=True)
                times[coder].append((time.perf_counter() - t, time.process_time() - c))
                logits[coder] = out.logits[:, -1].float()
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        recompute = (time.perf_counter() - t, time.process_time() - c)
    print("identical last logits:", torch.equal(logits["huff"].view(torch.int32), logits["lanes"].view(torch.int32)))
    print(f"recompute (one run, after): wall {recompute[0]:.2f} s, process CPU {recompute[1]:.2f} s")
    for coder, runs in times.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"{coder:6} store TTFT median wall {wall:.2f} s, process CPU {cpu:.2f} s; bytes {stores[coder][2]}")


if __name__ == "__main__":
    main()
