"""The codec's device path: when x / mean / std live on a GPU (or the kernels are forced, as in the
interpreter tests), the per-element model and the window decoding run on that device, as Triton kernels
(`device_triton`, an optional dependency) or their pure-torch references here, chosen per call by
`hf_kvcompress.kernels.dispatch`; entropy *encoding* stays on constriction (CPU).

Streams are byte-identical to the host path (tested): the per-element model is `params.element_params_xp`
itself (the torch reference) or its Triton port, and the window decoder reimplements constriction's ANS
decoder bit for bit. Checksums (per-window and global CRC32) and the mean / std fingerprints are still
computed on host copies, so a device decode moves the decoded bits (2 or 4 bytes per element) and the
statistics to the host once; a device CRC would remove that (docs/kernels.md).

The flat device tables (group ids, layout) are `device_tables`'.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import CorruptStreamError
from ...kernels import dispatch
from ..codec_config import CodecConfig
from ..device_tables import FLAG_GROUP, DeviceTables, tables_for
from ..interface import device_of
from ..params import Params, ParamSource, element_params_xp
from ..symbols import Format, format_of, raw_padded_nbytes, unpack_raw
from ..tables import ESCAPE_GROUP, PRECISION
from .entropy import key_of, symbol_of
from .windows import window_sigma_bits

__all__ = ["DeviceSource", "decode_bits", "decode_on_device", "decode_windows", "device_of", "element_params",
           "encode_model", "join_bits", "split_bits", "tables_for"]


# ---------------------------------------------------------------------------------------------------------
# The torch references (integer arithmetic in int64 lanes, any device): the per-element model and the symbol
# mapping are the host's own functions (`params.element_params_xp`, `coder.symbol_of` / `coder.key_of`) run
# on torch; the dtype symbol transforms (`symbols.split_bits`) are ported.


def _element_params_ref(mean_bits: torch.Tensor, std_bits: torch.Tensor, fmt: Format, mean_steps: int,
                        radius: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(tid, cp, cn, s) per element, int32: `params.element_params_xp` in torch, on the inputs' device."""
    out = element_params_xp(mean_bits, std_bits, fmt, mean_steps, radius.to(torch.int64), torch)
    return tuple(t.to(torch.int32) for t in out)


def _split_bits_ref(bits: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Value bit patterns (int16 / int32 tensor) -> (key, raw low bits), int32 (raw is 0 for bfloat16)."""
    b = bits.to(torch.int64) & (0xFFFFFFFF if fmt.raw_bits == 16 else 0xFFFF)
    raw = b & ((1 << fmt.raw_bits) - 1)
    pattern = b >> fmt.raw_bits
    z = fmt.zero_key
    key = torch.where(pattern < z, pattern + z, 2 * z - 1 - pattern)
    return key.to(torch.int32), raw.to(torch.int32)


def _join_bits_ref(key: torch.Tensor, raw: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Inverse of `_split_bits_ref`: int16 bit patterns for bfloat16 / float16, int32 for float32."""
    k = key.to(torch.int64)
    z = fmt.zero_key
    pattern = torch.where(k >= z, k - z, 2 * z - 1 - k)
    b = (pattern << fmt.raw_bits) | (raw.to(torch.int64) & ((1 << fmt.raw_bits) - 1))
    if fmt.raw_bits == 16:
        return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32)
    return torch.where(b >= 1 << 15, b - (1 << 16), b).to(torch.int16)




def _encode_model_ref(value_bits: torch.Tensor, mean_bits: torch.Tensor, std_bits: torch.Tensor, fmt: Format,
                 mean_steps: int, tables) -> dict[str, torch.Tensor]:
    """Everything the entropy coder needs per element, int32: ``tid``, ``group`` (``tid``, or 968 when
    escaped), ``sym`` (table symbol, or the bit pattern when escaped), ``freq`` and ``cum`` of that symbol
    (its interval out of 2^24), ``escaped`` (0/1), ``raw`` low bits, plus ``cp``/``cn``/``s``."""
    tid, cp, cn, s = _element_params_ref(mean_bits, std_bits, fmt, mean_steps, tables.radius)
    key, raw = _split_bits_ref(value_bits, fmt)
    t64 = tid.to(torch.int64)
    valid, sym = symbol_of(key.to(torch.int64), t64, cp.to(torch.int64), cn.to(torch.int64), s,
                           tables.size.to(torch.int64), tables.half.to(torch.int64), fmt.zero_key, torch)
    group = torch.where(valid, t64, ESCAPE_GROUP)
    idx = tables.off[group] + sym
    i32 = torch.int32
    return {"tid": tid, "cp": cp, "cn": cn, "s": s, "group": group.to(i32), "sym": sym.to(i32),
            "freq": tables.freq[idx], "cum": tables.cum[idx], "escaped": (~valid).to(i32), "raw": raw}


