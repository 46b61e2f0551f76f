"""The huff family's decoder as a Triton kernel (an optional dependency: imported only when a decode runs as Triton,
`interface.triton_device`): ``huff`` and ``mhuff`` streams, whose layout differs only in the tables per stream
(`huff.Layout`). Its specification is the numba decoder (`kernels.decode_streams`); the tests run it in Triton's CPU
interpreter and compare bit for bit.

One lane per stream: a stream's codes are variable-length and carry no restart points, so its elements decode one
after the other; the CPU decoder's four streams in lock step become `BLOCK_S` here. What stays on the host:
parsing and checks (`huff.prepare_decode`: headers, crc32 where asked, contexts and their fingerprints; the entry
point is `huff.decode_batch_triton`, so this module imports nothing of `huff`) and the decode tables
(`kernels.build_stream_tables`, 4 KiB a huff stream, 16 KiB an mhuff one); the payloads, tables and contexts go to
the device, the decoded elements are written there.

Integer operations only, and only core builtins (no ``triton.language.standard`` helpers): those are ``@jit``
functions fixed when triton is imported, which breaks the interpreter when torch imported triton before
``TRITON_INTERPRET=1`` was set (as under pytest; `codec.device_triton`'s docstring).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from ...errors import CorruptStreamError
from ..interface import copy_into
from . import kernels

#: streams per program (one lane each): one warp of 32 threads (a guess: never timed on a GPU; more streams a program
#: share its launch, fewer fill more SMs when a batch holds few streams)
BLOCK_S = 32


def host_tables(prep) -> tuple[np.ndarray, np.ndarray]:
    """The decode tables of every coded stream of a prepared batch (`huff.Prepared`), built on the host
    (`kernels.build_stream_tables`: ``[streams, ntab << max_len]`` uint32), and each stream's error code (0, or
    `kernels.ERR_TABLE` where its lengths form no code)."""
    lay, parsed = prep.lay, prep.parsed
    n = parsed.tat.size
    tables = np.zeros((n, lay.ntab << lay.max_len), np.uint32)
    err = np.zeros(n, np.int32)
    kernels.build_stream_tables(parsed.b8, parsed.tat, parsed.pstart, parsed.stored, lay.alphabet, lay.ntab,
                                lay.max_len, lay.paired, lay.ew, tables, err)
    return tables, err


@triton.jit
def _decode_kernel(words_ptr, last_word, pstart_ptr, pend_ptr, stored_ptr, tables_ptr, ctx_ptr, crow_ptr, out_ptr,
                   err_ptr, n_streams, rows, run, row_chunks, ELEMENTS: tl.constexpr, NTAB: tl.constexpr,
                   CLS: tl.constexpr, EW: tl.constexpr, MW: tl.constexpr, WIDTH: tl.constexpr,
                   MAX_LEN: tl.constexpr, CHUNK: tl.constexpr, OUT_BITS: tl.constexpr, ERR_CODE: tl.constexpr,
                   ERR_LENGTH: tl.constexpr, NONE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Streams ``pid * BLOCK_S ..`` into ``out`` (``[n_streams, rows * run]`` bit patterns); ``err`` per stream:
    `kernels.ERR_CODE` / `ERR_LENGTH` as the numba decoder would report them (it checks after every chunk of
    CHUNK elements of a row, or of CHUNK rows where ``ELEMENTS``: the first chunk with an invalid code wins over
    the first that ran past the payload's end, if not later), else 0. ``NONE``: no chunk failed yet."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    lane = s < n_streams
    pos = tl.load(pstart_ptr + s, mask=lane, other=0)
    end = tl.load(pend_ptr + s, mask=lane, other=0)
    stored = tl.load(stored_ptr + s, mask=lane, other=0) != 0
    coded = lane & (stored == 0)
    crow = tl.load(crow_ptr + s, mask=lane, other=0).to(tl.int64)
    tbase = s.to(tl.int64) * (NTAB << MAX_LEN)
    obase = s.to(tl.int64) * rows * run
    first_bad = pos * 0 + NONE  # the first chunk with a code no table entry holds
    first_over = pos * 0 + NONE  # the first chunk that ended past the payload's end
    for r in range(0, rows):
        c = tl.load(ctx_ptr + crow * rows + r, mask=lane, other=0).to(tl.int64) & 0xFFFFFFFF
        for t in range(0, run):
            # 33 stream bits from bit `pos` on (max_len + raw <= 33): two uint32 words, shifted; a damaged stream
            # reads clamped to the buffer
            at = tl.minimum(pos >> 5, last_word - 1)
            lo = tl.load(words_ptr + at, mask=lane, other=0).to(tl.int64) & 0xFFFFFFFF
            hi = tl.load(words_ptr + at + 1, mask=lane, other=0).to(tl.int64) & 0xFFFFFFFF
            w = (lo | (hi << 32)) >> (pos & 31)  # arithmetic shift: bits 0..32 are the stream's
            idx = tbase + (w & ((1 << MAX_LEN) - 1))
            if NTAB > 1:  # a table per class: the context's bits from CLS up
                idx += (c >> CLS) << MAX_LEN
            ent = tl.load(tables_ptr + idx, mask=coded, other=0).to(tl.int64) & 0xFFFFFFFF
            ln = ent & 63
            u = ent >> 8
            value = ((((u + c) & ((1 << EW) - 1)) | ((u ^ c) & (1 << EW))) << MW) | ((w >> ln) & ((1 << MW) - 1))
            value = tl.where(stored, w & ((1 << WIDTH) - 1), value)
            pos += tl.where(stored, WIDTH, ln + MW)
            if ELEMENTS:  # noqa: SIM108 (a constexpr branch, resolved when the kernel compiles)
                chunk = r // CHUNK
            else:
                chunk = r * row_chunks + t // CHUNK
            first_bad = tl.where(coded & (ent >= (1 << 31)) & (first_bad == NONE), chunk, first_bad)
            first_over = tl.where(lane & (pos > end) & (first_over == NONE), chunk, first_over)
            value = tl.where(value >= (1 << (OUT_BITS - 1)), value - (1 << OUT_BITS), value)  # two's complement
            if OUT_BITS == 32:
                tl.store(out_ptr + obase + r * run + t, value.to(tl.int32), mask=lane)
            else:
                tl.store(out_ptr + obase + r * run + t, value.to(tl.int16), mask=lane)
    err = tl.where(first_bad <= first_over, ERR_CODE, tl.where((first_over != NONE) | (pos != end), ERR_LENGTH, 0))
    err = tl.where(first_bad == NONE, tl.where(pos != end, ERR_LENGTH, 0), err)
    tl.store(err_ptr + s, err.to(tl.int32), mask=lane)


def decode_prepared(prep, corrupt: str, errors: dict[int, str], device: torch.device,
                   out: torch.Tensor | None) -> torch.Tensor:
    """Decode a batch parsed and checked on the host (``prep``: `huff.prepare_decode`'s) on ``device``: the numba
    decoder's bits, and its `CorruptStreamError` (``corrupt``: the message's start, ``errors``: each ERR_ code's
    words) for the first stream that fails; into ``out`` (any device) or a new tensor on ``device``."""
    head, parsed, cx, lay = prep
    fmt, n = head.fmt, parsed.tat.size
    m = math.prod(head.shape)
    wide = fmt.dtype == torch.float32
    bits_dtype = torch.int32 if wide else torch.int16
    direct = out is not None and out.device == device and out.is_contiguous()
    dst = out if direct else torch.empty((n, *head.shape), dtype=fmt.dtype, device=device)
    err = np.zeros(n, np.int32)
    if m:
        tables, err = host_tables(prep)
        words = parsed.b64.view(np.int32)  # the joined streams (padded), as uint32 words' bits
        on = {name: torch.from_numpy(a).to(device) for name, a in (
            ("words", words), ("pstart", parsed.pstart), ("pend", parsed.pstart + parsed.pbits),
            ("stored", parsed.stored.astype(np.int32)), ("tables", tables.view(np.int32)),
            ("ctx", cx.ctx.view(np.int32)), ("crow", cx.crow))}
        dev_err = torch.zeros(n, dtype=torch.int32, device=device)
        elements = cx.run == 1 and 2 * (lay.max_len + lay.raw) <= 57  # `kernels._decode4`'s pairs of rows
        _decode_kernel[(triton.cdiv(n, BLOCK_S),)](
            on["words"], words.size - 1, on["pstart"], on["pend"], on["stored"], on["tables"], on["ctx"],
            on["crow"], dst.view(bits_dtype), dev_err, n, cx.rows, cx.run, -(-cx.run // kernels.CHUNK),
            ELEMENTS=elements, NTAB=lay.ntab, CLS=lay.ew + 1, EW=lay.ew, MW=lay.raw, WIDTH=lay.width,
            MAX_LEN=lay.max_len, CHUNK=kernels.CHUNK, OUT_BITS=32 if wide else 16, ERR_CODE=kernels.ERR_CODE,
            ERR_LENGTH=kernels.ERR_LENGTH, NONE=1 << 62, BLOCK_S=BLOCK_S,
            num_warps=1)  # BLOCK_S lanes are one warp: more warps would hold copies of the same lanes
        err = np.where(err != 0, err, dev_err.cpu().numpy())  # a table's error first, as the numba decoder's
    if err.any():
        i = int(np.flatnonzero(err)[0])
        raise CorruptStreamError(f"{corrupt}: stream {i}: {errors.get(int(err[i]), 'decode failed')}")
    if out is None or direct:
        return dst
    return copy_into(out, dst)
