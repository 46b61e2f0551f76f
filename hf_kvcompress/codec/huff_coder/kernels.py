"""The ``huff`` coder's compiled kernels: per-stream Huffman code lengths, the encoder's bit packer, the
decoder's table builder and its loop, which steps four streams at once (four independent bit readers: their
look-ups overlap) and needs no division.

Element bits: ``value = sign << (EW + MW) | exponent << MW | mantissa`` (EW exponent bits, MW mantissa bits:
8 / 7 bfloat16, 5 / 10 float16, 8 / 23 float32). Its *context* ``c = ms << EW | ref`` comes from the caller's mean
and std (`huff.contexts`). The coded symbol is ``sym = d * 2 + (sign ^ ms)`` with ``d = (exponent - ref + 2^(EW-1))
mod 2^EW``; its code (LSB first) is followed by the MW mantissa bits as they are. docs/codec_format.md section 13.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

#: longest code: the decode table has 2^MAX_LEN entries per stream (4 KiB of uint32), refilled per stream
MAX_LEN = 10
TABLE = 1 << MAX_LEN
#: a decode table entry no code reaches (an incomplete code): or-ed over the loop, checked at the end
INVALID = np.uint32(1 << 31)
#: the decoder checks its bit position every CHUNK elements, so a damaged stream reads at most this many elements'
#: bits past its end (the joined buffer is padded by `PAD_BYTES`)
CHUNK = 256
PAD_BYTES = CHUNK * (MAX_LEN + 23) // 8 + 32

ERR_TABLE = 1  # code lengths over-subscribed, out of range, or a symbol outside the alphabet
ERR_CODE = 2  # a bit pattern no code starts with
ERR_LENGTH = 3  # the codes and mantissas do not end exactly at the payload's end
ERR_FP = 4  # the contexts (from mean and std) differ from the encoder's

_jit = nb.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")
_U = np.uint64
_FNV = np.uint64(0x100000001B3)


@_jit
def code_lengths(counts, max_len):
    """Length-limited Huffman code lengths of the symbols with ``counts > 0`` (0 for the others): Huffman by the
    two-queue method, then lengths over ``max_len`` clipped and the Kraft sum repaid by lengthening the least
    frequent codes still shorter than ``max_len``. One used symbol gets length 1; more than 2^max_len used symbols
    have no such code: all lengths 0 (the caller stores the stream)."""
    lengths = np.zeros(counts.size, np.int64)
    used = np.flatnonzero(counts > 0)
    n = used.size
    if n == 0 or n > (1 << max_len):
        return lengths
    if n == 1:
        lengths[used[0]] = 1
        return lengths
    order = used[np.argsort(counts[used], kind="mergesort")]
    weight = np.empty(2 * n - 1, np.int64)
    parent = np.zeros(2 * n - 1, np.int64)
    for i in range(n):
        weight[i] = counts[order[i]]
    leaf, inner = 0, n
    for k in range(n, 2 * n - 1):
        pair = np.empty(2, np.int64)
        for j in range(2):
            if leaf < n and (inner >= k or weight[leaf] <= weight[inner]):
                pair[j] = leaf
                leaf += 1
            else:
                pair[j] = inner
                inner += 1
        weight[k] = weight[pair[0]] + weight[pair[1]]
        parent[pair[0]] = k
        parent[pair[1]] = k
    depth = np.zeros(2 * n - 1, np.int64)
    for node in range(2 * n - 3, -1, -1):
        depth[node] = depth[parent[node]] + 1
    kraft = 0
    for i in range(n):
        length = min(depth[i], max_len)
        depth[i] = length
        kraft += 1 << (max_len - length)
    while kraft > (1 << max_len):  # the least frequent code shorter than max_len grows by one bit
        for i in range(n):
            if depth[i] < max_len:
                kraft -= 1 << (max_len - depth[i] - 1)
                depth[i] += 1
                break
    for i in range(n):
        lengths[order[i]] = depth[i]
    return lengths


@_jit
def canonical_codes(lengths, max_len):
    """Canonical codes (ordered by length, then symbol), bit-reversed for an LSB-first stream; -1 where the
    lengths over-subscribe the code space."""
    codes = np.zeros(lengths.size, np.int64)
    per_length = np.zeros(max_len + 2, np.int64)
    for s in range(lengths.size):
        per_length[lengths[s]] += 1
    per_length[0] = 0
    next_code = np.zeros(max_len + 2, np.int64)
    code = 0
    for length in range(1, max_len + 1):
        code = (code + per_length[length - 1]) << 1
        next_code[length] = code
        if code + per_length[length] > (1 << length):
            return codes, -1
    for s in range(lengths.size):
        length = lengths[s]
        if length:
            c = next_code[length]
            next_code[length] += 1
            rev = 0
            for b in range(length):
                rev |= ((c >> (length - 1 - b)) & 1) << b
            codes[s] = rev
    return codes, 0


@_jit
def symbols(bits, ctx, rows, run, ew, mw, counts):
    """The symbol of every element of one stream (``bits``: its m bit patterns; ``ctx``: one context per row of
    ``run`` elements) and their counts."""
    syms = np.empty(bits.size, np.int64)
    emask = (1 << ew) - 1
    half = 1 << (ew - 1)
    i = 0
    for r in range(rows):
        c = np.int64(ctx[r])
        ref, ms = c & emask, c >> ew
        for _ in range(run):
            v = np.int64(bits[i])
            e = (v >> mw) & emask
            sign = v >> (ew + mw)
            s = (((e - ref + half) & emask) << 1) | (sign ^ ms)
            syms[i] = s
            counts[s] += 1
            i += 1
    return syms


@_jit
def pack(bits, syms, codes, lengths, mw, words):
    """Each element's code then its MW mantissa bits, LSB first, into ``words`` (uint64); the bit count."""
    acc = _U(0)
    have = 0
    at = 0
    mmask = _U((1 << mw) - 1)
    for i in range(syms.size):
        s = syms[i]
        length = lengths[s]
        v = _U(codes[s]) | ((_U(bits[i]) & mmask) << _U(length))
        n = length + mw
        acc |= v << _U(have)
        if have + n >= 64:
            words[at] = acc
            at += 1
            spill = have + n - 64
            acc = (v >> _U(n - spill)) if spill else _U(0)
            have = spill
        else:
            have += n
    if have:
        words[at] = acc
    return at * 64 + have


