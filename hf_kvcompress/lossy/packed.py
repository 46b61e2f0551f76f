"""Kept entries stored in 8 bits: a summary (or Top-K / StreamingLLM selection) whose kept keys and values are
then quantized (measured against transformers' `QuantizedCache` in docs/lossy.md, *Composed with 8-bit
entries*).

Each key or value vector (one entry of one KV head) is stored as ``head_dim`` 8-bit codes and one float16 scale:
``int8`` symmetric absmax (scale = absmax / 127, as in LLM.int8(), Dettmers et al. 2022,
https://arxiv.org/abs/2208.07339, per vector here) or ``fp8`` (``float8_e4m3fn``, scale = absmax / 448, the format's
largest finite value; Micikevicius et al. 2022, https://arxiv.org/abs/2209.05433). The sinks and the recent window
stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import ENTRY_FORMATS

_CODE = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.float16


@dataclass
class Packed:
    """``[b, h, n, d]`` vectors as 8-bit ``codes`` and ``scales`` ``[b, h, n, 1]``; ``dtype``: what `unpack` gives."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def unpack(self) -> torch.Tensor:
        return (self.codes.float() * self.scales.float()).to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def map(self, fn) -> Packed:
        """The same vectors with ``fn`` applied to codes and scales (row selection, device moves)."""
        return Packed(fn(self.codes), fn(self.scales), self.dtype)


def pack(x: torch.Tensor, fmt: str) -> torch.Tensor | Packed:
    """``x`` stored in ``fmt`` (``"model"``: unchanged)."""
    if fmt == "model":
        return x
    if fmt not in _CODE:
        raise ValueError(f"entry format must be one of {list(ENTRY_FORMATS)}, got {fmt!r}")
    code_dtype, top = _CODE[fmt]
    xf = x.float()
    # the codes are made with the rounded scale, so unpack() returns exactly what they encode
    scale = (xf.abs().amax(-1, keepdim=True) / top).clamp_min(1e-8).to(SCALE_DTYPE)
    scaled = (xf / scale.float()).clamp_(-top, top)
    codes = scaled.round_().to(code_dtype) if fmt == "int8" else scaled.to(code_dtype)
    return Packed(codes, scale, x.dtype)


def unpack(x: torch.Tensor | Packed) -> torch.Tensor:
    return x.unpack() if isinstance(x, Packed) else x


def vector_bytes(head_dim: int, element_size: int, fmt: str) -> int:
    """Bytes of one stored key or value vector (one entry, one KV head)."""
    if fmt == "model":
        return head_dim * element_size
    return head_dim + torch.finfo(SCALE_DTYPE).bits // 8
