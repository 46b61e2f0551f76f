"""Pure-torch reference of the codec's ANS window decoder: constriction's ``AnsCoder`` (u32 words, u64
state, 24-bit precision) with ``perfect=False`` categorical models, re-implemented step by step so that a
device decodes the same streams the CPU writes.

One lane per window, all windows in lockstep (a Python loop over symbol steps): slow on any device, it is the
oracle the Triton kernel is tested against. The u64 state lives in int64 lanes: products wrap modulo 2^64
exactly like u64, right shifts are masked to be logical, and "state < 2^32" is tested as unsigned.
"""

from __future__ import annotations

import torch

PRECISION = 24
_QMASK = (1 << PRECISION) - 1
_HI40 = (1 << (64 - PRECISION)) - 1
_WORD = 1 << 32


def ans_start(words: torch.Tensor, word_lo: torch.Tensor, word_count: torch.Tensor):
    """constriction's ``AnsCoder(compressed)`` per window: (state, next word index, ok). The coder reads
    words from the end; the last one must be non-zero (constriction refuses trailing zero words)."""
    last = word_lo + word_count - 1
    w_last = words[last.clamp_min(0).clamp_max(max(words.numel() - 1, 0))] if words.numel() else torch.zeros_like(last)
    w_prev = words[(last - 1).clamp_min(0).clamp_max(max(words.numel() - 1, 0))] if words.numel() else w_last
    state = torch.where(word_count >= 2, (w_last << 32) | w_prev, torch.where(word_count == 1, w_last, 0))
    pos = torch.where(word_count >= 2, last - 2, word_lo - 1)
    ok = (word_count == 0) | (w_last != 0)
    return state, pos, ok


def _search(cum: torch.Tensor, off: torch.Tensor, size: torch.Tensor, q: torch.Tensor, steps: int) -> torch.Tensor:
    """Largest i < size with cum[off + i] <= q (cum[off] = 0 <= q): a fixed-step binary search
    (``steps >= log2(size)``; more steps change nothing)."""
    lo = torch.zeros_like(q)
    hi = size
    for _ in range(steps):
        mid = (lo + hi) >> 1
        below = cum[off + mid].to(torch.int64) <= q
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return lo


def ans_decode(words, word_lo, state, pos, groups, seg_start, seg_len, tables, search_steps: int = 16):
    """Decode ``seg_len[w]`` symbols per window, the k-th with the model ``groups[seg_start[w] + k]``.
    Returns (symbols in the same layout as ``groups``, final state, final next-word index).
    ``search_steps``: binary-search steps, at least the bit length of the largest alphabet used."""
    syms = torch.zeros(groups.numel(), dtype=torch.int32, device=groups.device)
    state, pos = state.clone(), pos.clone()
    steps = int(seg_len.max()) if seg_len.numel() else 0
    off_all, size_all = tables.off, tables.size.to(torch.int64)
    for k in range(steps):
        live = k < seg_len
        at = (seg_start + k).clamp_max(max(groups.numel() - 1, 0))
        g = groups[at].to(torch.int64)
        off, size = off_all[g], size_all[g]
        q = state & _QMASK
        i = _search(tables.cum, off, size, q, search_steps)
        f = tables.freq[off + i].to(torch.int64)
        c = tables.cum[off + i].to(torch.int64)
        new = ((state >> PRECISION) & _HI40) * f + (q - c)
        need = (new >= 0) & (new < _WORD) & (pos >= word_lo)
        word = words[pos.clamp_min(0).clamp_max(max(words.numel() - 1, 0))] if words.numel() else new
        new = torch.where(need, (new << 32) | word, new)
        state = torch.where(live, new, state)
        pos = torch.where(live & need, pos - 1, pos)
        syms[at[live]] = i[live].to(torch.int32)
    return syms, state, pos
