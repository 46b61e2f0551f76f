"""Compiled kernels of the lanes format (numba, ``nogil``): interleaved rANS and hashes (the per-element
model is `params.params_kernel`).

Everything here is integer arithmetic on arrays prepared by `lanes.py`; nothing allocates Python objects in
the loops, so the kernels release the GIL and run on several threads at once (one call per thread, each
over a range of streams). The coder is rANS with a 64-bit state and 32-bit words (state in
``[2^31, 2^63)``), precision 24 bits (the tables' own), one state per lane, element ``i`` in lane
``i % lanes``, one shared word stream.
See docs/codec_format.md section 12.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ..tables import PRECISION

PREC = PRECISION  # 24: the tables' frequencies sum to 2^24
MASK = (1 << PREC) - 1
TOTAL = 1 << PREC
RANS_L = 1 << 31  # lower bound of a normalised state; states lie in [RANS_L, RANS_L << 32)
LUT_BITS = 10  # slot -> symbol index: 2^10 buckets per table, 2 KiB (docs/codec_format.md 12.2)
LUT_SHIFT = PREC - LUT_BITS
_FNV = 0x100000001B3

# error codes returned per stream by the decode kernel (lanes.py turns them into messages)
OK = 0
ERR_WORDS_SHORT = 1  # the word stream ran out
ERR_WORDS_LEFT = 2  # words left over after the last element
ERR_STATE = 3  # a lane did not return to its initial state
ERR_KEY = 4  # a decoded value outside the dtype
ERR_HASH = 5  # the check hash of payload and decoded bits differs

_jit = nb.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")
# Hot-loop array indices are cast to unsigned: numba wraps a signed index around (negative = from the end)
# with 2-3 extra instructions per access, an unsigned one it uses as is. The decode loop's indices are never
# negative (docs/results/codec.md 12.4 has the measurement).
_U = np.uint64


@nb.njit(cache=True, nogil=True, inline="always")
def _element_params(pi, tid_a, cp_a, cn_a, sg_a, coff, size_a, half_a):
    """Compact entry ``pi``'s coding parameters, as both loops use them: table, its offset in ``cum``, size,
    half, the two key offsets and whether the symbol order is flipped."""
    t = np.int64(tid_a[_U(pi)])
    return (t, np.int64(coff[_U(t)]), np.int64(size_a[_U(t)]), np.int64(half_a[_U(t)]), np.int64(cp_a[_U(pi)]),
            np.int64(cn_a[_U(pi)]), sg_a[_U(pi)] <= 0)


@nb.njit(cache=True, nogil=True, inline="always")
def _fmix64(h):
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h


@nb.njit(cache=True, nogil=True, inline="always")
def combine_check(h_words, h_values):
    """The stream's 32-bit check from the two FNV-1a accumulators (payload words; decoded bit patterns)."""
    return np.uint32(_fmix64(_fmix64(h_words) ^ h_values) & np.uint64(0xFFFFFFFF))


@_jit
def fingerprints(mean_bits, mean_rows, mean_shape, std_bits, std_rows, std_shape, n_streams, out):
    """Per stream: a 32-bit hash of its mean and std (float32 bits and per-stream broadcast shape).
    ``mean_bits``: [rows, C] with rows 1 (shared) or n_streams; rows 0 marks None. Four interleaved FNV-1a
    accumulators (one multiply chain would bound the speed), mixed at the end."""
    for i in range(n_streams):
        h = np.uint64(0xCBF29CE484222325)
        for which in range(2):
            bits = mean_bits if which == 0 else std_bits
            rows = mean_rows if which == 0 else std_rows
            shape = mean_shape if which == 0 else std_shape
            if rows == 0:
                h = (h ^ np.uint64(0xFFFFFFFF)) * np.uint64(_FNV)
                continue
            h = (h ^ np.uint64(shape.size)) * np.uint64(_FNV)
            for d in range(shape.size):
                h = (h ^ np.uint64(shape[d])) * np.uint64(_FNV)
            r = i if rows > 1 else 0
            c = bits.shape[1]
            a0 = h
            a1 = np.uint64(0x9E3779B97F4A7C15)
            a2 = np.uint64(0xC2B2AE3D27D4EB4F)
            a3 = np.uint64(0x165667B19E3779F9)
            k = 0
            while k + 4 <= c:
                a0 = (a0 ^ np.uint64(bits[r, k])) * np.uint64(_FNV)
                a1 = (a1 ^ np.uint64(bits[r, k + 1])) * np.uint64(_FNV)
                a2 = (a2 ^ np.uint64(bits[r, k + 2])) * np.uint64(_FNV)
                a3 = (a3 ^ np.uint64(bits[r, k + 3])) * np.uint64(_FNV)
                k += 4
            while k < c:
                a0 = (a0 ^ np.uint64(bits[r, k])) * np.uint64(_FNV)
                k += 1
            h = _fmix64(a0) ^ _fmix64(a1 ^ (a2 << np.uint64(1))) ^ (a3 * np.uint64(3))
        out[i] = np.uint32(_fmix64(h) & np.uint64(0xFFFFFFFF))


