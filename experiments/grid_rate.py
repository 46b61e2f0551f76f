"""What does the `grid` predictor (issue 48: `below`'s maps on integer grids, exact on every CPU) cost in rate and
time against `below`?

For SmolLM2 at ``--tokens`` held-out tokens (one DynamicCache prefill, a `CompressedCache` per predictor filled from
it, `lanes`, 128-token blocks, as ``hf-kvcompress bench predictors`` fills its caches):

- bits/scalar of `below` and `grid`, and of `grid` with wider grids (``--wider``: 9 and 12 bits, float64 products,
  exact at these sizes too but ~2x the product's time): what the 7-bit grid costs;
- the predictor's time per layer and kind at ``--tokens`` tokens (one block of the whole prompt per layer, predict
  and observe both kinds, one thread, medians of ``--repeats``): `below` (generation's float32), `below` portable
  (what files and chunks compute today) and `grid`.

    python experiments/grid_rate.py --calibration DIR [--tokens 2048] [--repeats 3] [--wider]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.predictors import grid
from hf_kvcompress.predictors.base import BlockInputs
from hf_kvcompress.predictors.below import BelowPredictor
from hf_kvcompress.predictors.grid import GridPredictor
from hf_kvcompress_eval.bench.common import workload
from hf_kvcompress_eval.bench.generate import fill
from hf_kvcompress_eval.bench.predictors import prefilled


def bits(model, calibration, prefix, name: str) -> float:
    cache = CompressedCache(CompressionConfig(mode="lossless", lossless={"predictor": name, "coder": "lanes"}),
                            model=model, calibration=calibration)
    fill(cache, prefix)
    blocks = [b for layer in cache.kv_layers() for b in layer.blocks]
    scalars = sum(len(b.rows) * b.heads * b.tokens * (b.dim + b.value_dim) for b in blocks)
    return 8.0 * sum(b.nbytes() for b in blocks) / scalars


def layer_kind_ms(predictor, prefix, heads: int) -> float:
    below, total = None, 0.0
    for layer, (k, v) in enumerate(prefix):
        inputs = BlockInputs(layer, 1, torch.arange(k.shape[2]), below)
        start = time.perf_counter()
        session = predictor.session(inputs)
        for kind, x in (("k", k), ("v", v)):
            session.predict_kind(kind, heads)
            session.observe_kind(kind, x)
        below = session.finish(k, v)
        total += time.perf_counter() - start
    return 1e3 * total / (2 * len(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", required=True, help="a calibration of SmolLM2 with below heads")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wider", action="store_true", help="also grids of 9 and 12 bits (float64 products)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = workload(False)
    calibration = Calibration.load(args.calibration, work.model)
    prefix, _ = prefilled(work.model, work.ids(args.tokens, split="evaluation"))
    for name in ("below", "grid"):
        print(f"{name}: {bits(work.model, calibration, prefix, name):.4f} bits/scalar (lanes)", flush=True)
    heads = calibration.meta["model"]["kv_heads"]
    predictors = {"below": BelowPredictor(calibration), "below portable": BelowPredictor(calibration, portable=True),
                  "grid": GridPredictor(calibration)}
    times: dict[str, list[float]] = {name: [] for name in predictors}
    for _ in range(args.repeats):  # alternating, so that the machine's drift hits all alike
        for name, predictor in predictors.items():
            times[name].append(layer_kind_ms(predictor, prefix, heads))
    for name, found in times.items():
        print(f"{name}: {statistics.median(found):.2f} ms per layer and kind at {args.tokens} tokens (one thread)")
    if args.wider:
        exact, saved = grid.exact_float32_matmul, (grid.GRID_BITS, grid.Q_MAX)
        grid.exact_float32_matmul = lambda: False  # float64 products: exact for these grids' sums
        try:
            for width in (9, 12):
                grid.GRID_BITS, grid.Q_MAX = width, 2**width - 1
                print(f"grid, {width} bits: {bits(work.model, calibration, prefix, 'grid'):.4f} bits/scalar", flush=True)
        finally:
            grid.exact_float32_matmul, (grid.GRID_BITS, grid.Q_MAX) = exact, saved


if __name__ == "__main__":
    main()
