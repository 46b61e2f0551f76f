"""One summary fit (`lossy.matching.fit_row`) at the shapes of a chunked prefill's summaries on SmolLM2 (3 KV heads,
768 reference queries per KV head, 64 channels, 68 exact context entries; random keys, values and queries, seeded):
its seconds (best of 3, one thread) and the resident-memory growth over the fits (issue 36: the summary's cost per
chunk). Run it against another revision of the package by putting that revision's tree first on PYTHONPATH:

    python experiments/summary_fit_cost.py                       # region 2,560 (2,048 kept + 512 new), 2,048 kept
    git worktree add /tmp/before 5325df7 && PYTHONPATH=/tmp/before:. python experiments/summary_fit_cost.py
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_kvcompress
from hf_kvcompress.config import LossyConfig
from hf_kvcompress.lossy.matching import Kernel, fit_row
from hf_kvcompress.lossy.region import FitContext, Region
from hf_kvcompress.lossy.scores import top_entries
from hf_kvcompress_eval.env import PeakMemory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--region", type=int, default=2560, help="entries the summary sees")
    parser.add_argument("--kept", type=int, default=2048, help="entries it keeps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    h, d, m, exact = 3, 64, 768, 68
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    region = Region(randn(1, h, args.region, d), randn(1, h, args.region, d), randn(1, h, args.region, scale=0.1),
                    args.region)
    ctx = FitContext(randn(1, h, m, d, scale=2.0), torch.ones(1, h, m), randn(1, h, exact, d), randn(1, h, exact, d),
                     torch.zeros(1, h, exact), d**-0.5, True, LossyConfig())
    kernel = Kernel(region, ctx)
    index = top_entries(kernel.mass(), args.kept)
    fit_row(kernel, region, index[..., :64], use_bias=True, ridge=1e-3)  # first calls: oneDNN's setup
    seconds = []
    with PeakMemory() as peak:
        for _ in range(3):
            start = time.perf_counter()
            fit = fit_row(kernel, region, index, use_bias=True, ridge=1e-3)
            seconds.append(time.perf_counter() - start)
    print(f"{hf_kvcompress.__file__}: region {args.region}, kept {args.kept}: fit_row {min(seconds):.3f} s (best of "
          f"3), peak +{peak.peak_bytes / 1e6:.1f} MB, values norm {float(fit.values.norm()):.4f}")


if __name__ == "__main__":
    main()