def _crc_table() -> np.ndarray:
    """zlib's CRC-32 (reflected polynomial 0xEDB88320) byte table."""
    table = np.empty(256, dtype=np.uint32)
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table[b] = c
    return table


CRC_TABLE = _crc_table()


@_jit
def check_headers(buf8, hstart, sizes, like, lanes_bits, max_lanes_log2, sigma_at, sigma_min, sigma_max, crc_table,
                  lanes_log2, sigma, digest, fp, check):
    """Fast path of the header parse for a batch whose streams share the first stream's header layout: stream
    ``s``'s header (``like.size + 16`` bytes from ``buf8[hstart[s]]``) must equal ``like`` (the first
    header's bytes before its digest) except in the flags byte's lane bits, carry a lane count up to
    ``2^max_lanes_log2`` and, where ``sigma_at`` >= 0, a sigma code within bounds there, and pass its CRC-32.
    Fills the per-stream fields; returns the first stream that does not (-1: all do), which the caller
    parses the slow way for its exact error. See `lanes.parse_header` for the layout."""
    n_like = like.size
    for s in range(hstart.size):
        h = hstart[s]
        if sizes[s] < n_like + 16:
            return s
        for k in range(n_like):
            b = buf8[h + k]
            if k == 3:  # flags: the lane bits may differ
                if (b & ~lanes_bits) != (like[k] & ~lanes_bits) or (b & lanes_bits) >> 4 > max_lanes_log2:
                    return s
            elif (sigma_at < 0 or k < sigma_at or k >= sigma_at + 2) and b != like[k]:  # the sigma code may differ
                return s
        if sigma_at >= 0:
            code = np.int64(buf8[h + sigma_at]) | (np.int64(buf8[h + sigma_at + 1]) << 8)
            if code < sigma_min or code > sigma_max:
                return s
            sigma[s] = code
        crc = np.uint32(0xFFFFFFFF)
        for k in range(n_like + 12):
            crc = crc_table[(crc ^ np.uint32(buf8[h + k])) & np.uint32(0xFF)] ^ (crc >> np.uint32(8))
        if crc ^ np.uint32(0xFFFFFFFF) != _u32le(buf8, h + n_like + 12):
            return s
        lanes_log2[s] = (buf8[h + 3] & lanes_bits) >> 4
        digest[s] = _u32le(buf8, h + n_like)
        fp[s] = _u32le(buf8, h + n_like + 4)
        check[s] = _u32le(buf8, h + n_like + 8)
    return -1


@nb.njit(cache=True, nogil=True, inline="always")
def _u32le(buf8, a):
    return (np.uint32(buf8[a]) | (np.uint32(buf8[a + 1]) << np.uint32(8)) | (np.uint32(buf8[a + 2]) << np.uint32(16))
            | (np.uint32(buf8[a + 3]) << np.uint32(24)))


@nb.njit(cache=True, nogil=True, inline="always")
def _find(cum, c0, lut, l0, slot):
    """Symbol whose [cum[s], cum[s+1]) holds ``slot``: the bucket narrows it to [lut[b], lut[b+1]]; up to eight
    candidates (near the mode: a bucket holds ~1-3 symbols at 10 bits/scalar) are settled by three steps
    without a branch (selects), wider buckets (the tails, rarely visited) first by a binary search with
    branches."""
    b = slot >> LUT_SHIFT
    lo = np.int64(lut[_U(l0 + b)])
    hi = np.int64(lut[_U(l0 + b + 1)])
    while hi - lo > 7:
        mid = (lo + hi + 1) >> 1
        if cum[_U(c0 + mid)] <= slot:
            lo = mid
        else:
            hi = mid - 1
    for _ in range(3):
        mid = (lo + hi + 1) >> 1
        up = cum[_U(c0 + mid)] <= slot
        lo = mid if up else lo
        hi = hi if up else mid - 1
    return lo