@_jit
def context_fingerprint(ctx, rows, run):
    """64-bit FNV-1a of one stream's contexts as (value, count) runs: the same per-element contexts give the same
    fingerprint whatever shape the statistics were handed in."""
    h = _U(0xCBF29CE484222325)
    cur = np.int64(-1)
    count = 0
    for r in range(rows):
        c = np.int64(ctx[r])
        if c != cur:
            if count:
                h = (h ^ _U(cur)) * _FNV
                h = (h ^ _U(count)) * _FNV
            cur = c
            count = 0
        count += run
    if count:
        h = (h ^ _U(cur)) * _FNV
        h = (h ^ _U(count)) * _FNV
    return h


@_jit
def read_lengths(b8, at, end, alphabet, used):
    """The used symbols and their code lengths from the stream's segments at byte ``at`` (nseg, then per segment:
    gap varint, count varint, count nibbles): (the position after them or -1 if they do not parse, n), symbol
    ``used[0, i]`` of length ``used[1, i]`` for i < n, in symbol order."""
    nseg, at = _varint(b8, at, end)
    if at < 0 or nseg > alphabet:
        return -1, 0
    sym, n = 0, 0
    for _ in range(nseg):
        gap, at = _varint(b8, at, end)
        if at < 0:
            return -1, 0
        count, at = _varint(b8, at, end)
        if at < 0 or gap > alphabet or count > alphabet or sym + gap + count > alphabet or \
                at + ((count + 1) >> 1) > end:
            return -1, 0
        sym += gap
        for k in range(count):
            length = np.int64((b8[at + (k >> 1)] >> (4 * (k & 1))) & 15)
            if length:
                used[0, n] = sym + k
                used[1, n] = length
                n += 1
        sym += count
        at += (count + 1) >> 1
    return at, n


@_jit
def build_table(b8, at, end, alphabet, ew, used, table, max_len, paired):
    """Fill ``table`` (2^max_len uint32: ``u << 8 | length``, u = the sign-xor and offset bits, ``ew`` of them
    below the sign's) from the code lengths at byte ``at`` (``paired``: `read_length_pairs`' format, else
    `read_lengths`'; ``used``: their scratch, int64 [2, alphabet]): the position after them, or -1 if they do not
    form a code. (mhuff passes its offset width, exponent and top mantissa bits, as ``ew``.) Loops run over the
    used symbols only: `canonical_codes`' codes, assigned by length, then symbol."""
    at, n = read_length_pairs(b8, at, end, alphabet, used) if paired else read_lengths(b8, at, end, alphabet, used)
    if at < 0:
        return -1
    size = 1 << max_len
    kraft = 0
    per_length = np.zeros(max_len + 1, np.int64)
    for i in range(n):
        length = used[1, i]
        if length > max_len:
            return -1
        kraft += 1 << (max_len - length)
        per_length[length] += 1
    if kraft > size:
        return -1  # (no code at all: a table of a class no element has, every entry invalid)
    if kraft < size:
        table[:] = INVALID
    next_code = np.zeros(max_len + 1, np.int64)
    code = 0
    for length in range(1, max_len + 1):
        code = (code + per_length[length - 1]) << 1
        next_code[length] = code
    emask = (1 << ew) - 1
    half = 1 << (ew - 1)
    for i in range(n):
        s, length = used[0, i], used[1, i]
        c = next_code[length]
        next_code[length] += 1
        rev = 0
        for b in range(length):
            rev |= ((c >> (length - 1 - b)) & 1) << b
        u = (((s >> 1) - half) & emask) | ((s & 1) << ew)
        entry = np.uint32((u << 8) | length)
        for j in range(rev, size, 1 << length):
            table[j] = entry
    return at


@_jit
def decode_streams(b8, b64, pstart, pbits, stored, tat, alphabet, ntab, max_len, paired, ctx, crow, rows, run, ew, mw,
                   out, obase, a_step, b_step, err, s_lo, s_hi):
    """Decode streams ``s_lo..s_hi`` into ``out`` (element ``(r, t)`` of stream ``s`` at ``obase[s] + r * a_step + t *
    b_step``), coded ones four at a time. ``ntab`` tables of 2^max_len entries per stream, each element's chosen by
    its context's bits above the sign's (huff: one; mhuff: its class), their code lengths in ``paired`` form or
    not (`build_table`). ``err[s]`` gets an ERR_ code for a stream
    that fails: a group of four with a failure is decoded again stream by stream, so that the error lands on the
    stream it belongs to."""
    tables = np.empty((4, ntab << max_len), np.uint32)
    used = np.empty((2, alphabet), np.int64)
    coded = np.empty(s_hi - s_lo, np.int64)
    n = 0
    for s in range(s_lo, s_hi):
        if stored[s]:
            _copy_stored(b8, pstart[s], 1 + ew + mw, rows, run, out, obase[s], a_step, b_step)
        else:
            coded[n] = s
            n += 1
    lanes = np.empty(4, np.int64)
    for g in range(0, n, 4):
        for j in range(4):  # a short last group repeats its last stream (the same writes twice)
            lanes[j] = coded[min(g + j, n - 1)]
        ok = True
        for j in range(4):
            q = lanes[j]
            ok = ok and _build_tables(b8, tat[q], pstart[q] >> 3, alphabet, ntab, max_len, paired, ew, used,
                                         tables[j])
        if not ok or _decode4(b8, pstart, pbits, tables, ctx, crow, rows, run, ew, mw, max_len, out, obase, a_step,
                              b_step, lanes) != 0:
            for j in range(4):
                q = lanes[j]
                one = np.full(4, q, np.int64)
                for i in range(4):
                    if not _build_tables(b8, tat[q], pstart[q] >> 3, alphabet, ntab, max_len, paired, ew, used,
                                         tables[i]):
                        err[q] = ERR_TABLE
                if err[q] == 0:
                    err[q] = _decode4(b8, pstart, pbits, tables, ctx, crow, rows, run, ew, mw, max_len, out, obase,
                                      a_step, b_step, one)


