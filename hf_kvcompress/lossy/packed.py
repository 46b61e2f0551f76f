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
from itertools import accumulate, pairwise

import torch

from .registry import ENTRY_FORMATS

_CODE = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.float16


#: entry format ``mixed``: its tiers, best first; a method drops an entry only when the last tier cannot hold them all
MIXED_TIERS: tuple[str, ...] = ("int8", "int4")
#: bits per code of the formats stored with a scale and an offset (asymmetric min/max)
_ASYMMETRIC = {"int4": 4, "int2": 2}


@dataclass
class Packed:
    """``[b, h, n, d]`` vectors as ``codes`` with ``scales`` ``[b, h, n, 1]``; for the asymmetric formats also
    ``offsets`` ``[b, h, n, 1]`` and ``bits`` per code, ``8 / bits`` codes per byte (``[b, h, n, d * bits / 8]``
    uint8, element ``k * i + j`` in bits ``j * bits ..`` of byte ``i``); ``dtype``: what `unpack` gives."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    offsets: torch.Tensor | None = None
    bits: int = 8

    @property
    def shape(self) -> torch.Size:
        if self.offsets is None:
            return self.codes.shape
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 8 // self.bits))

    def unpack(self) -> torch.Tensor:
        if self.offsets is None:
            return (self.codes.float() * self.scales.float()).to(self.dtype)
        mask = (1 << self.bits) - 1
        parts = [(self.codes >> (self.bits * j)) & mask for j in range(8 // self.bits)]
        codes = torch.stack(parts, dim=-1).flatten(-2)
        return (codes.float() * self.scales.float() + self.offsets.float()).to(self.dtype)

    def nbytes(self) -> int:
        parts = (self.codes, self.scales) if self.offsets is None else (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts)

    def map(self, fn) -> Packed:
        """The same vectors with ``fn`` applied to codes and side data (row selection, device moves)."""
        offsets = None if self.offsets is None else fn(self.offsets)
        return Packed(fn(self.codes), fn(self.scales), self.dtype, offsets, self.bits)


@dataclass
class Split:
    """``[b, h, n, d]`` vectors stored in consecutive parts of ``n_i`` entries each, one format per part (entry
    format ``mixed``: `MIXED_TIERS`, best first)."""

    parts: tuple[Packed, ...]

    @property
    def shape(self) -> torch.Size:
        a = self.parts[0].shape
        return torch.Size((*a[:-2], sum(p.shape[-2] for p in self.parts), a[-1]))

    def unpack(self) -> torch.Tensor:
        return torch.cat([p.unpack() for p in self.parts], dim=-2)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def map(self, fn) -> Split:
        return Split(tuple(p.map(fn) for p in self.parts))


def pack(x: torch.Tensor, fmt: str, tiers: tuple[int, ...] = ()) -> torch.Tensor | Packed | Split:
    """``x`` stored in ``fmt`` (``"model"``: unchanged; ``"mixed"``: the first ``tiers[0]`` entries in
    ``MIXED_TIERS[0]``, the next ``tiers[1]`` in the next tier, ..., the rest in the last tier)."""
    if fmt == "model":
        return x
    if fmt == "mixed":
        if len(tiers) >= len(MIXED_TIERS):
            raise ValueError(f"pack: {len(MIXED_TIERS)} tiers take {len(MIXED_TIERS) - 1} counts, got {tiers}")
        edges = [0, *accumulate(tiers), x.shape[-2]]
        return Split(tuple(pack(x[..., a:b, :], tier) for tier, (a, b) in zip(MIXED_TIERS, pairwise(edges))))
    if fmt in _ASYMMETRIC:
        return _pack_asymmetric(x, _ASYMMETRIC[fmt])
    if fmt not in _CODE:
        raise ValueError(f"entry format must be one of {list(ENTRY_FORMATS)}, got {fmt!r}")
    code_dtype, top = _CODE[fmt]
    xf = x.float()
    # the codes are made with the rounded scale, so unpack() returns exactly what they encode
    scale = (xf.abs().amax(-1, keepdim=True) / top).clamp_min(1e-8).to(SCALE_DTYPE)
    scaled = (xf / scale.float()).clamp_(-top, top)
    codes = scaled.round_().to(code_dtype) if fmt == "int8" else scaled.to(code_dtype)
    return Packed(codes, scale, x.dtype)


def _pack_asymmetric(x: torch.Tensor, bits: int) -> Packed:
    per = 8 // bits
    if x.shape[-1] % per:
        raise ValueError(f"entry format 'int{bits}' packs {per} codes per byte: needs a head_dim divisible by {per}, "
                         f"got {x.shape[-1]}")
    xf = x.float()
    low, high = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    # codes are made with the rounded offset and scale, so unpack() returns exactly what they encode
    offset = low.to(SCALE_DTYPE)
    top = (1 << bits) - 1
    scale = ((high - offset.float()) / top).clamp_min(1e-8).to(SCALE_DTYPE)
    codes = ((xf - offset.float()) / scale.float()).round_().clamp_(0, top).to(torch.uint8)
    packed = codes[..., 0::per]
    for j in range(1, per):
        packed = packed | (codes[..., j::per] << (bits * j))
    return Packed(packed, scale, x.dtype, offset, bits)


def unpack(x: torch.Tensor | Packed | Split) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.unpack()


def vector_bytes(head_dim: int, element_size: int, fmt: str) -> int:
    """Bytes of one stored key or value vector (one entry, one KV head); ``mixed``: its last tier's (what every
    kept entry costs at least)."""
    if fmt == "model":
        return head_dim * element_size
    side = torch.finfo(SCALE_DTYPE).bits // 8
    if fmt == "mixed":
        fmt = MIXED_TIERS[-1]
    if fmt in _ASYMMETRIC:
        return -(-head_dim * _ASYMMETRIC[fmt] // 8) + 2 * side
    return head_dim + side
