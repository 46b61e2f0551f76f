"""Triton kernels for the codec's per-element model: the same integer arithmetic as `codec_ref` (and the
numpy codec), one element per lane. Only integer operations, so results do not depend on FMA contraction
or flush-to-zero. Imported only when Triton is available (see `dispatch`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codec import model as M
from ..codec.symbols import FP16, Format

BLOCK = 1024


@triton.jit
def _params(mb, sb, radius_ptr, Z: tl.constexpr, OFF: tl.constexpr, TRUNC: tl.constexpr,
            IS_FP16: tl.constexpr, MEAN_STEPS: tl.constexpr):
    """(tid, cp, cn, s) from float32 bit patterns (int64 lanes holding uint32 values)."""
    sign = (mb >> 31) & 1
    mag = mb & 0x7FFFFFFF
    if TRUNC:
        mag = tl.maximum(mag - 0x8000, 0)
    hi = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    frac = mag - (hi << 16)
    clamp = hi > 0x7F7F
    hi = tl.where(clamp, 0x7F7F, hi)
    frac = tl.where(clamp, 0, frac)
    if IS_FP16:
        e8 = hi >> 7
        normal = ((e8 - 112) << 7) | (hi & 127)
        e32 = mag >> 23
        v = (mag & 0x7FFFFF) | 0x800000
        rs = tl.minimum(tl.maximum(129 - e32, 1), 62)
        sub = tl.where(e32 >= 1, (v + (tl.full(v.shape, 1, tl.int64) << (rs - 1)) - 1 + ((v >> rs) & 1)) >> rs, 0)
        p = tl.where(e8 >= 143, (30 << 7) | 127, tl.where(e8 >= 113, normal, sub))
        frac = tl.where((e8 >= 113) & (e8 < 143), frac, 0)
    else:
        p = hi
    ge = p >> 7
    key_m = tl.where(sign == 0, Z + p, Z - 1 - p)
    fk = tl.where(sign == 0, frac, -frac)
    gm = p & 127
    mant8 = tl.where(ge >= 1, 128 | gm, gm)
    ge1 = tl.maximum(ge, 1)
    ex = ge1 + OFF - 134
    u_exp = ge1 + OFF - 7

    es = sb >> 23
    j = (sb >> 20) & 7
    lcs = sb >> 20
    sh = ex - (es - 127) + 12
    up = tl.minimum(tl.maximum(sh, 0), 24)
    down = tl.minimum(tl.maximum(-sh, 0), 40)
    mrel = tl.where(sh >= 0, mant8 << up, mant8 >> down)
    den = 17 + 2 * j
    tl_fine = (mrel * 128 + den * 2048) // (den * 4096)
    wide = (es > 0) & (tl_fine < 64)
    tk = (mrel * (16 * MEAN_STEPS) + den * 2048) // (den * 4096)

    base = (es - OFF - 12) * 128
    tid_w = 456 + j * 64 + tl.minimum(tk * (8 // MEAN_STEPS), 63)
    cp_w = Z + base - 2304
    cn_w = Z - base - 2304
    s_w = 1 - 2 * sign

    level = tl.where(es == 0, 0, tl.minimum(tl.maximum(lcs - 8 * u_exp + 32, 0), 71))
    q = (tl.abs(fk) * 16 + 32768) >> 16
    with_off = level < 48
    tid_n = tl.where(with_off, level * 9 + q, 432 + level - 48)
    s_n = tl.where(with_off & (fk < 0), -1, 1)
    cp_n = key_m - tl.load(radius_ptr + tid_n).to(tl.int64)
    tid = tl.where(wide, tid_w, tid_n)
    cp = tl.where(wide, cp_w, cp_n)
    cn = tl.where(wide, cn_w, cp_n)
    s = tl.where(wide, s_w, s_n)
    return tid, cp, cn, s


@triton.jit
def _model_kernel(mean_ptr, std_ptr, x_ptr, radius_ptr, size_ptr, half_ptr, off_ptr, freq_ptr, cum_ptr,
                  tid_ptr, cp_ptr, cn_ptr, s_ptr, group_ptr, sym_ptr, f_ptr, c_ptr, esc_ptr, raw_ptr, n,
                  Z: tl.constexpr, OFF: tl.constexpr, TRUNC: tl.constexpr, IS_FP16: tl.constexpr,
                  MEAN_STEPS: tl.constexpr, RAW_BITS: tl.constexpr, PATTERN_MASK: tl.constexpr,
                  HAS_X: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    mb = tl.load(mean_ptr + offs, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
    sb = tl.load(std_ptr + offs, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
    tid, cp, cn, s = _params(mb, sb, radius_ptr, Z, OFF, TRUNC, IS_FP16, MEAN_STEPS)
    tl.store(tid_ptr + offs, tid.to(tl.int32), mask=live)
    tl.store(cp_ptr + offs, cp.to(tl.int32), mask=live)
    tl.store(cn_ptr + offs, cn.to(tl.int32), mask=live)
    tl.store(s_ptr + offs, s.to(tl.int32), mask=live)
    if HAS_X:
        b = tl.load(x_ptr + offs, mask=live, other=0).to(tl.int64) & PATTERN_MASK
        raw = b & ((1 << RAW_BITS) - 1)
        pattern = b >> RAW_BITS
        key = tl.where(pattern < Z, pattern + Z, 2 * Z - 1 - pattern)
        size = tl.load(size_ptr + tid, mask=live, other=1).to(tl.int64)
        half = tl.load(half_ptr + tid, mask=live, other=0).to(tl.int64)
        s0 = key - tl.where(key >= Z, cp, cn)
        valid = (s0 >= 0) & (s0 < size) & ((key < cn + half) | (key >= cp + half))
        sym = tl.where(valid, tl.where(s > 0, s0, size - 1 - s0), pattern)
        group = tl.where(valid, tid, 968)
        idx = tl.load(off_ptr + group, mask=live, other=0) + sym
        tl.store(group_ptr + offs, group.to(tl.int32), mask=live)
        tl.store(sym_ptr + offs, sym.to(tl.int32), mask=live)
        tl.store(f_ptr + offs, tl.load(freq_ptr + idx, mask=live, other=0), mask=live)
        tl.store(c_ptr + offs, tl.load(cum_ptr + idx, mask=live, other=0), mask=live)
        tl.store(esc_ptr + offs, tl.where(valid, 0, 1).to(tl.int32), mask=live)
        tl.store(raw_ptr + offs, raw.to(tl.int32), mask=live)


@triton.jit
def _keys_kernel(sym_ptr, esc_ptr, tid_ptr, cp_ptr, cn_ptr, s_ptr, raw_ptr, size_ptr, half_ptr, out_ptr, n,
                 Z: tl.constexpr, RAW_BITS: tl.constexpr, OUT_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    y = tl.load(sym_ptr + offs, mask=live, other=0).to(tl.int64)
    esc = tl.load(esc_ptr + offs, mask=live, other=0)
    tid = tl.load(tid_ptr + offs, mask=live, other=0)
    cp = tl.load(cp_ptr + offs, mask=live, other=0).to(tl.int64)
    cn = tl.load(cn_ptr + offs, mask=live, other=0).to(tl.int64)
    s = tl.load(s_ptr + offs, mask=live, other=1)
    size = tl.load(size_ptr + tid, mask=live, other=1).to(tl.int64)
    half = tl.load(half_ptr + tid, mask=live, other=0).to(tl.int64)
    s0 = tl.where(s > 0, y, size - 1 - y)
    key = s0 + tl.where(s0 >= half, cp, cn)
    key = tl.where(esc != 0, tl.where(y < Z, y + Z, 2 * Z - 1 - y), key)
    pattern = tl.where(key >= Z, key - Z, 2 * Z - 1 - key)
    raw = tl.load(raw_ptr + offs, mask=live, other=0).to(tl.int64) & ((1 << RAW_BITS) - 1)
    bits = (pattern << RAW_BITS) | raw
    bits = tl.where(bits >= (1 << (OUT_BITS - 1)), bits - (1 << OUT_BITS), bits)  # two's complement
    if OUT_BITS == 32:
        tl.store(out_ptr + offs, bits.to(tl.int32), mask=live)
    else:
        tl.store(out_ptr + offs, bits.to(tl.int16), mask=live)


@triton.jit
def _split_kernel(x_ptr, key_ptr, raw_ptr, n, Z: tl.constexpr, RAW_BITS: tl.constexpr,
                  PATTERN_MASK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    b = tl.load(x_ptr + offs, mask=live, other=0).to(tl.int64) & PATTERN_MASK
    pattern = b >> RAW_BITS
    key = tl.where(pattern < Z, pattern + Z, 2 * Z - 1 - pattern)
    tl.store(key_ptr + offs, key.to(tl.int32), mask=live)
    tl.store(raw_ptr + offs, (b & ((1 << RAW_BITS) - 1)).to(tl.int32), mask=live)


@triton.jit
def _join_kernel(key_ptr, raw_ptr, out_ptr, n, Z: tl.constexpr, RAW_BITS: tl.constexpr, OUT_BITS: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(key_ptr + offs, mask=live, other=0).to(tl.int64)
    pattern = tl.where(key >= Z, key - Z, 2 * Z - 1 - key)
    raw = tl.load(raw_ptr + offs, mask=live, other=0).to(tl.int64) & ((1 << RAW_BITS) - 1)
    bits = (pattern << RAW_BITS) | raw
    bits = tl.where(bits >= (1 << (OUT_BITS - 1)), bits - (1 << OUT_BITS), bits)
    if OUT_BITS == 32:
        tl.store(out_ptr + offs, bits.to(tl.int32), mask=live)
    else:
        tl.store(out_ptr + offs, bits.to(tl.int16), mask=live)


def split_bits(bits: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    n = bits.numel()
    key = torch.empty(n, dtype=torch.int32, device=bits.device)
    raw = torch.empty_like(key)
    mask = 0xFFFFFFFF if fmt.raw_bits == 16 else 0xFFFF
    _split_kernel[(max(1, triton.cdiv(n, BLOCK)),)](bits, key, raw, n, Z=fmt.zero_key, RAW_BITS=fmt.raw_bits,
                                            PATTERN_MASK=mask, BLOCK=BLOCK)
    return key, raw


def join_bits(key: torch.Tensor, raw: torch.Tensor, fmt: Format) -> torch.Tensor:
    n = key.numel()
    wide = fmt.raw_bits == 16
    out = torch.empty(n, dtype=torch.int32 if wide else torch.int16, device=key.device)
    _join_kernel[(max(1, triton.cdiv(n, BLOCK)),)](key, raw, out, n, Z=fmt.zero_key, RAW_BITS=fmt.raw_bits,
                                           OUT_BITS=32 if wide else 16, BLOCK=BLOCK)
    return out


def _fmt_args(fmt: Format) -> dict:
    return {"Z": fmt.zero_key, "OFF": fmt.exp_offset, "TRUNC": fmt.truncated, "IS_FP16": fmt is FP16}


def element_params(mean_bits: torch.Tensor, std_bits: torch.Tensor, fmt: Format, mean_steps: int, tables):
    n = mean_bits.numel()
    out = [torch.empty(n, dtype=torch.int32, device=mean_bits.device) for _ in range(4)]
    dummy = out[0]
    _model_kernel[(max(1, triton.cdiv(n, BLOCK)),)](
        mean_bits, std_bits, dummy, tables.radius, tables.size, tables.half, tables.off, tables.freq, tables.cum,
        *out, dummy, dummy, dummy, dummy, dummy, dummy, n, MEAN_STEPS=mean_steps, RAW_BITS=fmt.raw_bits,
        PATTERN_MASK=0, HAS_X=False, BLOCK=BLOCK, **_fmt_args(fmt))
    return tuple(out)


def encode_model(value_bits, mean_bits, std_bits, fmt: Format, mean_steps: int, tables) -> dict[str, torch.Tensor]:
    n = mean_bits.numel()
    names = ("tid", "cp", "cn", "s", "group", "sym", "freq", "cum", "escaped", "raw")
    out = {k: torch.empty(n, dtype=torch.int32, device=mean_bits.device) for k in names}
    mask = 0xFFFFFFFF if fmt.raw_bits == 16 else 0xFFFF
    _model_kernel[(max(1, triton.cdiv(n, BLOCK)),)](
        mean_bits, std_bits, value_bits, tables.radius, tables.size, tables.half, tables.off, tables.freq,
        tables.cum, *out.values(), n, MEAN_STEPS=mean_steps, RAW_BITS=fmt.raw_bits, PATTERN_MASK=mask,
        HAS_X=True, BLOCK=BLOCK, **_fmt_args(fmt))
    return out


def decode_bits(sym, escaped, tid, cp, cn, s, raw, fmt: Format, tables) -> torch.Tensor:
    n = sym.numel()
    wide = fmt.raw_bits == 16
    out = torch.empty(n, dtype=torch.int32 if wide else torch.int16, device=sym.device)
    _keys_kernel[(max(1, triton.cdiv(n, BLOCK)),)](
        sym, escaped, tid, cp, cn, s, raw, tables.size, tables.half, out, n, Z=fmt.zero_key,
        RAW_BITS=fmt.raw_bits, OUT_BITS=32 if wide else 16, BLOCK=BLOCK)
    return out


assert M.W_BASE == 456 and M.W_HALF == 2304 and M.ESCAPE_GROUP == 968  # constants inlined in the kernels