@_jit
def _build_tables(b8, at, end, alphabet, ntab, max_len, paired, ew, used, tables):
    """The ``ntab`` consecutive tables of one stream from its ``ntab`` code-length tables at byte ``at``."""
    size = 1 << max_len
    for t in range(ntab):
        at = build_table(b8, at, end, alphabet, ew, used, tables[t * size : (t + 1) * size], max_len, paired)
        if at < 0:
            return False
    return True


@_jit
def build_stream_tables(b8, tat, pstart, stored, alphabet, ntab, max_len, paired, ew, tables, err):
    """Every coded stream's ``ntab`` decode tables into ``tables[s]`` (``ntab << max_len`` uint32, `build_table`'s
    entries; lengths in ``paired`` form or not) for a decoder elsewhere (`huff_triton`); ``err[s] = ERR_TABLE`` where
    they do not form codes (a stored stream's row is left as it is)."""
    used = np.empty((2, alphabet), np.int64)
    for s in range(tat.size):
        if not stored[s] and not _build_tables(b8, tat[s], pstart[s] >> 3, alphabet, ntab, max_len, paired, ew, used,
                                               tables[s]):
            err[s] = ERR_TABLE


@_jit
def _copy_stored(b8, pos, width, rows, run, out, base, a_step, b_step):
    """A stored stream: each element's ``width`` bits as they are, LSB first."""
    mask = _U((1 << width) - 1)
    for r in range(rows):
        for t in range(run):
            out[_U(base) + _U(r) * _U(a_step) + _U(t) * _U(b_step)] = _peek(b8, pos) & mask
            pos += width


@nb.njit(cache=True, nogil=True, inline="always")
def _peek(b8, pos):
    """At least 57 bits of the stream from bit ``pos`` on: the 8 bytes from its byte, which LLVM merges into one
    unaligned load."""
    i = _U(pos) >> _U(3)
    v = _U(b8[i]) | (_U(b8[i + _U(1)]) << _U(8)) | (_U(b8[i + _U(2)]) << _U(16)) | (_U(b8[i + _U(3)]) << _U(24)) | \
        (_U(b8[i + _U(4)]) << _U(32)) | (_U(b8[i + _U(5)]) << _U(40)) | (_U(b8[i + _U(6)]) << _U(48)) | \
        (_U(b8[i + _U(7)]) << _U(56))
    return v >> (_U(pos) & _U(7))


@nb.njit(cache=True, nogil=True, inline="always")
def _entry(table, w, c, k, cls):
    """The table entry of the code at the bottom of ``w`` in the table of context ``c``: the one numbered by the
    context's bits from ``cls`` up (the sign's), or the only one where ``cls`` is None (huff: compiled without the
    shifts, ~15% of its per-element decode)."""
    if cls is None:
        return table[w & k.lmask]
    return table[((c >> cls) << k.lbits) | (w & k.lmask)]


@nb.njit(cache=True, nogil=True, inline="always")
def _value(ent, w, c, k):
    """(the element's bit pattern, the bits it took) from its table entry, the stream bits ``w`` at its code and
    its context ``c``: offset and sign-xor bits from the entry, the raw low bits after the code."""
    ln = _U(ent & np.uint32(63))
    u = _U(ent >> np.uint32(8))
    return ((((u + c) & k.emask) | ((u ^ c) & k.sbit)) << k.umw) | ((w >> ln) & k.mmask), ln + k.umw


@nb.njit(cache=True, nogil=True, inline="always")
def _step(b64, pos, table, c, k, cls):
    """One element of one stream: (its bit pattern, the next bit position, the table entry)."""
    w = _peek(b64, pos)
    ent = _entry(table, w, c, k, cls)
    value, used = _value(ent, w, c, k)
    return value, pos + np.int64(used), ent


@nb.njit(cache=True, nogil=True, inline="always")
def _step2(b8, pos, table, c, c2, k, cls):
    """Two elements of one stream (contexts ``c``, ``c2``) from one read (each takes at most max_len + raw bits of
    its 57: `Consts.pairs`): (their bit patterns, the next bit position, their table entries or-ed)."""
    w = _peek(b8, pos)
    ent = _entry(table, w, c, k, cls)
    first, used = _value(ent, w, c, k)
    w >>= used
    ent2 = _entry(table, w, c2, k, cls)
    second, used2 = _value(ent2, w, c2, k)
    return first, second, pos + np.int64(used + used2), ent | ent2


@nb.njit(cache=True, nogil=True, inline="always")
def _put2(b64, pos, table, c, c2, out, o, at, nx, k, cls):
    """`_step2` with its two elements written to ``out[o + at]`` and ``out[o + nx]``: (next position, entries)."""
    v, v2, pos, ent = _step2(b64, pos, table, c, c2, k, cls)
    out[o + at] = v
    out[o + nx] = v2
    return pos, ent