def _decode_keys_ref(sym: torch.Tensor, escaped: torch.Tensor, tid: torch.Tensor, cp: torch.Tensor, cn: torch.Tensor,
                s: torch.Tensor, fmt: Format, tables) -> torch.Tensor:
    """Decoded symbols back to keys (int32): `coder.key_of` in torch."""
    key = key_of(sym.to(torch.int64), escaped == 0, tid.to(torch.int64), cp.to(torch.int64), cn.to(torch.int64), s,
                 tables.size.to(torch.int64), tables.half.to(torch.int64), fmt.zero_key, torch)
    return key.to(torch.int32)


# ---------------------------------------------------------------------------------------------------------
# Pure-torch reference of the codec's ANS window decoder: constriction's ``AnsCoder`` (u32 words, u64
# state, 24-bit precision) with ``perfect=False`` categorical models, re-implemented step by step so that a
# device decodes the same streams the CPU writes.
#
# One lane per window, all windows in lockstep (a Python loop over symbol steps): slow on any device, it is the
# oracle the Triton kernel is tested against. The u64 state lives in int64 lanes: products wrap modulo 2^64
# exactly like u64, right shifts are masked to be logical, and "state < 2^32" is tested as unsigned.

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


def _ans_decode_ref(words, word_lo, state, pos, groups, seg_start, seg_len, tables, search_steps: int = 16):
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


# ---------------------------------------------------------------------------------------------------------
# Decoding the codec's windows on a device: constriction-compatible ANS, many windows in parallel.
#
# A window's stream holds, in decode order (docs/codec_format.md section 5.1): its ``n`` escape flags (binary model
# of the window's tier), then its non-escaped elements grouped by table id ascending (position order inside a
# group), then its escaped elements under p_hat. `decode_windows` reproduces that: one ANS pass for the flags,
# a stable sort by (window, group) that gives the decode order, a second ANS pass for the symbols. Each pass
# runs the Triton kernel (`device_triton.ans_decode`) or the torch reference (`_ans_decode_ref`), chosen by
# `dispatch.use_triton`.
# Parallelism is one lane per window: a GPU needs many windows in flight to be busy (see docs/kernels.md).


def _triton(*tensors: torch.Tensor):
    """The Triton kernels (`device_triton`) when these tensors should run as Triton (`dispatch.use_triton`),
    else None (the torch reference)."""
    if not dispatch.use_triton(*tensors):
        return None
    from .. import device_triton  # optional dependency

    return device_triton


def ans_decode(words, word_lo, state, pos, groups, seg_start, seg_len, tables: DeviceTables):
    """Decode ``seg_len[w]`` symbols per window ``w`` (model ``groups[seg_start[w] + k]`` for the k-th) from
    ANS state ``state`` / next word ``pos``; returns (symbols laid out like ``groups``, state, pos)."""
    # binary-search steps for the largest alphabet in use (2 for the flag pass, 13 for W tables, 16 with p_hat)
    steps = int(tables.size[torch.unique(groups).long()].max()).bit_length() if groups.numel() else 1
    if (kernel := _triton(words, groups)) is not None:
        return kernel.ans_decode(words, word_lo, state, pos, groups, seg_start, seg_len, tables, steps)
    return _ans_decode_ref(words, word_lo, state, pos, groups, seg_start, seg_len, tables, steps)


def decode_windows(words: torch.Tensor, word_lo: torch.Tensor, word_count: torch.Tensor, lengths: torch.Tensor,
                   tiers: torch.Tensor, tid: torch.Tensor, tables: DeviceTables):
    """Symbols of every element of consecutive windows (element order), their escape flags, and per window
    whether the stream was well formed (last word non-zero, coder empty at the end).

    ``words``: int64, the windows' ANS words (uint32 values) concatenated, window ``w`` at
    ``[word_lo[w], word_lo[w] + word_count[w])``; ``lengths`` / ``tiers``: elements and escape tier per window;
    ``tid``: each element's table id (from `element_params`)."""
    device = tid.device
    n_windows = lengths.numel()
    lengths = lengths.to(torch.int64)
    seg_start = torch.cumsum(lengths, 0) - lengths
    seg_len = lengths.to(torch.int32)
    state, pos, ok = ans_start(words, word_lo, word_count)
    flag_groups = torch.repeat_interleave((FLAG_GROUP + tiers).to(torch.int32), lengths)
    escaped, state, pos = ans_decode(words, word_lo, state, pos, flag_groups, seg_start, seg_len, tables)
    gid = torch.where(escaped != 0, ESCAPE_GROUP, tid.to(torch.int32))
    window = torch.repeat_interleave(torch.arange(n_windows, device=device), lengths)
    order = torch.sort(window * 1024 + gid, stable=True).indices
    ordered, state, pos = ans_decode(words, word_lo, state, pos, gid[order], seg_start, seg_len, tables)
    sym = torch.empty_like(ordered)
    sym[order] = ordered
    return sym, escaped, ok & (state == 0)


