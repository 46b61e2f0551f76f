"""Lossy mode: periodic summaries of old cache entries and the baselines they are measured against
(docs/lossy.md).

`layer` (the cache layer), `attention` (the attention function that feeds queries in and applies per-entry
biases), `queries` (reference-query buffer and RoPE repositioning), `budget` (byte accounting), `scores` (per-entry
scores), `matching` + `solvers` (the least-squares fits), `blocks` / `packed` (what is kept, in 8 bits if asked),
`registry` (every method by name) and `methods/` (one module per method: `summary`, `summary_replay` (the summary on
KVzip's context replay), `topk`, `streaming`, `svd` and the baselines `snapkv`, `tova`, `expected_attention`,
`pyramidkv`, `adakv`, `kvzip`).

This module stays light (`hf_kvcompress.config` reads the registry through it): it exports the attention switch
and the registry, not the layer.
"""

from .attention_hook import attach, detach
from .registry import METHODS, LossyMethod, register

__all__ = ["METHODS", "LossyMethod", "attach", "detach", "register"]
