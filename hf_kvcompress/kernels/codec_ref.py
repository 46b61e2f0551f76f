"""Pure-torch reference of the codec's per-element model (docs/codec.md sections 1-2), on any device.

Integer arithmetic only (int64 lanes), a line-by-line port of `hf_kvcompress.codec.params.
element_params_reference` and `hf_kvcompress.codec.symbols`, so it gives the same bits as the numpy codec
on every device. Inputs are bit patterns: float32 mean / std as int32 tensors (``t.view(torch.int32)``),
values as int16 (bfloat16, float16) or int32 (float32) tensors.
"""

from __future__ import annotations

import torch

from ..codec import model as M
from ..codec.symbols import FP16, Format

_MAX_BF16 = 0x7F7F
_MAX_FP16_13 = (30 << 7) | 127


def _u32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64) & 0xFFFFFFFF


def _rne_shift(v: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    sh = sh.clamp(1, 62)
    return (v + (1 << (sh - 1)) - 1 + ((v >> sh) & 1)) >> sh


def rounded_mean(mean_bits: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, ...]:
    """(sign, grid pattern, grid exponent field, fraction) as in `hf_kvcompress.codec.params.rounded_mean`."""
    mb = _u32(mean_bits)
    sign = (mb >> 31) & 1
    mag = mb & 0x7FFFFFFF
    if fmt.truncated:
        mag = (mag - 0x8000).clamp_min(0)
    hi = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    frac = mag - (hi << 16)
    clamp = hi > _MAX_BF16
    hi = torch.where(clamp, _MAX_BF16, hi)
    frac = torch.where(clamp, 0, frac)
    if fmt is FP16:
        e8 = hi >> 7
        normal = ((e8 - 112) << 7) | (hi & 127)
        e32 = mag >> 23
        sub = torch.where(e32 >= 1, _rne_shift((mag & 0x7FFFFF) | 0x800000, 129 - e32), 0)
        p = torch.where(e8 >= 143, _MAX_FP16_13, torch.where(e8 >= 113, normal, sub))
        frac = torch.where((e8 >= 113) & (e8 < 143), frac, 0)
    else:
        p = hi
    return sign, p, p >> 7, frac


def element_params(mean_bits: torch.Tensor, std_bits: torch.Tensor, fmt: Format, mean_steps: int,
                   radius: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tid, cp, cn, s) per element, int32; ``radius``: the tables' R per table id (int32, on the device)."""
    z = fmt.zero_key
    sign, p, ge, frac = rounded_mean(mean_bits, fmt)
    key_m = torch.where(sign == 0, z + p, z - 1 - p)
    fk = torch.where(sign == 0, frac, -frac)
    gm = p & 127
    mant8 = torch.where(ge >= 1, 128 | gm, gm)
    ge1 = ge.clamp_min(1)
    ex = ge1 + fmt.exp_offset - 134
    u_exp = ge1 + fmt.exp_offset - 7

    sb = _u32(std_bits)
    es = sb >> 23
    j = (sb >> 20) & 7
    lcs = sb >> 20
    sh = ex - (es - 127) + 12
    mrel = torch.where(sh >= 0, mant8 << sh.clamp(0, 24), mant8 >> (-sh).clamp(0, 40))
    den = 17 + 2 * j
    tl = torch.div(mrel * 128 + den * 2048, den * 4096, rounding_mode="floor")
    wide = (es > 0) & (tl < M.W_T_LEVELS)
    tk = torch.div(mrel * (16 * mean_steps) + den * 2048, den * 4096, rounding_mode="floor")

    base = (es - fmt.exp_offset - M.W_LOW) * 128
    tid_w = M.W_BASE + j * M.W_T_LEVELS + (tk * (8 // mean_steps)).clamp_max(M.W_T_LEVELS - 1)
    cp_w = z + base - M.W_HALF
    cn_w = z - base - M.W_HALF
    s_w = 1 - 2 * sign

    level = torch.where(es == 0, 0, (lcs - M.SUB * u_exp - M.SUB * M.N_OCT_MIN).clamp(0, M.N_LEVELS - 1))
    q = (fk.abs() * 16 + 32768) >> 16
    with_off = level < M.N_OFFSET_LEVELS
    tid_n = torch.where(with_off, level * M.N_OFFSETS + q, M.N_OFFSET_LEVELS * M.N_OFFSETS + level - M.N_OFFSET_LEVELS)
    s_n = torch.where(with_off & (fk < 0), -1, 1)
    cp_n = key_m - radius.to(torch.int64)[tid_n]

    i32 = torch.int32
    return (torch.where(wide, tid_w, tid_n).to(i32), torch.where(wide, cp_w, cp_n).to(i32),
            torch.where(wide, cn_w, cp_n).to(i32), torch.where(wide, s_w, s_n).to(i32))


# ------------------------------------------------------------------ symbol transforms


def split_bits(bits: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Value bit patterns (int16 / int32 tensor) -> (key, raw low bits), int32 (raw is 0 for bfloat16)."""
    b = bits.to(torch.int64) & (0xFFFFFFFF if fmt.raw_bits == 16 else 0xFFFF)
    raw = b & ((1 << fmt.raw_bits) - 1)
    pattern = b >> fmt.raw_bits
    z = fmt.zero_key
    key = torch.where(pattern < z, pattern + z, 2 * z - 1 - pattern)
    return key.to(torch.int32), raw.to(torch.int32)


def join_bits(key: torch.Tensor, raw: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Inverse of `split_bits`: int16 bit patterns for bfloat16 / float16, int32 for float32."""
    k = key.to(torch.int64)
    z = fmt.zero_key
    pattern = torch.where(k >= z, k - z, 2 * z - 1 - k)
    b = (pattern << fmt.raw_bits) | (raw.to(torch.int64) & ((1 << fmt.raw_bits) - 1))
    if fmt.raw_bits == 16:
        return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32)
    return torch.where(b >= 1 << 15, b - (1 << 16), b).to(torch.int16)


# ------------------------------------------------------------------ x -> coded symbol, and back


def encode_model(value_bits: torch.Tensor, mean_bits: torch.Tensor, std_bits: torch.Tensor, fmt: Format,
                 mean_steps: int, tables) -> dict[str, torch.Tensor]:
    """Everything the entropy coder needs per element, int32: ``tid``, ``group`` (``tid``, or 968 when
    escaped), ``sym`` (table symbol, or the bit pattern when escaped), ``freq`` and ``cum`` of that symbol
    (its interval out of 2^24), ``escaped`` (0/1), ``raw`` low bits, plus ``cp``/``cn``/``s``."""
    tid, cp, cn, s = element_params(mean_bits, std_bits, fmt, mean_steps, tables.radius)
    key, raw = split_bits(value_bits, fmt)
    t64, k = tid.to(torch.int64), key.to(torch.int64)
    size = tables.size.to(torch.int64)[t64]
    half = tables.half.to(torch.int64)[t64]
    cp64, cn64 = cp.to(torch.int64), cn.to(torch.int64)
    s0 = k - torch.where(k >= fmt.zero_key, cp64, cn64)
    valid = (s0 >= 0) & (s0 < size) & ((k < cn64 + half) | (k >= cp64 + half))
    sym = torch.where(s > 0, s0, size - 1 - s0)
    pattern = torch.where(k >= fmt.zero_key, k - fmt.zero_key, 2 * fmt.zero_key - 1 - k)
    sym = torch.where(valid, sym, pattern)
    group = torch.where(valid, t64, M.ESCAPE_GROUP)
    idx = tables.off[group] + sym
    i32 = torch.int32
    return {"tid": tid, "cp": cp, "cn": cn, "s": s, "group": group.to(i32), "sym": sym.to(i32),
            "freq": tables.freq[idx], "cum": tables.cum[idx], "escaped": (~valid).to(i32), "raw": raw}


def decode_keys(sym: torch.Tensor, escaped: torch.Tensor, tid: torch.Tensor, cp: torch.Tensor, cn: torch.Tensor,
                s: torch.Tensor, fmt: Format, tables) -> torch.Tensor:
    """Decoded symbols back to keys (int32): the inverse of `encode_model`'s symbol mapping."""
    t64, y = tid.to(torch.int64), sym.to(torch.int64)
    size = tables.size.to(torch.int64)[t64]
    s0 = torch.where(s > 0, y, size - 1 - y)
    key = s0 + torch.where(s0 >= tables.half.to(torch.int64)[t64], cp.to(torch.int64), cn.to(torch.int64))
    z = fmt.zero_key
    key_esc = torch.where(y < z, y + z, 2 * z - 1 - y)
    return torch.where(escaped != 0, key_esc, key).to(torch.int32)