@_jit
def encode_streams(bits, n, lanes_log2, raw_bits, pidx, run, p_row, tid_a, cp_a, cn_a, sg_a,
                   cum, coff, size_a, half_a, pcum, esc_freq, zero_key, words, nwords, checks, s_lo, s_hi):
    """Code streams ``s_lo..s_hi-1`` (bit patterns ``bits[s, :n]``) into ``words[s]``, filled from the end:
    the stream's ``nwords[s]`` words are ``words[s, -nwords[s]:]``, lane states (low, high word each) then
    the word stream in decoding order; ``checks[s]`` gets the check `decode_streams` verifies.

    Decoding order, in rounds of ``lanes`` elements (element ``i`` in lane ``i % lanes``): the escape flags
    of the round's elements, lane by lane, then their symbols, lane by lane. Each phase is one step per
    lane, so a vector decoder (a GPU warp) can place its refills by a prefix sum. The encoder runs it
    backwards. Element ``i`` of stream ``s`` takes its parameters at ``p_row[s] + pidx[i]`` (``pidx``
    empty: ``i``; ``run`` as in `decode_streams`: one parameter set per round)."""
    lanes = 1 << lanes_log2
    cap = words.shape[1]
    state = np.empty(lanes, dtype=np.uint64)
    z = zero_key
    fe = np.uint64(esc_freq)
    fv = np.uint64(TOTAL - esc_freq)
    ident = pidx.size == 0
    per_round = run > 0 and run % lanes == 0
    for s in range(s_lo, s_hi):
        for k in range(lanes):
            state[k] = np.uint64(RANS_L)
        pos = cap
        base = p_row[s]
        pi = np.int64(-1)  # the compact index whose parameters are loaded (none yet)
        size = half = cpv = cnv = c0 = np.int64(0)
        flip = False
        for r in range((n + lanes - 1) // lanes - 1, -1, -1):
            i0 = r * lanes
            i1 = min(n, i0 + lanes)
            escaped = np.uint64(0)  # bit k: lane k's element escaped
            want = base + i0 // run if per_round else np.int64(-1)  # the round's compact index
            for phase in range(2):  # the symbols (decoded second, so coded first), then the escape flags
                for i in range(i1 - 1, i0 - 1, -1):
                    if phase == 1:  # flag: valid [0, TOTAL - fe), escaped [TOTAL - fe, TOTAL)
                        esc = (escaped >> np.uint64(i - i0)) & np.uint64(1)
                        f = fe if esc else fv
                        start = fv if esc else np.uint64(0)
                    else:
                        pat = np.int64(bits[_U(s), _U(i)]) >> raw_bits
                        key = pat + z if pat < z else (2 * z - 1) - pat
                        if not per_round or pi != want:  # the element's (per round: the round's) parameters
                            pi = want if per_round else base + (i if ident else np.int64(pidx[_U(i)]))
                            _, c0, size, half, cpv, cnv, flip = _element_params(pi, tid_a, cp_a, cn_a, sg_a, coff,
                                                                                size_a, half_a)
                        s0 = key - (cpv if key >= z else cnv)
                        if (s0 >= 0) and (s0 < size) and ((key < cnv + half) or (key >= cpv + half)):
                            sym = size - 1 - s0 if flip else s0
                            start = np.uint64(cum[_U(c0 + sym)])
                            f = np.uint64(cum[_U(c0 + sym + 1)]) - start
                        else:
                            escaped |= np.uint64(1) << np.uint64(i - i0)
                            start = np.uint64(pcum[_U(pat)])
                            f = np.uint64(pcum[_U(pat + 1)]) - start
                    x = state[_U(i - i0)]
                    if x >= (f << np.uint64(63 - PREC)):  # renormalise: emit the low word
                        pos -= 1
                        words[_U(s), _U(pos)] = np.uint32(x & np.uint64(0xFFFFFFFF))
                        x >>= np.uint64(32)
                    state[_U(i - i0)] = ((x // f) << np.uint64(PREC)) + (x % f) + start
        for k in range(lanes - 1, -1, -1):
            pos -= 1
            words[s, pos] = np.uint32(state[k] >> np.uint64(32))
            pos -= 1
            words[s, pos] = np.uint32(state[k] & np.uint64(0xFFFFFFFF))
        nwords[s] = cap - pos
        h = np.uint64(0xCBF29CE484222325)
        for k in range(pos, cap):
            h = (h ^ np.uint64(words[s, k])) * np.uint64(_FNV)
        h2 = np.uint64(0x84222325CBF29CE4)
        for i in range(n):
            h2 = (h2 ^ np.uint64(bits[s, i])) * np.uint64(_FNV)
        checks[s] = combine_check(h, h2)


@nb.njit(cache=True, nogil=True, inline="always")
def _refill(x, pos, last, buf32):
    """Decoder renormalisation: below 2^31 the state takes the next word. Past the stream's last word
    nothing is read and ``pos`` moves beyond ``last + 1``, which the caller reports."""
    if x < np.uint64(RANS_L):
        if pos > last:
            return x, last + 2
        return (x << np.uint64(32)) | np.uint64(buf32[_U(pos)]), pos + 1
    return x, pos


@_jit
def decode_streams(buf8, buf32, wstart, wcount, rstart, n, lanes_log2, pidx, run, p_row, tid_a, cp_a, cn_a, sg_a,
                   cum, coff, size_a, half_a, lut, pcum, plut, esc_freq, zero_key, pattern_bits, raw_bits,
                   checks, verify, out, obase, orun, ohi, olo, err, s_lo, s_hi):
    """Decode streams ``s_lo..s_hi-1`` (``lanes_log2[s]`` lanes each): words ``buf32[wstart[s] :
    wstart[s] + wcount[s]]``, raw low bits from byte ``rstart[s]`` of ``buf8`` (the same buffer), into the
    flat ``out`` (full bit patterns): element ``i`` of stream ``s`` at ``obase[s] + (i // orun) * ohi +
    (i % orun) * olo`` (a strided destination: a cache writes its blocks straight into the tensor attention
    reads; a stream that is not one contiguous run of ``out`` is decoded into a scratch buffer, then stored run by
    run: strided stores inside the decode loop measured 10 % slower); ``err[s]`` gets an error code (0: ok, every word consumed, every
    lane back at its initial state, decoded values inside the dtype, and where ``verify[s]`` is set the check
    of words and decoded bits equal to ``checks[s]``: two serial hash chains, ~10 % of the decode, that a
    caller skips only for streams it already decoded with the check, whose bytes cannot have changed).

    Order as in `encode_streams`: per round of ``lanes`` elements, the flags lane by lane, then the
    symbols lane by lane. ``run`` > 0 says that ``pidx[i] == i // run`` (per-channel statistics of a
    ``[channels, tokens]`` stream: ``run`` = tokens): where ``run`` is a multiple of the lane count, a round's
    elements share one parameter set, loaded once per round instead of once per element. Renormalisation is a branch, not a select: all lanes share one read position, and a select would chain
    every lane's step through it (measured 1.5-2x slower); the predictor lets the lanes run ahead."""
    state = np.empty(1 << 6, dtype=np.uint64)
    z = np.int64(zero_key)
    fe = np.uint64(esc_freq)
    fv = np.uint64(TOTAL - esc_freq)
    lo_bound = np.uint64(RANS_L)
    ident = pidx.size == 0
    n_pat = np.int64(1) << pattern_bits
    lut_stride = (1 << LUT_BITS) + 1
    direct = olo == 1 and (ohi == orun or n <= orun)  # every stream one contiguous run of out
    scratch = np.empty(0 if direct else n, dtype=out.dtype)
    for s in range(s_lo, s_hi):
        w0 = wstart[s]
        nw = wcount[s]
        lanes = np.int64(1) << lanes_log2[s]
        if nw < 2 * lanes:
            err[s] = ERR_WORDS_SHORT
            continue
        for k in range(lanes):
            state[k] = np.uint64(buf32[w0 + 2 * k]) | (np.uint64(buf32[w0 + 2 * k + 1]) << np.uint64(32))
        last = w0 + nw - 1
        pos = w0 + 2 * lanes
        base = p_row[s]
        r0 = rstart[s]
        code = OK
        check = verify[s] != 0
        h2 = np.uint64(0x84222325CBF29CE4)
        per_round = run > 0 and run % lanes == 0
        pi = np.int64(-1)  # the compact index whose parameters are loaded (none yet)
        t = c0 = l0 = size = half = cpv = cnv = np.int64(0)
        flip = False
        dst = out if direct else scratch
        d0 = obase[s] if direct else np.int64(0)
        for r in range((n + lanes - 1) // lanes):
            i0 = r * lanes
            i1 = min(n, i0 + lanes)
            escaped = np.uint64(0)  # bit k: lane k's element escaped
            for i in range(i0, i1):  # the round's escape flags
                x = state[_U(i - i0)]
                slot = x & np.uint64(MASK)
                q = x >> np.uint64(PREC)
                if slot < fv:
                    x = fv * q + slot
                else:
                    x = fe * q + slot - fv
                    escaped |= np.uint64(1) << np.uint64(i - i0)
                state[_U(i - i0)], pos = _refill(x, pos, last, buf32)
            want = base + i0 // run if per_round else np.int64(-1)  # the round's compact index
            for i in range(i0, i1):  # then their symbols
                x = state[_U(i - i0)]
                slot_i = np.int64(x & np.uint64(MASK))
                if (escaped >> np.uint64(i - i0)) & np.uint64(1) == 0:
                    if not per_round or pi != want:  # the element's (per round: the round's) parameters
                        pi = want if per_round else base + (i if ident else np.int64(pidx[_U(i)]))
                        t, c0, size, half, cpv, cnv, flip = _element_params(pi, tid_a, cp_a, cn_a, sg_a, coff,
                                                                            size_a, half_a)
                        l0 = t * lut_stride
                    sym = _find(cum, c0, lut, l0, slot_i)
                    start = np.int64(cum[_U(c0 + sym)])
                    f = np.int64(cum[_U(c0 + sym + 1)]) - start
                    s0 = size - 1 - sym if flip else sym
                    key = s0 + (cpv if s0 >= half else cnv)
                else:
                    sym = _find(pcum, 0, plut, 0, slot_i)
                    start = np.int64(pcum[_U(sym)])
                    f = np.int64(pcum[_U(sym + 1)]) - start
                    key = sym + z if sym < z else (2 * z - 1) - sym
                x = np.uint64(f) * (x >> np.uint64(PREC)) + np.uint64(slot_i - start)
                state[_U(i - i0)], pos = _refill(x, pos, last, buf32)
                if key < 0 or key >= n_pat:
                    code = ERR_KEY
                    break
                v = _value(key, i, z, r0, buf8, raw_bits)
                if check:
                    h2 = (h2 ^ np.uint64(v)) * np.uint64(_FNV)
                dst[_U(d0 + i)] = v
            if code != OK:
                break
            if pos > last + 1:
                code = ERR_WORDS_SHORT
                break
        if code == OK:
            if pos - w0 < nw:
                code = ERR_WORDS_LEFT
            else:
                for k in range(lanes):
                    if state[k] != lo_bound:
                        code = ERR_STATE
                        break
        if code == OK and check and _stream_check(buf32, w0, nw, h2) != checks[s]:
            code = ERR_HASH
        if code == OK and not direct:  # run by run into the destination, its stores in address order
            runs = n // orun
            for lo in range(orun):
                a = obase[s] + lo * olo
                for hi in range(runs):
                    out[_U(a + hi * ohi)] = scratch[_U(hi * orun + lo)]
        err[s] = code


@nb.njit(cache=True, nogil=True, inline="always")
def _value(key, i, z, r0, buf8, raw_bits):
    """Full bit pattern of element ``i``: the key's coded pattern joined with its raw low bits."""
    pat = key - z if key >= z else (2 * z - 1) - key
    if raw_bits == 16:
        a = r0 + 2 * i
        return (pat << 16) | np.int64(buf8[a]) | (np.int64(buf8[a + 1]) << 8)
    if raw_bits == 3:
        a = r0 + 3 * (i >> 3)
        wd = np.int64(buf8[a]) | (np.int64(buf8[a + 1]) << 8) | (np.int64(buf8[a + 2]) << 16)
        return (pat << 3) | ((wd >> (3 * (i & 7))) & 7)
    return pat


@nb.njit(cache=True, nogil=True, inline="always")
def _stream_check(buf32, w0, nw, h_values):
    h = np.uint64(0xCBF29CE484222325)
    for k in range(w0, w0 + nw):
        h = (h ^ np.uint64(buf32[k])) * np.uint64(_FNV)
    return combine_check(h, h_values)


@_jit
def finish_streams(keys, buf8, buf32, wstart, wcount, rstart, n, pattern_bits, raw_bits, zero_key, checks, verify,
                   out, err, s_lo, s_hi):
    """For keys decoded elsewhere (the Triton decoder): join the raw low bits into ``out[s, :n]`` and verify
    the stream checks where ``verify[s]`` is set, setting ``err[s]`` like `decode_streams`."""
    z = np.int64(zero_key)
    n_pat = np.int64(1) << pattern_bits
    for s in range(s_lo, s_hi):
        h2 = np.uint64(0x84222325CBF29CE4)
        code = OK
        check = verify[s] != 0
        for i in range(n):
            key = np.int64(keys[s, i])
            if key < 0 or key >= n_pat:
                code = ERR_KEY
                break
            v = _value(key, i, z, rstart[s], buf8, raw_bits)
            if check:
                h2 = (h2 ^ np.uint64(v)) * np.uint64(_FNV)
            out[s, i] = v
        if code == OK and check and _stream_check(buf32, wstart[s], wcount[s], h2) != checks[s]:
            code = ERR_HASH
        err[s] = code
