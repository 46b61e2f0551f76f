"""Triton kernel of the codec's ANS window decoder (`ans_ref` is the spec): BLOCK_W windows per program,
one lane per window, all lanes stepping through their symbols together; integer operations only.

Only core builtins are used (no ``triton.language.standard`` helpers such as ``zeros_like``): those are
``@jit`` functions fixed when triton is imported, which breaks the interpreter when torch imported triton
before ``TRITON_INTERPRET=1`` was set (as under pytest)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    """Same contract as `ans_ref.ans_decode`."""
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
