"""The codec's Triton kernels (an optional dependency: imported only when a kernel runs as Triton, see
`hf_kvcompress.kernels.dispatch`): the per-element model, the window ANS decoder and the lanes decoder. Their
specifications are the torch references in `device` and the numba kernels in `lanes` / `jit`; the tests run
them in Triton's CPU interpreter and compare bit for bit.

Integer operations only, so results do not depend on FMA contraction or flush-to-zero. Only core builtins
are used (no ``triton.language.standard`` helpers such as ``zeros_like``, ``tl.sum``, ``tl.cumsum``): those
are ``@jit`` functions fixed when triton is imported, which breaks the interpreter when torch imported triton
before ``TRITON_INTERPRET=1`` was set (as under pytest).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from . import tables as T
from .codec_config import CodecConfig
from .device_tables import tables_for
from .interface import bits_view, check_out, copy_into, verify_mask
from .lanes_coder import jit
from .lanes_coder.lanes import (
    Batch,
    _escape_freq,
    _pidx,
    lane_tables,
    phat_tables,
    prepare_decode,
    raise_errors,
)
from .symbols import FORMATS_BY_CODE, FP16, Format
from .tables import Marginal


@triton.jit
def _add(a, b):
    return a + b


# ---------------------------------------------------------------------------------------------------------
# The per-element model, one element per lane

BLOCK = 1024


@triton.jit
def _params(mb, sb, radius_ptr, Z: tl.constexpr, OFF: tl.constexpr, TRUNC: tl.constexpr,
            IS_FP16: tl.constexpr, MEAN_STEPS: tl.constexpr, W_BASE: tl.constexpr, W_HALF: tl.constexpr,
            W_LOW: tl.constexpr, W_T_LEVELS: tl.constexpr, SUB: tl.constexpr, N_OCT_MIN: tl.constexpr,
            N_LEVELS: tl.constexpr, N_OFFSET_LEVELS: tl.constexpr, N_OFFSETS: tl.constexpr):
    """(tid, cp, cn, s) from float32 bit patterns (int64 lanes holding uint32 values): `params.element_params_xp`
    (the table constants arrive as constexpr arguments from `tables`, see `_TABLE_ARGS`)."""
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
    wide = (es > 0) & (tl_fine < W_T_LEVELS)
    tk = (mrel * (16 * MEAN_STEPS) + den * 2048) // (den * 4096)

    base = (es - OFF - W_LOW) * 128
    tid_w = W_BASE + j * W_T_LEVELS + tl.minimum(tk * (8 // MEAN_STEPS), W_T_LEVELS - 1)
    cp_w = Z + base - W_HALF
    cn_w = Z - base - W_HALF
    s_w = 1 - 2 * sign

    level = tl.where(es == 0, 0, tl.minimum(tl.maximum(lcs - SUB * u_exp - SUB * N_OCT_MIN, 0), N_LEVELS - 1))
    q = (tl.abs(fk) * 16 + 32768) >> 16
    with_off = level < N_OFFSET_LEVELS
    tid_n = tl.where(with_off, level * N_OFFSETS + q, N_OFFSET_LEVELS * N_OFFSETS + level - N_OFFSET_LEVELS)
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
                  HAS_X: tl.constexpr, BLOCK: tl.constexpr, W_BASE: tl.constexpr, W_HALF: tl.constexpr,
                  W_LOW: tl.constexpr, W_T_LEVELS: tl.constexpr, SUB: tl.constexpr, N_OCT_MIN: tl.constexpr,
                  N_LEVELS: tl.constexpr, N_OFFSET_LEVELS: tl.constexpr, N_OFFSETS: tl.constexpr,
                  ESCAPE_GROUP: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    mb = tl.load(mean_ptr + offs, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
    sb = tl.load(std_ptr + offs, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
    tid, cp, cn, s = _params(mb, sb, radius_ptr, Z, OFF, TRUNC, IS_FP16, MEAN_STEPS, W_BASE, W_HALF, W_LOW,
                             W_T_LEVELS, SUB, N_OCT_MIN, N_LEVELS, N_OFFSET_LEVELS, N_OFFSETS)
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
        group = tl.where(valid, tid, ESCAPE_GROUP)
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
    return {"Z": fmt.zero_key, "OFF": fmt.exp_offset, "TRUNC": fmt.truncated, "IS_FP16": fmt is FP16, **_TABLE_ARGS}


# the tables' constants, one definition (`tables`), handed to the kernels as constexpr arguments
_TABLE_ARGS = {name: getattr(T, name) for name in ("W_BASE", "W_HALF", "W_LOW", "W_T_LEVELS", "SUB", "N_OCT_MIN",
                                                    "N_LEVELS", "N_OFFSET_LEVELS", "N_OFFSETS", "ESCAPE_GROUP")}


def element_params(mean_bits: torch.Tensor, std_bits: torch.Tensor, fmt: Format, mean_steps: int, tables):
    """(tid, cp, cn, s) per element, int32 (`device.element_params`)."""
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


# ---------------------------------------------------------------------------------------------------------
# Triton kernel of the codec's ANS window decoder (`device._ans_decode_ref` is the spec): BLOCK_W windows per program,
# one lane per window, all lanes stepping through their symbols together; integer operations only.

BLOCK_W = 32


@triton.jit
def _ans_kernel(words_ptr, word_lo_ptr, state_ptr, pos_ptr, groups_ptr, seg_start_ptr, seg_len_ptr,
                off_ptr, size_ptr, freq_ptr, cum_ptr, syms_ptr, n_windows, steps, SEARCH: tl.constexpr,
                BLOCK_W: tl.constexpr):
    w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    lane = w < n_windows
    word_lo = tl.load(word_lo_ptr + w, mask=lane, other=0)
    state = tl.load(state_ptr + w, mask=lane, other=0)
    pos = tl.load(pos_ptr + w, mask=lane, other=-1)
    start = tl.load(seg_start_ptr + w, mask=lane, other=0)
    length = tl.load(seg_len_ptr + w, mask=lane, other=0)
    for k in range(0, steps):
        live = lane & (k < length)
        g = tl.load(groups_ptr + start + k, mask=live, other=0).to(tl.int64)
        off = tl.load(off_ptr + g, mask=live, other=0)
        size = tl.load(size_ptr + g, mask=live, other=1).to(tl.int64)
        q = state & 0xFFFFFF
        lo = q * 0
        hi = size
        for _ in tl.static_range(SEARCH):  # largest i with cum[i] <= q; SEARCH >= log2(alphabet size)
            mid = (lo + hi) >> 1
            below = tl.load(cum_ptr + off + mid, mask=live, other=0).to(tl.int64) <= q
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        f = tl.load(freq_ptr + off + lo, mask=live, other=1).to(tl.int64)
        c = tl.load(cum_ptr + off + lo, mask=live, other=0).to(tl.int64)
        new = ((state >> 24) & 0xFFFFFFFFFF) * f + (q - c)  # u64 arithmetic in int64 lanes (wraps alike)
        need = live & (new >= 0) & (new < 4294967296) & (pos >= word_lo)
        word = tl.load(words_ptr + pos, mask=need, other=0)
        new = tl.where(need, (new << 32) | word, new)
        state = tl.where(live, new, state)
        pos = tl.where(need, pos - 1, pos)
        tl.store(syms_ptr + start + k, lo.to(tl.int32), mask=live)
    tl.store(state_ptr + w, state, mask=lane)
    tl.store(pos_ptr + w, pos, mask=lane)


def ans_decode(words, word_lo, state, pos, groups, seg_start, seg_len, tables, search_steps: int = 16):
    """Same contract as `device._ans_decode_ref`."""
    n_windows = seg_len.numel()
    syms = torch.zeros(groups.numel(), dtype=torch.int32, device=groups.device)
    state, pos = state.clone().contiguous(), pos.clone().contiguous()
    steps = int(seg_len.max()) if n_windows else 0
    if n_windows and steps:
        words = words if words.numel() else torch.zeros(1, dtype=torch.int64, device=groups.device)
        _ans_kernel[(triton.cdiv(n_windows, BLOCK_W),)](
            words, word_lo.contiguous(), state, pos, groups.contiguous(), seg_start.contiguous(),
            seg_len.contiguous(), tables.off, tables.size, tables.freq, tables.cum, syms, n_windows, steps,
            SEARCH=search_steps, BLOCK_W=BLOCK_W)
    return syms, state, pos


# ---------------------------------------------------------------------------------------------------------
# The lanes format decoded by a Triton kernel: one program per stream, one vector element per lane.
#
# The stream's decoding order (`jit.encode_streams`) is in rounds: the round's escape flags lane by lane, then
# its symbols lane by lane. Within a phase every lane takes one step, so the lanes that need a word get
# their read positions from a prefix sum of the "needs a word" mask; the symbol search is the same bucket
# index plus a fixed number of masked binary-search steps. Per-element params come from the host
# (`lanes.prepare_stats`); the raw low bits and the stream checks are joined and verified by
# `jit.finish_streams`, so the result is the CPU decoder's, bit for bit (tested under ``TRITON_INTERPRET=1``).


@triton.jit
def _refill(x, live, pos, last, bad, words_ptr):
    """Lanes whose state fell below 2^31 take the next words, in lane order: positions by prefix sum.
    A read past the stream's last word is flagged in ``bad``."""
    need = live & (x < (1 << 31))
    at = pos + tl.associative_scan(need.to(tl.int64), 0, _add) - need.to(tl.int64)
    w = tl.load(words_ptr + tl.minimum(at, last), mask=need, other=0).to(tl.uint64)
    x = tl.where(need, (x << 32) | w, x)
    bad = bad | (need & (at > last)).to(tl.int32)
    return x, pos + tl.reduce(need.to(tl.int64), 0, _add), bad


