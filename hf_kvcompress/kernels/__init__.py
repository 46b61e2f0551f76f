"""Device kernels for the GPU hot paths (issue 7), each a Triton kernel with a pure-torch reference of the same
function; `dispatch` picks one per call (Triton for CUDA tensors when importable, else the reference).

- the codec's per-element model: `element_params`, `encode_model` ((x, mean, std) -> table id, symbol and the
  integer frequency / cumulative frequency of x's bin), `decode_bits`, and the dtype symbol transforms
  `split_bits` / `join_bits`; bit-exact with the numpy codec;
- the codec's entropy decoder for many windows in parallel: `decode_windows` (constriction-compatible ANS:
  the same stream format as the CPU);
- lossy mode's attention scores of cached entries from reference queries, fused: `attention_scores`.

See docs/kernels.md.
"""

from __future__ import annotations

from .ans import ans_decode, decode_windows
from .attention import attention_scores
from .codec_model import decode_bits, element_params, encode_model, join_bits, split_bits, tables_for
from .dispatch import forced, triton_available, use_triton

__all__ = [
    "ans_decode",
    "attention_scores",
    "decode_bits",
    "decode_windows",
    "element_params",
    "encode_model",
    "forced",
    "join_bits",
    "split_bits",
    "tables_for",
    "triton_available",
    "use_triton",
]