@nb.njit(cache=True, nogil=True, inline="always")
def _put(b64, pos, table, c, out, o, at, k, cls):
    """`_step` with its element written to ``out[o + at]``: (next position, entry)."""
    v, pos, ent = _step(b64, pos, table, c, k, cls)
    out[o + at] = v
    return pos, ent


class Consts(NamedTuple):
    """The decode loop's per-format constants (uint64): offset mask (``ew`` offset bits), sign-xor bit, raw-bit
    mask, raw-bit count, code mask (max_len bits), max_len."""

    emask: np.uint64
    sbit: np.uint64
    mmask: np.uint64
    umw: np.uint64
    lmask: np.uint64
    lbits: np.uint64


@_jit
def _decode4(b64, pstart, pbits, tables, ctx, crow, rows, run, ew, mw, max_len, out, obase, a_step, b_step, lanes):
    """Four streams in lock step; 0, or an ERR_ code for the group (`decode_streams` then pins it on one)."""
    s0, s1, s2, s3 = lanes[0], lanes[1], lanes[2], lanes[3]
    t0, t1, t2, t3 = tables[0], tables[1], tables[2], tables[3]
    p0, p1, p2, p3 = pstart[s0], pstart[s1], pstart[s2], pstart[s3]
    e0, e1, e2, e3 = p0 + pbits[s0], p1 + pbits[s1], p2 + pbits[s2], p3 + pbits[s3]
    o0, o1, o2, o3 = _U(obase[s0]), _U(obase[s1]), _U(obase[s2]), _U(obase[s3])
    k = Consts(_U((1 << ew) - 1), _U(1 << ew), _U((1 << mw) - 1), _U(mw), _U((1 << max_len) - 1), _U(max_len))
    ast, bst = _U(a_step), _U(b_step)
    pairs = 2 * (max_len + mw) <= 57
    classes = tables.shape[1] > (1 << max_len)  # a table per class (mhuff)
    if run == 1 and pairs:  # one context per element: pairs of rows
        x0, x1, x2, x3 = ctx[crow[s0]], ctx[crow[s1]], ctx[crow[s2]], ctx[crow[s3]]
        if classes:
            return _decode4_elements(b64, p0, p1, p2, p3, e0, e1, e2, e3, t0, t1, t2, t3, x0, x1, x2, x3, rows, out,
                                     o0, o1, o2, o3, ast, k, _U(ew + 1))
        return _decode4_elements(b64, p0, p1, p2, p3, e0, e1, e2, e3, t0, t1, t2, t3, x0, x1, x2, x3, rows, out, o0,
                                 o1, o2, o3, ast, k, None)
    if classes:
        return _decode4_rows(b64, p0, p1, p2, p3, e0, e1, e2, e3, t0, t1, t2, t3, ctx, crow, lanes, rows, run, out,
                             o0, o1, o2, o3, ast, bst, pairs, k, _U(ew + 1))
    return _decode4_rows(b64, p0, p1, p2, p3, e0, e1, e2, e3, t0, t1, t2, t3, ctx, crow, lanes, rows, run, out, o0,
                         o1, o2, o3, ast, bst, pairs, k, None)


@_jit
def _decode4_rows(b64, p0, p1, p2, p3, e0, e1, e2, e3, t0, t1, t2, t3, ctx, crow, lanes, rows, run, out, o0, o1, o2,
                  o3, ast, bst, pairs, k, cls):
    """`_decode4` with one context per row of ``run`` elements; 0 or an ERR_ code."""
    s0, s1, s2, s3 = lanes[0], lanes[1], lanes[2], lanes[3]
    bad = np.uint32(0)
    for r in range(rows):
        c0, c1, c2, c3 = _U(ctx[crow[s0], r]), _U(ctx[crow[s1], r]), _U(ctx[crow[s2], r]), _U(ctx[crow[s3], r])
        a = _U(r) * ast
        t = 0
        while t < run:
            stop = min(run, t + CHUNK)
            j = t
            while pairs and j + 1 < stop:
                at = a + _U(j) * bst
                nx = at + bst
                p0, ent = _put2(b64, p0, t0, c0, c0, out, o0, at, nx, k, cls)
                bad |= ent
                p1, ent = _put2(b64, p1, t1, c1, c1, out, o1, at, nx, k, cls)
                bad |= ent
                p2, ent = _put2(b64, p2, t2, c2, c2, out, o2, at, nx, k, cls)
                bad |= ent
                p3, ent = _put2(b64, p3, t3, c3, c3, out, o3, at, nx, k, cls)
                bad |= ent
                j += 2
            for i in range(j, stop):
                at = a + _U(i) * bst
                p0, ent = _put(b64, p0, t0, c0, out, o0, at, k, cls)
                bad |= ent
                p1, ent = _put(b64, p1, t1, c1, out, o1, at, k, cls)
                bad |= ent
                p2, ent = _put(b64, p2, t2, c2, out, o2, at, k, cls)
                bad |= ent
                p3, ent = _put(b64, p3, t3, c3, out, o3, at, k, cls)
                bad |= ent
            if bad & INVALID:
                return ERR_CODE
            if p0 > e0 or p1 > e1 or p2 > e2 or p3 > e3:
                return ERR_LENGTH  # damaged: stop before reading further past a stream's end
            t = stop
    if p0 != e0 or p1 != e1 or p2 != e2 or p3 != e3:
        return ERR_LENGTH
    return 0