# Only core `tl` operations and functions of this module: the library's own jitted helpers (tl.sum,
# tl.cumsum, tl.zeros, tl.cdiv) are decorated when triton is imported, which under the interpreter may be
# before TRITON_INTERPRET is set (the tests set it late).
@triton.jit
def _decode_kernel(words_ptr, wstart_ptr, wcount_ptr, n, prow_ptr, pidx_ptr, tid_ptr, cp_ptr, cn_ptr, sg_ptr,
                   cum_ptr, coff_ptr, size_ptr, half_ptr, lut_ptr, fe, z, keys_ptr, ok_ptr, LANES: tl.constexpr,
                   LUT_BITS: tl.constexpr, STEPS: tl.constexpr, ESC_TABLE: tl.constexpr, GATHER: tl.constexpr):
    s = tl.program_id(0)
    w0 = tl.load(wstart_ptr + s)
    nw = tl.load(wcount_ptr + s)
    prow = tl.load(prow_ptr + s)  # this stream's first compact param
    lane = tl.arange(0, LANES)
    lo = tl.load(words_ptr + w0 + 2 * lane).to(tl.uint64)
    hi = tl.load(words_ptr + w0 + 2 * lane + 1).to(tl.uint64)
    x = lo | (hi << 32)
    pos = w0 + 2 * LANES
    last = w0 + nw - 1
    mask24 = (1 << 24) - 1
    fv = (1 << 24) - fe
    bad = lane * 0
    for r in range(0, (n + LANES - 1) // LANES):
        i = r * LANES + lane
        live = i < n
        # element i's params: compact statistics (per channel, shared) map elements onto fewer params
        if GATHER:  # noqa: SIM108 (a constexpr branch, resolved when the kernel compiles)
            pi = prow + tl.load(pidx_ptr + i, mask=live, other=0).to(tl.int64)
        else:
            pi = prow + i
        # the round's escape flags
        slot = x & mask24
        q = x >> 24
        valid = slot < fv
        x = tl.where(live, tl.where(valid, fv * q + slot, fe * q + slot - fv), x)
        x, pos, bad = _refill(x, live, pos, last, bad, words_ptr)
        # then their symbols (escaped ones under p_hat, stored after the tables as table ESC_TABLE)
        slot = (x & mask24).to(tl.int64)
        t = tl.where(valid, tl.load(tid_ptr + pi, mask=live, other=0).to(tl.int64), ESC_TABLE)
        c0 = tl.load(coff_ptr + t)
        b = slot >> (24 - LUT_BITS)
        lbase = t * ((1 << LUT_BITS) + 1)
        sym = tl.load(lut_ptr + lbase + b).to(tl.int64)
        top = tl.load(lut_ptr + lbase + b + 1).to(tl.int64)
        for _ in range(STEPS):
            active = sym < top
            mid = (sym + top + 1) >> 1
            cm = tl.load(cum_ptr + c0 + mid, mask=active, other=0).to(tl.int64)
            up = active & (cm <= slot)
            top = tl.where(active & (cm > slot), mid - 1, top)
            sym = tl.where(up, mid, sym)
        start = tl.load(cum_ptr + c0 + sym).to(tl.int64)
        f = tl.load(cum_ptr + c0 + sym + 1).to(tl.int64) - start
        x = tl.where(live, f.to(tl.uint64) * (x >> 24) + (slot - start).to(tl.uint64), x)
        x, pos, bad = _refill(x, live, pos, last, bad, words_ptr)
        # keys
        size = tl.load(size_ptr + t)
        half = tl.load(half_ptr + t)
        sg = tl.load(sg_ptr + pi, mask=live, other=1)
        s0 = tl.where(sg > 0, sym, size - 1 - sym)
        cp = tl.load(cp_ptr + pi, mask=live, other=0).to(tl.int64)
        cn = tl.load(cn_ptr + pi, mask=live, other=0).to(tl.int64)
        key = tl.where(s0 >= half, s0 + cp, s0 + cn)
        key = tl.where(valid, key, tl.where(sym < z, sym + z, 2 * z - 1 - sym))
        tl.store(keys_ptr + s * n + i, key.to(tl.int32), mask=live)
    ok = (tl.reduce(bad, 0, _add) == 0) & (pos == w0 + nw) & (tl.reduce((x != (1 << 31)).to(tl.int32), 0, _add) == 0)
    tl.store(ok_ptr + s, ok.to(tl.int32))


@functools.lru_cache(maxsize=16)
def _device_tables(marginal: Marginal, fmt_code: int, device: str) -> tuple[tuple[torch.Tensor, ...], int]:
    """cum / coff / size / half / lut of every table, p_hat appended as table ``N_TABLES``, on ``device``
    (cached: ~12 MB); and the binary search steps the widest bucket needs."""
    tab = lane_tables()
    pcum, plut = phat_tables(marginal, FORMATS_BY_CODE[fmt_code])
    cum = np.concatenate([tab.cum, pcum]).astype(np.int64)
    coff = np.concatenate([tab.coff, [tab.cum.size]]).astype(np.int64)
    size = np.concatenate([tab.size, [pcum.size - 1]]).astype(np.int64)
    half = np.concatenate([tab.half, [0]]).astype(np.int64)
    lut = np.concatenate([tab.lut.astype(np.int64), plut.astype(np.int64)])
    steps = int(np.diff(lut.reshape(-1, (1 << jit.LUT_BITS) + 1), axis=1).max()).bit_length()
    return tuple(torch.from_numpy(a).to(device) for a in (cum, coff, size, half, lut)), steps


def _writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy where it is a read-only (broadcast) view, which torch will not wrap."""
    return a if a.flags.writeable else a.copy()


@functools.lru_cache(maxsize=64)
def _device_pidx(shape: tuple[int, ...], cshape: tuple[int, ...], device: str) -> torch.Tensor:
    """`lanes._pidx` on ``device`` (one copy per stream shape and statistics shape)."""
    return torch.from_numpy(_pidx(shape, cshape).astype(np.int64)).to(device)


def decode_batch_triton(blobs, mean, std, cfg: CodecConfig, device: str | torch.device = "cpu",
                        out: torch.Tensor | None = None, verify=True) -> torch.Tensor:
    """`codec.decode_batch` with the per-element model (`element_params`) and the entropy decoding
    (`_decode_kernel`) on ``device`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``); the result lands in
    ``out`` (any device) or in a new tensor on ``device``.

    What stays on the host: parsing, the mean / std fingerprints (`lanes.prepare_decode`, on the host copies
    of the statistics that every decode checks), and the raw low bits and stream checks of
    `jit.finish_streams`: the decoded keys (4 bytes an element) come back to the host for them and the
    joined values go to ``out``. The check is one serial hash chain per stream (docs/lossless.md, "On a GPU"),
    run where ``verify`` says (`codec.decode_batch`)."""
    dev = torch.device(device)
    bt: Batch = prepare_decode(blobs, mean, std, cfg, 1, params=False)
    fmt, m, st = bt.fmt, bt.m, bt.st
    n_streams = bt.wstart.size
    xshape = (n_streams, *bt.shape)
    check_out(out, fmt, xshape)
    mask = verify_mask(verify, n_streams)
    lanes = int(bt.lanes_log2[0])
    if (bt.lanes_log2 != lanes).any():
        raise ValueError("decode_batch_triton: the streams of a batch must use one lane count")
    # the per-element model of the compact statistics, on the device
    mb, sb = (torch.from_numpy(_writable(a).view(np.int32)).to(dev) for a in (st.mbits, st.sbits))
    tid, cp, cn, sg = element_params(mb, sb, fmt, cfg.mean_steps, tables_for(fmt, dev))
    prow = torch.from_numpy(st.p_row).to(dev)
    gather = st.pidx.size > 0
    pidx = _device_pidx(tuple(bt.shape), st.cshape, str(dev)) if gather else prow
    (cum, coff, size, half, lut), steps = _device_tables(cfg.marginal_or_default, fmt.code, str(dev))
    words = torch.from_numpy(bt.buf32.astype(np.int64)).to(dev)
    keys = torch.empty((n_streams, m), dtype=torch.int32, device=dev)
    ok = torch.empty(n_streams, dtype=torch.int32, device=dev)
    _decode_kernel[(n_streams,)](
        words, torch.from_numpy(bt.wstart).to(dev), torch.from_numpy(bt.wcount).to(dev), m, prow, pidx, tid, cp,
        cn, sg, cum, coff, size, half, lut, _escape_freq(cfg, m), fmt.zero_key, keys, ok, LANES=1 << lanes,
        LUT_BITS=jit.LUT_BITS, STEPS=steps, ESC_TABLE=T.N_TABLES, GATHER=gather,
    )
    err = np.where(ok.cpu().numpy() == 1, jit.OK, jit.ERR_WORDS_LEFT).astype(np.int32)
    raise_errors(err)
    host = out if out is not None and out.device.type == "cpu" and out.is_contiguous() else torch.empty(
        xshape, dtype=fmt.dtype)
    jit.finish_streams(keys.cpu().numpy(), bt.buf8, bt.buf32, bt.wstart, bt.wcount, bt.rstart, m,
                       fmt.pattern_bits, fmt.raw_bits, fmt.zero_key, bt.checks, mask, bits_view(host, n_streams, m), err, 0,
                       n_streams)
    raise_errors(err)
    if out is None:
        return host.to(dev)
    return out if out is host else copy_into(out, host)
