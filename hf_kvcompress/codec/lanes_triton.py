"""The lanes format decoded by a Triton kernel: one program per stream, one vector element per lane.

The stream's decoding order (`jit.encode_streams`) is in rounds: the round's escape flags lane by lane, then
its symbols lane by lane. Within a phase every lane takes one step, so the lanes that need a word get
their read positions from a prefix sum of the "needs a word" mask; the symbol search is the same bucket
index plus a fixed number of masked binary-search steps. Per-element params come from the host
(`lanes.prepare_stats`); the raw low bits and the stream checks are joined and verified by
`jit.finish_streams`, so the result is the CPU decoder's, bit for bit (tested under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import jit
from .config import CodecConfig
from .lanes import Batch, _escape_freq, lane_tables, phat_tables, prepare_decode, raise_errors
from .model import N_TABLES


@triton.jit
def _add(a, b):
    return a + b


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
def _decode_kernel(words_ptr, wstart_ptr, wcount_ptr, n, tid_ptr, cp_ptr, cn_ptr, sg_ptr, cum_ptr, coff_ptr,
                   size_ptr, half_ptr, lut_ptr, fe, z, keys_ptr, ok_ptr, LANES: tl.constexpr,
                   LUT_BITS: tl.constexpr, STEPS: tl.constexpr, ESC_TABLE: tl.constexpr):
    s = tl.program_id(0)
    w0 = tl.load(wstart_ptr + s)
    nw = tl.load(wcount_ptr + s)
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
        # the round's escape flags
        slot = x & mask24
        q = x >> 24
        valid = slot < fv
        x = tl.where(live, tl.where(valid, fv * q + slot, fe * q + slot - fv), x)
        x, pos, bad = _refill(x, live, pos, last, bad, words_ptr)
        # then their symbols (escaped ones under p_hat, stored after the tables as table ESC_TABLE)
        slot = (x & mask24).to(tl.int64)
        t = tl.where(valid, tl.load(tid_ptr + s * n + i, mask=live, other=0).to(tl.int64), ESC_TABLE)
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
        sg = tl.load(sg_ptr + s * n + i, mask=live, other=1)
        s0 = tl.where(sg > 0, sym, size - 1 - sym)
        cp = tl.load(cp_ptr + s * n + i, mask=live, other=0).to(tl.int64)
        cn = tl.load(cn_ptr + s * n + i, mask=live, other=0).to(tl.int64)
        key = tl.where(s0 >= half, s0 + cp, s0 + cn)
        key = tl.where(valid, key, tl.where(sym < z, sym + z, 2 * z - 1 - sym))
        tl.store(keys_ptr + s * n + i, key.to(tl.int32), mask=live)
    ok = (tl.reduce(bad, 0, _add) == 0) & (pos == w0 + nw) & (tl.reduce((x != (1 << 31)).to(tl.int32), 0, _add) == 0)
    tl.store(ok_ptr + s, ok.to(tl.int32))


def _device_tables(cfg: CodecConfig, fmt, device) -> tuple[list[torch.Tensor], int]:
    """cum / coff / size / half / lut of every table, p_hat appended as table ``N_TABLES``; and the binary
    search steps the widest bucket needs."""
    tab = lane_tables()
    pcum, plut = phat_tables(cfg.marginal_or_default, fmt)
    cum = np.concatenate([tab.cum, pcum]).astype(np.int64)
    coff = np.concatenate([tab.coff, [tab.cum.size]]).astype(np.int64)
    size = np.concatenate([tab.size, [pcum.size - 1]]).astype(np.int64)
    half = np.concatenate([tab.half, [0]]).astype(np.int64)
    lut = np.concatenate([tab.lut.astype(np.int64), plut.astype(np.int64)])
    steps = int(np.diff(lut.reshape(-1, (1 << jit.LUT_BITS) + 1), axis=1).max()).bit_length()
    return [torch.from_numpy(a).to(device) for a in (cum, coff, size, half, lut)], steps


def decode_batch_triton(blobs, mean, std, cfg: CodecConfig, device: str | torch.device = "cpu") -> torch.Tensor:
    """`codec.decode_batch` with the entropy decoding in `_decode_kernel` on ``device`` (CUDA, or the CPU
    under ``TRITON_INTERPRET=1``); the result is on the CPU."""
    bt: Batch = prepare_decode(blobs, mean, std, cfg, 1)
    fmt, m, st = bt.fmt, bt.m, bt.st
    n_streams = bt.wstart.size
    lanes = int(bt.lanes_log2[0])
    if (bt.lanes_log2 != lanes).any():
        raise ValueError("decode_batch_triton: the streams of a batch must use one lane count")
    idx = np.arange(m, dtype=np.int64) if st.pidx.size == 0 else st.pidx.astype(np.int64)
    full = st.p_row[:, None] + idx[None, :]  # every element's params, [N, m]
    dev = torch.device(device)
    per = [torch.from_numpy(np.ascontiguousarray(a[full])).to(dev) for a in (st.tid.astype(np.int32), st.cp, st.cn,
                                                                               st.sg.astype(np.int32))]
    (cum, coff, size, half, lut), steps = _device_tables(cfg, fmt, dev)
    words = torch.from_numpy(bt.buf32.astype(np.int64)).to(dev)
    keys = torch.empty((n_streams, m), dtype=torch.int32, device=dev)
    ok = torch.empty(n_streams, dtype=torch.int32, device=dev)
    _decode_kernel[(n_streams,)](
        words, torch.from_numpy(bt.wstart).to(dev), torch.from_numpy(bt.wcount).to(dev), m, *per, cum, coff, size,
        half, lut, _escape_freq(cfg, m), fmt.zero_key, keys, ok, LANES=1 << lanes, LUT_BITS=jit.LUT_BITS,
        STEPS=steps, ESC_TABLE=N_TABLES,
    )
    err = np.where(ok.cpu().numpy() == 1, jit.OK, jit.ERR_WORDS_LEFT).astype(np.int32)
    raise_errors(err)
    np_dtype = np.uint32 if fmt.dtype == torch.float32 else np.uint16
    out = torch.empty((n_streams, *bt.shape), dtype=fmt.dtype)
    ov = out.view(torch.int32 if fmt.dtype == torch.float32 else torch.int16).numpy().view(np_dtype).reshape(
        n_streams, m)
    jit.finish_streams(keys.cpu().numpy(), bt.buf8, bt.buf32, bt.wstart, bt.wcount, bt.rstart, m,
                       fmt.pattern_bits, fmt.raw_bits, fmt.zero_key, bt.checks, ov, err, 0, n_streams)
    raise_errors(err)
    return out