# ---------------------------------------------------------------------------------------------------------
# The per-element model on a device: (x, mean, std) -> table id, symbol, and the integer frequency /
# cumulative frequency of x's bin; decoded symbols -> bit patterns; the dtype symbol transforms. Tensors are
# flat and of equal length; mean / std are float32 (``check_stat`` semantics: finite, std >= 0).


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a float tensor (int16 or int32), contiguous and flat."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _stat_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous().reshape(-1).view(torch.int32)


def element_params(mean: torch.Tensor, std: torch.Tensor, fmt: Format, mean_steps: int = 8,
                   tables: DeviceTables | None = None) -> tuple[torch.Tensor, ...]:
    """(tid, cp, cn, s) per element (int32), as `params.element_params`, on the inputs' device."""
    mb, sb = _stat_bits(mean), _stat_bits(std)
    tables = tables or tables_for(fmt, mb.device)
    if (kernel := _triton(mb, sb)) is not None:
        return kernel.element_params(mb, sb, fmt, mean_steps, tables)
    return _element_params_ref(mb, sb, fmt, mean_steps, tables.radius)


def encode_model(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, mean_steps: int = 8,
                 tables: DeviceTables | None = None) -> dict[str, torch.Tensor]:
    """Per element of ``x`` (bfloat16 / float16 / float32): ``tid``, ``cp``, ``cn``, ``s``, ``group`` (table
    id, or 968 = p_hat when escaped), ``sym``, its ``freq`` and ``cum`` out of 2^24, ``escaped``, ``raw`` low
    bits; all int32."""
    fmt = format_of(x.dtype)
    xb, mb, sb = _bits(x), _stat_bits(mean), _stat_bits(std)
    tables = tables or tables_for(fmt, xb.device)
    if (kernel := _triton(xb, mb, sb)) is not None:
        return kernel.encode_model(xb, mb, sb, fmt, mean_steps, tables)
    return _encode_model_ref(xb, mb, sb, fmt, mean_steps, tables)


def decode_bits(sym: torch.Tensor, escaped: torch.Tensor, params: tuple[torch.Tensor, ...], raw: torch.Tensor,
                fmt: Format, tables: DeviceTables | None = None) -> torch.Tensor:
    """Decoded symbols (and raw low bits) -> bit patterns (int16 / int32): inverse of `encode_model`."""
    tables = tables or tables_for(fmt, sym.device)
    tid, cp, cn, s = params
    if (kernel := _triton(sym, escaped, tid)) is not None:
        return kernel.decode_bits(sym, escaped, tid, cp, cn, s, raw, fmt, tables)
    return _join_bits_ref(_decode_keys_ref(sym, escaped, tid, cp, cn, s, fmt, tables), raw, fmt)


def split_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 / fp16 / fp32 symbol transform: values -> (order-preserving key, raw low bits), int32."""
    bits = _bits(x)
    if (kernel := _triton(bits)) is not None:
        return kernel.split_bits(bits, format_of(x.dtype))
    return _split_bits_ref(bits, format_of(x.dtype))


def join_bits(key: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `split_bits`, as a tensor of ``dtype``."""
    key, raw = key.contiguous().reshape(-1), raw.contiguous().reshape(-1)
    if (kernel := _triton(key, raw)) is not None:
        return kernel.join_bits(key, raw, format_of(dtype)).view(dtype)
    return _join_bits_ref(key, raw, format_of(dtype)).view(dtype)


# ---------------------------------------------------------------------------------------------------------
# The codec's flows on a device


def _flat_stat(value, host: np.ndarray | None, shape: tuple[int, ...], device) -> torch.Tensor | None:
    """mean / std as a flat float32 tensor of x's size on ``device`` (the same float32 values the host
    path validated and fingerprinted)."""
    if host is None:
        return None
    if isinstance(value, torch.Tensor) and value.device == torch.device(device):
        t = value.detach().to(torch.float32)
    else:
        t = torch.from_numpy(host).to(device)
    return t.reshape(host.shape).expand(shape).reshape(-1)