@_jit
def _decode4_elements(b64, p0, p1, p2, p3, e0, e1, e2, e3, t0, t1, t2, t3, x0, x1, x2, x3, rows, out, o0, o1, o2, o3,
                      ast, k, cls):
    """`_decode4` where each element has its own context (``x0..x3``: the four streams' context rows, element
    ``r`` at ``o + r * ast``), two elements per read as where contexts are per channel: per-element statistics at
    per-channel speed. 0 or an ERR_ code."""
    bad = np.uint32(0)
    r = 0
    while r < rows:
        stop = min(rows, r + CHUNK)
        while r + 1 < stop:
            at = _U(r) * ast
            nx = at + ast
            p0, ent = _put2(b64, p0, t0, _U(x0[r]), _U(x0[r + 1]), out, o0, at, nx, k, cls)
            bad |= ent
            p1, ent = _put2(b64, p1, t1, _U(x1[r]), _U(x1[r + 1]), out, o1, at, nx, k, cls)
            bad |= ent
            p2, ent = _put2(b64, p2, t2, _U(x2[r]), _U(x2[r + 1]), out, o2, at, nx, k, cls)
            bad |= ent
            p3, ent = _put2(b64, p3, t3, _U(x3[r]), _U(x3[r + 1]), out, o3, at, nx, k, cls)
            bad |= ent
            r += 2
        if r < stop:  # an odd chunk's last element
            at = _U(r) * ast
            p0, ent = _put(b64, p0, t0, _U(x0[r]), out, o0, at, k, cls)
            bad |= ent
            p1, ent = _put(b64, p1, t1, _U(x1[r]), out, o1, at, k, cls)
            bad |= ent
            p2, ent = _put(b64, p2, t2, _U(x2[r]), out, o2, at, k, cls)
            bad |= ent
            p3, ent = _put(b64, p3, t3, _U(x3[r]), out, o3, at, k, cls)
            bad |= ent
            r += 1
        if bad & INVALID:
            return ERR_CODE
        if p0 > e0 or p1 > e1 or p2 > e2 or p3 > e3:
            return ERR_LENGTH  # damaged: stop before reading further past a stream's end
    if p0 != e0 or p1 != e1 or p2 != e2 or p3 != e3:
        return ERR_LENGTH
    return 0


@nb.njit(cache=True, nogil=True, inline="always")
def _put_varint(out, at, v):
    """Write ``v`` (>= 0) as a LEB128 varint at ``at``; the position after it."""
    while v >= 0x80:
        out[at] = np.uint8((v & 0x7F) | 0x80)
        v >>= 7
        at += 1
    out[at] = np.uint8(v)
    return at + 1


