"""Float bit patterns <-> order-preserving integer keys, and the raw low bits that are stored uncoded.

Every supported dtype is split into a *coded pattern* of ``P`` bits (sign, exponent, 7 mantissa bits) and
``raw_bits`` low mantissa bits stored as they are:

- bfloat16: the whole 16-bit pattern is coded (``P = 16``, no raw bits);
- float32: its top 16 bits (a bfloat16 pattern, i.e. x truncated toward zero) are coded with the bfloat16
  model, the low 16 mantissa bits are stored raw (16 bits each: under any smooth model they are close to
  uniform, so coding them would gain < 0.01 bit and cost a second coder pass);
- float16: sign + 5-bit exponent + top 7 mantissa bits (``P = 13``) are coded with the same 7-mantissa-bit
  tables, the low 3 mantissa bits are stored raw (3 bits each).

The key of a pattern ``b`` (``P`` bits, sign bit ``Z = 2**(P-1)``) is ``b + Z`` for positive patterns and
``2**P - 1 - b`` for negative ones, so keys order -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN and
neighbouring values have neighbouring keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Format:
    """How one dtype is split into a coded pattern and raw low bits."""

    name: str
    code: int  # stream byte
    dtype: torch.dtype
    pattern_bits: int  # P
    raw_bits: int
    exp_offset: int  # float32 exponent field = this + pattern exponent field (0 bf16 grid, 112 fp16 grid)
    min_exp32: int  # float32 exponent field of the grid's smallest normal binade
    truncated: bool  # the coded pattern is x truncated toward zero (float32, float16), not x itself

    @property
    def zero_key(self) -> int:
        """``Z``: the key of +0; keys below it are negative values."""
        return 1 << (self.pattern_bits - 1)

    @property
    def n_patterns(self) -> int:
        return 1 << self.pattern_bits


BF16 = Format("bfloat16", 1, torch.bfloat16, 16, 0, 0, 1, False)
FP16 = Format("float16", 2, torch.float16, 13, 3, 112, 113, True)
FP32 = Format("float32", 3, torch.float32, 16, 16, 0, 1, True)
FORMATS: dict[torch.dtype, Format] = {f.dtype: f for f in (BF16, FP16, FP32)}
FORMATS_BY_CODE: dict[int, Format] = {f.code: f for f in (BF16, FP16, FP32)}


def format_of(dtype: torch.dtype) -> Format:
    """The `Format` of a supported dtype; ``TypeError`` naming the dtype otherwise."""
    try:
        return FORMATS[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in FORMATS)
        raise TypeError(f"codec supports dtypes {names}; got {dtype}") from None


def tensor_bits(x: torch.Tensor) -> np.ndarray:
    """The raw bit patterns of ``x`` (flattened, C order) as non-negative int64 (16 or 32 bits used)."""
    x = x.detach().to("cpu").contiguous().reshape(-1)
    if x.dtype == torch.float32:
        return x.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    return x.view(torch.int16).numpy().astype(np.int64) & 0xFFFF


def bits_to_tensor(bits: np.ndarray, fmt: Format, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `tensor_bits`."""
    if fmt.dtype == torch.float32:
        arr = bits.astype(np.uint32).view(np.int32)
        return torch.from_numpy(arr.copy()).view(torch.float32).reshape(shape)
    arr = bits.astype(np.uint16).view(np.int16)
    return torch.from_numpy(arr.copy()).view(fmt.dtype).reshape(shape)


def split_bits(bits: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray | None]:
    """Full bit patterns -> (keys as int32, raw low bits or None)."""
    if fmt.raw_bits:
        raw = bits & ((1 << fmt.raw_bits) - 1)
        pattern = bits >> fmt.raw_bits
    else:
        raw, pattern = None, bits
    return pattern_to_key(pattern, fmt), raw


def join_bits(keys: np.ndarray, raw: np.ndarray | None, fmt: Format) -> np.ndarray:
    """Inverse of `split_bits` (int64 bit patterns)."""
    pattern = key_to_pattern(keys, fmt).astype(np.int64)
    if fmt.raw_bits:
        assert raw is not None
        return (pattern << fmt.raw_bits) | raw.astype(np.int64)
    return pattern


def pattern_to_key(pattern: np.ndarray, fmt: Format) -> np.ndarray:
    """``P``-bit patterns -> order-preserving keys (int32)."""
    z = fmt.zero_key
    p = pattern.astype(np.int32)
    return np.where(p < z, p + z, (2 * z - 1) - p).astype(np.int32)


def key_to_pattern(keys: np.ndarray, fmt: Format) -> np.ndarray:
    """Order-preserving keys -> ``P``-bit patterns (int32); the map is its own inverse up to the offset."""
    z = fmt.zero_key
    k = keys.astype(np.int32)
    return np.where(k >= z, k - z, (2 * z - 1) - k).astype(np.int32)


def pack_raw(raw: np.ndarray, fmt: Format) -> bytes:
    """Raw low bits of one window -> bytes, padded with zeros to a multiple of 4."""
    if fmt.raw_bits == 16:
        out = raw.astype("<u2").tobytes()
    else:  # 3 bits: 8 values -> 3 bytes
        n = raw.size
        v = np.zeros(-(-n // 8) * 8, dtype=np.uint32)
        v[:n] = raw
        packed = (v.reshape(-1, 8) << (np.arange(8, dtype=np.uint32) * 3)).sum(axis=1, dtype=np.uint32)
        out = packed.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()[: raw_nbytes(n, fmt)]
    return out + b"\0" * (-len(out) % 4)


def raw_nbytes(n: int, fmt: Format) -> int:
    """Bytes of raw bits for ``n`` elements before padding."""
    return (n * fmt.raw_bits + 7) // 8


def raw_padded_nbytes(n: int, fmt: Format) -> int:
    return -(-raw_nbytes(n, fmt) // 4) * 4


def unpack_raw(buf: memoryview | bytes, n: int, fmt: Format) -> np.ndarray:
    """Inverse of `pack_raw` (int64 array of ``n`` values)."""
    if fmt.raw_bits == 16:
        return np.frombuffer(buf, dtype="<u2", count=n).astype(np.int64)
    groups = -(-n // 8)
    b = np.zeros(groups * 3, dtype=np.uint8)
    nb = raw_nbytes(n, fmt)
    b[:nb] = np.frombuffer(buf, dtype=np.uint8, count=nb)
    b = b.reshape(-1, 3).astype(np.uint32)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    vals = (word[:, None] >> (np.arange(8, dtype=np.uint32) * 3)) & 7
    return vals.reshape(-1)[:n].astype(np.int64)


def varint_bytes(v: int) -> bytes:
    """``v`` as unsigned LEB128 (the varints of the compact and lanes headers)."""
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)
