"""Lossy mode: periodic summaries of old cache entries (seed 004) and the baselines they are measured against.

One module per job: `layer` (the cache layer), `attention` (the attention function that feeds queries in and
applies per-entry biases), `queries` (reference-query buffer and RoPE repositioning), `budget` (byte accounting),
`entropy` (per-entry scores), `matching` + `solvers` (the least-squares fits), `packed` (kept entries in 8 bits),
and one module per method:
`summary`, `topk`, `streaming`, `svd`. See docs/lossy.md.
"""

from .attention import attach, detach
from .blocks import LossyBlock, LowRankBlock
from .layer import LossyLayer
from .methods import METHODS

__all__ = ["METHODS", "LossyBlock", "LossyLayer", "LowRankBlock", "attach", "detach"]
