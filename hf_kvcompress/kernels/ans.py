"""Decoding the codec's windows on a device: constriction-compatible ANS, many windows in parallel.

A window's stream holds, in decode order (docs/codec.md section 5.1): its ``n`` escape flags (binary model
of the window's tier), then its non-escaped elements grouped by table id ascending (position order inside a
group), then its escaped elements under p_hat. `decode_windows` reproduces that: one ANS pass for the flags,
a stable sort by (window, group) that gives the decode order, a second ANS pass for the symbols. Each pass
runs the Triton kernel (`ans_triton`) or the torch reference (`ans_ref`), chosen by `dispatch.use_triton`.
Parallelism is one lane per window: a GPU needs many windows in flight to be busy (see docs/kernels.md).
"""

from __future__ import annotations

import torch

from ..codec.model import ESCAPE_GROUP
from . import ans_ref
from .codec_tables import FLAG_GROUP, DeviceTables
from .dispatch import use_triton


def ans_decode(words, word_lo, state, pos, groups, seg_start, seg_len, tables: DeviceTables):
    """Decode ``seg_len[w]`` symbols per window ``w`` (model ``groups[seg_start[w] + k]`` for the k-th) from
    ANS state ``state`` / next word ``pos``; returns (symbols laid out like ``groups``, state, pos)."""
    # binary-search steps for the largest alphabet in use (2 for the flag pass, 13 for W tables, 16 with p_hat)
    steps = int(tables.size[torch.unique(groups).long()].max()).bit_length() if groups.numel() else 1
    if use_triton(words, groups):
        from . import ans_triton

        return ans_triton.ans_decode(words, word_lo, state, pos, groups, seg_start, seg_len, tables, steps)
    return ans_ref.ans_decode(words, word_lo, state, pos, groups, seg_start, seg_len, tables, steps)


def decode_windows(words: torch.Tensor, word_lo: torch.Tensor, word_count: torch.Tensor, lengths: torch.Tensor,
                   tiers: torch.Tensor, tid: torch.Tensor, tables: DeviceTables):
    """Symbols of every element of consecutive windows (element order), their escape flags, and per window
    whether the stream was well formed (last word non-zero, coder empty at the end).

    ``words``: int64, the windows' ANS words (uint32 values) concatenated, window ``w`` at
    ``[word_lo[w], word_lo[w] + word_count[w])``; ``lengths`` / ``tiers``: elements and escape tier per window;
    ``tid``: each element's table id (from `codec_model.element_params`)."""
    device = tid.device
    n_windows = lengths.numel()
    lengths = lengths.to(torch.int64)
    seg_start = torch.cumsum(lengths, 0) - lengths
    seg_len = lengths.to(torch.int32)
    state, pos, ok = ans_ref.ans_start(words, word_lo, word_count)
    flag_groups = torch.repeat_interleave((FLAG_GROUP + tiers).to(torch.int32), lengths)
    escaped, state, pos = ans_decode(words, word_lo, state, pos, flag_groups, seg_start, seg_len, tables)
    gid = torch.where(escaped != 0, ESCAPE_GROUP, tid.to(torch.int32))
    window = torch.repeat_interleave(torch.arange(n_windows, device=device), lengths)
    order = torch.sort(window * 1024 + gid, stable=True).indices
    ordered, state, pos = ans_decode(words, word_lo, state, pos, gid[order], seg_start, seg_len, tables)
    sym = torch.empty_like(ordered)
    sym[order] = ordered
    return sym, escaped, ok & (state == 0)
