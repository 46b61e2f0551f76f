"""Kept entries stored in 8 or 4 bits: a summary (or Top-K / StreamingLLM selection) whose kept keys and values
are then quantized (measured against transformers' `QuantizedCache` in docs/lossy.md, *Composed with quantized
entries*).

Each key or value vector (one entry of one KV head) is stored as ``head_dim`` codes with float16 side data:
``int8`` symmetric absmax (scale = absmax / 127, as in LLM.int8(), Dettmers et al. 2022,
https://arxiv.org/abs/2208.07339, per vector here), ``fp8`` (``float8_e4m3fn``, scale = absmax / 448, the format's
largest finite value; Micikevicius et al. 2022, https://arxiv.org/abs/2209.05433) or ``int4`` (asymmetric min/max
with a scale and an offset per vector, two codes per byte: the per-token group of KIVI's value cache, Liu et al.
2024, https://arxiv.org/abs/2402.02750, and of quanto's ``QuantizedCache`` at group size = head_dim). The sinks and
the recent window stay exact. ``mixed`` keeps every entry it can in 4 bits and spends what the budget leaves on
storing the most important ones in 8 bits (int8): the low-precision tail replaces eviction, as in MiKV (Yang et al.
2024, "No Token Left Behind", https://arxiv.org/abs/2402.18096); a method evicts only what does not fit in 4 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import ENTRY_FORMATS

_CODE = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.float16


@dataclass
class Packed:
    """``[b, h, n, d]`` vectors as ``codes`` with ``scales`` ``[b, h, n, 1]`` (and, for ``int4``, ``offsets``
    ``[b, h, n, 1]``, the codes two per byte: ``[b, h, n, d / 2]`` uint8, element ``2i`` in the low nibble);
    ``dtype``: what `unpack` gives."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    offsets: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        if self.offsets is None:
            return self.codes.shape
        return torch.Size((*self.codes.shape[:-1], 2 * self.codes.shape[-1]))

    def unpack(self) -> torch.Tensor:
        if self.offsets is None:
            return (self.codes.float() * self.scales.float()).to(self.dtype)
        nibbles = torch.stack([self.codes & 15, self.codes >> 4], dim=-1).flatten(-2)
        return (nibbles.float() * self.scales.float() + self.offsets.float()).to(self.dtype)

    def nbytes(self) -> int:
        parts = (self.codes, self.scales) if self.offsets is None else (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts)

    def map(self, fn) -> Packed:
        """The same vectors with ``fn`` applied to codes and side data (row selection, device moves)."""
        return Packed(fn(self.codes), fn(self.scales), self.dtype, None if self.offsets is None else fn(self.offsets))


@dataclass
class Split:
    """``[b, h, n, d]`` vectors whose first ``high.shape[-2]`` entries are stored in one format and the rest in
    another (entry format ``mixed``: int8, then int4)."""

    high: Packed
    low: Packed

    @property
    def shape(self) -> torch.Size:
        a, b = self.high.shape, self.low.shape
        return torch.Size((*a[:-2], a[-2] + b[-2], a[-1]))

    def unpack(self) -> torch.Tensor:
        return torch.cat([self.high.unpack(), self.low.unpack()], dim=-2)

    def nbytes(self) -> int:
        return self.high.nbytes() + self.low.nbytes()

    def map(self, fn) -> Split:
        return Split(self.high.map(fn), self.low.map(fn))


def pack(x: torch.Tensor, fmt: str, high: int = 0) -> torch.Tensor | Packed | Split:
    """``x`` stored in ``fmt`` (``"model"``: unchanged; ``"mixed"``: the first ``high`` entries in int8, the rest in
    int4)."""
    if fmt == "model":
        return x
    if fmt == "mixed":
        return Split(pack(x[..., :high, :], "int8"), pack(x[..., high:, :], "int4"))
    if fmt == "int4":
        return _pack_int4(x)
    if fmt not in _CODE:
        raise ValueError(f"entry format must be one of {list(ENTRY_FORMATS)}, got {fmt!r}")
    code_dtype, top = _CODE[fmt]
    xf = x.float()
    # the codes are made with the rounded scale, so unpack() returns exactly what they encode
    scale = (xf.abs().amax(-1, keepdim=True) / top).clamp_min(1e-8).to(SCALE_DTYPE)
    scaled = (xf / scale.float()).clamp_(-top, top)
    codes = scaled.round_().to(code_dtype) if fmt == "int8" else scaled.to(code_dtype)
    return Packed(codes, scale, x.dtype)


def _pack_int4(x: torch.Tensor) -> Packed:
    if x.shape[-1] % 2:
        raise ValueError(f"entry format 'int4' packs two codes per byte: needs an even head_dim, got {x.shape[-1]}")
    xf = x.float()
    low, high = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    # codes are made with the rounded offset and scale, so unpack() returns exactly what they encode
    offset = low.to(SCALE_DTYPE)
    scale = ((high - offset.float()) / 15).clamp_min(1e-8).to(SCALE_DTYPE)
    codes = ((xf - offset.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)
    return Packed(codes[..., 0::2] | (codes[..., 1::2] << 4), scale, x.dtype, offset)


def unpack(x: torch.Tensor | Packed | Split) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.unpack()


def vector_bytes(head_dim: int, element_size: int, fmt: str) -> int:
    """Bytes of one stored key or value vector (one entry, one KV head); ``mixed``: its 4-bit form (what every kept
    entry costs at least)."""
    if fmt == "model":
        return head_dim * element_size
    side = torch.finfo(SCALE_DTYPE).bits // 8
    if fmt in ("int4", "mixed"):
        return -(-head_dim // 2) + 2 * side
    return head_dim + side