class DeviceSource:
    """A `ParamSource` whose per-element model runs on the device; everything else is the host source's."""

    def __init__(self, host: ParamSource, shape: tuple[int, ...], x: torch.Tensor | None, mean, std,
                 mean32: np.ndarray | None, std32: np.ndarray | None, cfg: CodecConfig, device) -> None:
        self.host, self.fmt, self.device = host, host.fmt, torch.device(device)
        self.mean_steps = cfg.mean_steps
        self.mean = _flat_stat(mean, mean32, shape, device)
        if self.mean is None:
            self.mean = torch.zeros(int(np.prod(shape)), dtype=torch.float32, device=device)
        self.std = _flat_stat(std, std32, shape, device)
        self.x = None if x is None else x.detach().to(device).reshape(-1)
        self.tables = tables_for(self.fmt, self.device, cfg.marginal, cfg.escape)

    def __getattr__(self, name: str):
        return getattr(self.host, name)

    def _std(self, a: int, b: int, sigma_bits: np.ndarray | None) -> torch.Tensor:
        if self.std is not None:
            return self.std[a:b]
        assert sigma_bits is not None
        return torch.from_numpy(sigma_bits.astype(np.int32)).to(self.device).view(torch.float32)

    def params(self, a: int, b: int, sigma_bits: np.ndarray | None = None) -> Params:
        p = element_params(self.mean[a:b], self._std(a, b, sigma_bits), self.fmt, self.mean_steps, self.tables)
        return _host_params(p)

    def symbols(self, a: int, b: int, sigma_bits: np.ndarray | None = None):
        """(params, valid, symbol) of elements a..b-1 from the encode kernel (host arrays)."""
        assert self.x is not None
        out = encode_model(self.x[a:b], self.mean[a:b], self._std(a, b, sigma_bits), self.mean_steps,
                                   self.tables)
        p = _host_params((out["tid"], out["cp"], out["cn"], out["s"]))
        return p, out["escaped"].cpu().numpy() == 0, out["sym"].cpu().numpy()


def _host_params(p) -> Params:
    tid, cp, cn, s = (t.cpu().numpy() for t in p)
    return Params(tid.astype(np.uint16), cp, cn, s.astype(np.int8))


def decode_on_device(d, mean, std, device) -> torch.Tensor:
    """All windows of the parsed stream ``d`` (an `api.Decoder`, non-causal) decoded on ``device``: the
    bit patterns (int16 / int32 tensor, flat), checked against every CRC."""
    fmt: Format = d.fmt
    lengths = d.lengths
    n, nw = int(d.h.numel), int(lengths.size)
    cfg = d.cfg
    src = DeviceSource(d.src, d.h.shape, None, mean, std, d.src_mean32, d.src_std32, cfg, device)
    sigma = None if d.h.has_std else window_sigma_bits(d.entries["sigma"].astype(np.int64), lengths)
    params = element_params(src.mean, src._std(0, n, sigma), fmt, cfg.mean_steps, src.tables)
    words, word_lo, word_count, raw = [], np.zeros(nw, np.int64), np.zeros(nw, np.int64), []
    start = 0
    for w, m in enumerate(lengths.tolist()):
        lo, hi = int(d.offsets[w]), int(d.offsets[w + 1])
        nraw = raw_padded_nbytes(m, fmt) if fmt.raw_bits else 0
        count = (hi - lo - nraw) // 4
        if count < 0:
            raise CorruptStreamError("corrupt codec stream: window payload too short for its raw bits")
        words.append(np.frombuffer(d.buf, dtype="<u4", count=count, offset=lo).astype(np.int64))
        word_lo[w], word_count[w] = start, count
        start += count
        if fmt.raw_bits:
            raw.append(unpack_raw(d.buf[lo + 4 * count : hi], m, fmt))
    dev = torch.device(device)
    words_t = torch.from_numpy(np.concatenate(words) if words else np.zeros(0, np.int64)).to(dev)
    tiers = torch.tensor([cfg.tier_of_length(int(m)) for m in lengths], dtype=torch.int32, device=dev)
    lengths_t = torch.from_numpy(lengths.astype(np.int64)).to(dev)
    sym, escaped, ok = decode_windows(words_t, torch.from_numpy(word_lo).to(dev), torch.from_numpy(word_count).to(dev),
                                      lengths_t, tiers, params[0], src.tables)
    if not bool(ok.all()):
        bad = int(torch.nonzero(~ok)[0, 0])
        raise CorruptStreamError(f"corrupt codec stream: window {bad} does not decode to an empty coder")
    raw_t = (torch.from_numpy(np.concatenate(raw).astype(np.int32)).to(dev) if raw
             else torch.zeros(n, dtype=torch.int32, device=dev))
    return decode_bits(sym, escaped, params, raw_t, fmt, src.tables)