@_jit
def length_segments(lengths, gap):
    """`huff.length_segments`'s bytes (uint8): the code lengths as runs of used symbols, a run of ``gap`` or more
    unused symbols starting a new segment; nseg varint, then per segment the gap since the last one's end, its
    count and its lengths as nibbles (low first). Compiled: an encoder writes one per table."""
    n = lengths.size
    segments, last = 0, -1
    for i in range(n):
        if lengths[i]:
            if last < 0 or i - last >= gap:
                segments += 1
            last = i
    out = np.empty(10 + 11 * segments + n // 2 + segments, np.uint8)
    at = _put_varint(out, 0, segments)
    end, i = 0, 0
    while i < n:
        if not lengths[i]:
            i += 1
            continue
        lo, hi = i, i  # the segment: used symbols less than `gap` apart
        j = i + 1
        while j < n and j - hi < gap:
            if lengths[j]:
                hi = j
            j += 1
        count = hi - lo + 1
        at = _put_varint(out, at, lo - end)
        at = _put_varint(out, at, count)
        for k in range(0, count, 2):
            low = lengths[lo + k]
            high = lengths[lo + k + 1] if k + 1 < count else 0
            out[at] = np.uint8(low | (high << 4))
            at += 1
        end = lo + count
        i = hi + 1
    return out[:at]


# ------------------------------------------------------------------- paired code-length tables (mhuff version 2)

#: mhuff version 2's code-length tables (`length_pairs`) go by pairs of symbols (one offset, sign-xor 0 and 1): a
#: run of `PAIR_GAP` or more unused pairs starts a new segment (SmolLM2 grid + mhuff k=2 streams, a stream's four
#: tables in codes fitted to them: 2 pairs 82.9 bytes, 4 80.0, 6 79.2, 10 79.1; as nibbles 140.7)
PAIR_GAP = 6
#: static prefix codes of a pair's lengths: ``EVEN_LENGTHS[p, e]`` the code length of even length ``e`` after a pair
#: whose even length was ``p`` (0 at a segment's start), ``ODD_LENGTHS[e, o]`` that of odd length ``o`` after even
#: length ``e``: Huffman codes (10 bits) of the counts + 1 (every length codable) in SmolLM2's grid + mhuff k=3
#: streams of a default save at 2,048 held-out tokens, 960 streams (experiments/mhuff_tables.py --fit); canonical
#: (by length, then value), LSB first
EVEN_LENGTHS = np.array([
    [1, 10, 9, 10, 8, 7, 6, 5, 4, 3, 2], [6, 6, 1, 2, 5, 5, 5, 5, 5, 5, 5], [7, 6, 1, 3, 2, 4, 7, 7, 7, 7, 7],
    [9, 6, 3, 1, 2, 4, 5, 9, 8, 8, 8], [9, 9, 4, 3, 1, 2, 5, 6, 7, 9, 9], [9, 10, 10, 5, 3, 1, 2, 4, 6, 7, 8],
    [9, 10, 10, 8, 5, 2, 1, 3, 4, 6, 7], [7, 10, 10, 9, 8, 6, 2, 1, 3, 5, 4], [6, 9, 9, 9, 9, 7, 5, 2, 1, 4, 3],
    [3, 8, 8, 7, 7, 7, 5, 4, 2, 2, 2], [2, 9, 9, 8, 8, 8, 6, 5, 3, 4, 1],
], np.int64)
ODD_LENGTHS = np.array([
    [1, 7, 7, 7, 7, 7, 7, 6, 4, 3, 2], [1, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4], [1, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4],
    [1, 6, 6, 5, 5, 5, 5, 5, 5, 5, 2], [1, 9, 9, 8, 8, 8, 6, 3, 5, 4, 2], [2, 9, 9, 8, 8, 8, 5, 1, 4, 6, 3],
    [2, 8, 8, 7, 7, 7, 4, 2, 3, 5, 2], [2, 8, 8, 7, 7, 7, 5, 3, 2, 4, 2], [1, 8, 8, 8, 8, 7, 7, 5, 3, 4, 2],
    [1, 8, 8, 8, 8, 7, 7, 5, 4, 3, 2], [1, 8, 8, 8, 8, 7, 7, 5, 3, 4, 2],
], np.int64)
#: the longest of those codes: a decoder peeks this many bits
PAIR_BITS = 10


def _pair_codes() -> tuple[np.ndarray, np.ndarray]:
    """The 22 static codes (11 even contexts, then 11 odd) as (bit-reversed codes [22, 11], decode tables
    [22, 2^PAIR_BITS] of ``length << 4 | value``), canonical as the streams' own codes (`canonical_codes`' rule,
    in Python: built at import, before any kernel compiles)."""
    lengths = np.concatenate([EVEN_LENGTHS, ODD_LENGTHS])
    codes = np.zeros(lengths.shape, np.int64)
    decode = np.zeros((lengths.shape[0], 1 << PAIR_BITS), np.int64)
    for t, row in enumerate(lengths.tolist()):
        assert sum(1 << (PAIR_BITS - n) for n in row) == 1 << PAIR_BITS  # complete: every pattern decodes
        code, last = 0, 0
        for n, v in sorted((n, v) for v, n in enumerate(row)):  # by length, then value
            code <<= n - last
            last = n
            rev = int(f"{code:0{n}b}"[::-1], 2)
            codes[t, v] = rev
            decode[t, rev :: 1 << n] = n << 4 | v
            code += 1
    return codes, decode


_PAIR_CODES, _PAIR_DECODE = _pair_codes()


@_jit
def length_pairs(lengths, gap):
    """mhuff version 2's bytes of one code-length table (uint8 lengths of ``alphabet`` symbols, even): nseg
    varint, per segment of used pairs (less than ``gap`` unused pairs apart) the unused pairs since the last one's
    end and its pairs (varints); then every segment's pairs' lengths, each pair its even symbol's length in the
    static code chosen by the previous pair's (0 at a segment's start), its odd symbol's in the one chosen by the
    even one's, LSB first, zero-padded to a byte."""
    npairs = lengths.size >> 1
    starts = np.empty(npairs, np.int64)
    counts = np.empty(npairs, np.int64)
    nseg, last = 0, -1
    for p in range(npairs):
        if lengths[2 * p] or lengths[2 * p + 1]:
            if last < 0 or p - last - 1 >= gap:
                starts[nseg] = p
                nseg += 1
            counts[nseg - 1] = p - starts[nseg - 1] + 1
            last = p
    out = np.zeros(10 + 20 * nseg + (2 * PAIR_BITS * npairs) // 8 + 2, np.uint8)
    at = _put_varint(out, 0, nseg)
    end = 0
    for i in range(nseg):
        at = _put_varint(out, at, starts[i] - end)
        at = _put_varint(out, at, counts[i])
        end = starts[i] + counts[i]
    acc, nacc = 0, 0
    for i in range(nseg):
        prev = 0
        for p in range(starts[i], starts[i] + counts[i]):
            e, o = np.int64(lengths[2 * p]), np.int64(lengths[2 * p + 1])
            acc |= _PAIR_CODES[prev, e] << nacc
            nacc += EVEN_LENGTHS[prev, e]
            acc |= _PAIR_CODES[11 + e, o] << nacc
            nacc += ODD_LENGTHS[e, o]
            prev = e
            while nacc >= 8:
                out[at] = np.uint8(acc & 0xFF)
                acc >>= 8
                nacc -= 8
                at += 1
    if nacc:
        out[at] = np.uint8(acc)
        at += 1
    return out[:at]


@_jit
def read_length_pairs(b8, at, end, alphabet, used):
    """`read_lengths` of a `length_pairs` table at byte ``at``: (the position after it, or -1 if it does not parse
    inside ``end``, n), ``used[:, :n]`` its used symbols and their lengths in symbol order (lengths over a stream's
    limit are `build_table`'s to refuse)."""
    npairs = alphabet >> 1
    nseg, at = _varint(b8, at, end)
    if at < 0 or nseg > npairs:
        return -1, 0
    starts = np.empty(nseg, np.int64)
    counts = np.empty(nseg, np.int64)
    p = 0
    for i in range(nseg):
        gap, at = _varint(b8, at, end)
        if at < 0:
            return -1, 0
        count, at = _varint(b8, at, end)
        if at < 0 or count == 0 or gap > npairs or count > npairs or p + gap + count > npairs:
            return -1, 0
        starts[i] = p + gap
        counts[i] = count
        p += gap + count
    pos, limit, n = 8 * at, 8 * end, 0
    for i in range(nseg):
        prev = 0
        for q in range(starts[i], starts[i] + counts[i]):
            w = _peek_bits(b8, pos)  # >= 25 bits: both codes of the pair (10 bits at most each)
            ent = _PAIR_DECODE[prev, w & ((1 << PAIR_BITS) - 1)]
            e = ent & 15
            w >>= ent >> 4
            pos += ent >> 4
            ent = _PAIR_DECODE[11 + e, w & ((1 << PAIR_BITS) - 1)]
            pos += ent >> 4
            if pos > limit:  # (an entry depends only on the bits its code takes: none past the table's end)
                return -1, 0
            if e:
                used[0, n] = 2 * q
                used[1, n] = e
                n += 1
            if ent & 15:
                used[0, n] = 2 * q + 1
                used[1, n] = ent & 15
                n += 1
            prev = e
    return (pos + 7) >> 3, n


@nb.njit(cache=True, nogil=True, inline="always")
def _peek_bits(b8, pos):
    """The 25 or more bits from bit ``pos`` on, LSB first (4 bytes read: the joined buffer's `PAD_BYTES` cover a
    read past its last stream)."""
    byte = pos >> 3
    v = np.int64(b8[byte]) | (np.int64(b8[byte + 1]) << 8) | (np.int64(b8[byte + 2]) << 16) | \
        (np.int64(b8[byte + 3]) << 24)
    return v >> (pos & 7)


@nb.njit(cache=True, nogil=True, inline="always")
def _varint(b8, at, end):
    """(value, next position) of the LEB128 varint at ``at``; position -1 if it runs past ``end`` or 9 bytes."""
    v = 0
    for k in range(9):
        if at >= end:
            return 0, -1
        byte = np.int64(b8[at])
        at += 1
        v |= (byte & 0x7F) << (7 * k)
        if byte < 0x80:
            return v, at
    return 0, -1


@_jit
def parse_headers(b8, start, size, prefix, m, ntab, alphabet, width, raw, max_len, paired, fp, tat, pstart, pbits,
                  stored):
    """Every stream's fields after the common ``prefix`` (magic, flags, shape: the first stream's, which every
    stream must repeat): context fingerprint, ``ntab`` code-length tables of ``alphabet`` symbols (``paired``:
    `read_length_pairs`' form after their byte count, skipped here: `build_table` reads them), payload (elements
    of ``width`` bits, ``raw`` of them after each code). The index of the first stream whose header does not parse
    or whose length does not add up, else -1."""
    plen = prefix.size
    used = np.empty((2, alphabet), np.int64)
    for s in range(start.size):
        at, end = start[s], start[s] + size[s] - 4  # the crc32 closes every stream
        if end < at + plen + 4:
            return s
        for k in range(plen):
            if b8[at + k] != prefix[k]:
                return s
        at += plen
        fp[s] = np.uint32(b8[at]) | (np.uint32(b8[at + 1]) << 8) | (np.uint32(b8[at + 2]) << 16) | \
            (np.uint32(b8[at + 3]) << 24)
        at += 4
        codes = 0
        if paired:  # the tables' bytes, then the tables: none coded (a stored stream) is ntab empty ones, 0 each
            tbytes, at = _varint(b8, at, end)
            if at < 0 or tbytes < ntab or at + tbytes > end:
                return s
            for k in range(ntab):
                codes += b8[at + k] != 0
            codes += tbytes > ntab
            tat[s] = at
            at += tbytes
        else:
            tat[s] = at
            for _ in range(ntab):
                at, n = read_lengths(b8, at, end, alphabet, used)
                if at < 0:
                    return s
                codes += n
        nbits, at = _varint(b8, at, end)
        stored[s] = codes == 0 and m > 0  # no code: the elements' bits as they are
        if stored[s]:
            if at < 0 or nbits != m * width:
                return s
        elif at < 0 or nbits < m * raw or nbits > m * (max_len + raw):
            return s
        if at + ((nbits + 7) >> 3) != end:
            return s
        pstart[s] = 8 * at
        pbits[s] = nbits
    return -1


@_jit
def element_contexts(mean, std, rebias, ew, out):
    """`huff.contexts` of per-element statistics in one pass: ``out[s, i]`` from float32 ``mean[s or 0, i]`` and
    ``std[s or 0, i]`` (a ``[1, 1]`` zero array stands for a missing one, broadcast): ``ms << ew | ref``, ``ref``
    the exponent field of ``max(|mean|, std)`` (``rebias``: float16's, rebiased by -112 and clipped to 0..31), ``ms``
    the mean's sign bit. The numpy form took ~10x longer per element than the decode itself."""
    mb, sb = mean.view(np.uint32), std.view(np.uint32)
    m_lead, m_all = mean.shape[0] > 1, mean.shape[1] > 1
    s_lead, s_all = std.shape[0] > 1, std.shape[1] > 1
    for r in range(out.shape[0]):
        mr, sr = r if m_lead else 0, r if s_lead else 0
        for i in range(out.shape[1]):
            m = mb[mr, i if m_all else 0]
            a = m & np.uint32(0x7FFFFFFF)
            b = sb[sr, i if s_all else 0] & np.uint32(0x7FFFFFFF)  # finite, >= 0 (-0.0: the same exponent)
            ref = (max(a, b) >> np.uint32(23)) & np.uint32(0xFF)  # finite floats >= 0 order as their bits
            if rebias:
                ref = np.uint32(min(max(np.int64(ref) - 112, 0), 31))
            out[r, i] = ((m >> np.uint32(31)) << np.uint32(ew)) | ref


@nb.njit(cache=True, nogil=True, inline="always")
def _fnv_step(h, cur, count, c, run):
    """`context_fingerprint`'s loop body without a branch (its hash is taken whether or not the run ends, then
    kept or not): where contexts change every few elements a branch mispredicts at random."""
    ends = (c != cur) & (count > 0)
    hh = ((h ^ _U(cur)) * _FNV ^ _U(count)) * _FNV
    h = hh if ends else h
    count = run if c != cur else count + run
    return h, c, count


@nb.njit(cache=True, nogil=True, inline="always")
def _fnv_end(h, cur, count):
    return ((h ^ _U(cur)) * _FNV ^ _U(count)) * _FNV if count else h


@_jit
def fingerprints(ctx, crow, rows, run, out):
    """`context_fingerprint` of every stream (computed once per row of ``ctx``), low 32 bits. Four rows of ``ctx``
    are hashed in lock step (four independent multiply chains), ~10x faster than one after the other."""
    n = ctx.shape[0]
    done = np.empty(n, np.int64)
    for g in range(0, n, 4):
        q0, q1, q2, q3 = g, min(g + 1, n - 1), min(g + 2, n - 1), min(g + 3, n - 1)
        h0 = h1 = h2 = h3 = _U(0xCBF29CE484222325)
        u0 = u1 = u2 = u3 = np.int64(-1)
        k0 = k1 = k2 = k3 = 0
        for r in range(rows):
            h0, u0, k0 = _fnv_step(h0, u0, k0, np.int64(ctx[q0, r]), run)
            h1, u1, k1 = _fnv_step(h1, u1, k1, np.int64(ctx[q1, r]), run)
            h2, u2, k2 = _fnv_step(h2, u2, k2, np.int64(ctx[q2, r]), run)
            h3, u3, k3 = _fnv_step(h3, u3, k3, np.int64(ctx[q3, r]), run)
        done[q0] = np.int64(_fnv_end(h0, u0, k0) & _U(0xFFFFFFFF))
        done[q1] = np.int64(_fnv_end(h1, u1, k1) & _U(0xFFFFFFFF))
        done[q2] = np.int64(_fnv_end(h2, u2, k2) & _U(0xFFFFFFFF))
        done[q3] = np.int64(_fnv_end(h3, u3, k3) & _U(0xFFFFFFFF))
    for s in range(crow.size):
        out[s] = np.uint32(done[crow[s]])


@_jit
def encode_stream(bits, ctx, rows, run, ew, mw):
    """One stream's (payload words, bit count, code length of every symbol)."""
    counts = np.zeros(2 << ew, np.int64)
    syms = symbols(bits, ctx, rows, run, ew, mw, counts)
    lengths = code_lengths(counts, MAX_LEN)
    codes, _ = canonical_codes(lengths, MAX_LEN)
    words = np.zeros((bits.size * (MAX_LEN + mw)) // 64 + 2, np.uint64)
    nbits = pack(bits, syms, codes, lengths, mw, words)
    return words, nbits, lengths


# --------------------------------------------------------------------------------------- mhuff (`mhuff.py`)


@_jit
def mhuff_contexts(mean, std, rebias, ew, k, out):
    """mhuff's context of every element, ``out[s, i]`` from float32 ``mean[s or 0, i or 0]`` and ``std[...]``
    (as `element_contexts`) with integer operations on their bits only: ``cls << (W + 1) | ms << W | ref``,
    W = ew + k; ``ref`` the exponent and top ``k`` mantissa bits of ``a = max(|mean|, std)`` (``rebias``:
    float16's exponent, rebiased by -112, the W bits clipped to 0..2^W - 1), ``ms`` the mean's sign bit, ``cls``
    the exponent gap of ``a`` over ``std`` clipped to 3 (a table per class)."""
    mb, sb = mean.view(np.uint32), std.view(np.uint32)
    m_lead, m_all = mean.shape[0] > 1, mean.shape[1] > 1
    s_lead, s_all = std.shape[0] > 1, std.shape[1] > 1
    w = ew + k
    wmask = (1 << w) - 1
    for r in range(out.shape[0]):
        mr, sr = r if m_lead else 0, r if s_lead else 0
        for i in range(out.shape[1]):
            m = mb[mr, i if m_all else 0]
            b = sb[sr, i if s_all else 0] & np.uint32(0x7FFFFFFF)  # finite, >= 0 (-0.0: the same exponent)
            a = max(m & np.uint32(0x7FFFFFFF), b)  # finite floats >= 0 order as their bits
            ref = np.int64(a >> np.uint32(23 - k))
            if rebias:
                ref = min(max(ref - (112 << k), 0), wmask)
            cls = min((np.int64(a) >> 23) - (np.int64(b) >> 23), 3)
            out[r, i] = np.uint32((cls << (w + 1)) | (np.int64(m >> np.uint32(31)) << w) | (ref & wmask))


@_jit
def mhuff_encode_stream(bits, ctx, ew, mw, k, max_len):
    """One mhuff stream (one context per element): (payload words, bit count, code lengths [4, 2^(W+1)]). The
    symbol of an element, in its class's table: ``off * 2 + (sign ^ ms)``, ``off = ((x >> (MW - k)) - ref +
    2^(W-1)) mod 2^W`` (x's exponent and top k mantissa bits against the context's); its MW - k low bits raw."""
    w = ew + k
    wmask = (1 << w) - 1
    half = 1 << (w - 1)
    alphabet = 2 << w
    counts = np.zeros((4, alphabet), np.int64)
    syms = np.empty(bits.size, np.int64)
    for i in range(bits.size):
        v = np.int64(bits[i])
        c = np.int64(ctx[i])
        off = (((v >> (mw - k)) & wmask) - (c & wmask) + half) & wmask
        s = (off << 1) | ((v >> (ew + mw)) ^ ((c >> w) & 1))
        cls = c >> (w + 1)
        syms[i] = cls * alphabet + s
        counts[cls, s] += 1
    lengths = np.zeros((4, alphabet), np.int64)
    codes = np.zeros((4, alphabet), np.int64)
    for t in range(4):
        lengths[t] = code_lengths(counts[t], max_len)
        codes[t] = canonical_codes(lengths[t], max_len)[0]
        if np.count_nonzero(counts[t]) > (1 << max_len):  # no code of max_len bits: the caller stores the stream
            return np.zeros(1, np.uint64), np.int64(-1), lengths
    words = np.zeros((bits.size * (max_len + mw - k)) // 64 + 2, np.uint64)
    nbits = pack(bits, syms, codes.reshape(-1), lengths.reshape(-1), mw - k, words)
    return words, nbits, lengths
