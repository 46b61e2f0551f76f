"""Windows of symbols <-> constriction ANS words.

Per window one ``AnsCoder`` stream holds, in decode order: the escape flags of all elements (one call,
binary model of the window's tier), then the non-escaped elements grouped by table id in ascending order
(one call per distinct table, with that table's cached ``Categorical``), then the escaped elements under
p_hat (one call). Grouping is a stable sort by table id, so the decoder, which recomputes the table ids
from (mean, std) and knows the flags, reproduces the groups. The raw low bits (float32, float16) follow
the ANS words in the window's payload.

Also here: running independent window jobs serially, on threads, or on forked processes (constriction
holds the GIL while it codes, so threads only overlap the numpy parts; processes scale but cost a fork:
copy-on-write, no pickling of inputs, output straight into shared memory; Linux/macOS only, elsewhere
threads).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import shared_memory

import constriction
import numpy as np

from ...errors import CorruptStreamError
from ..codec_config import CodecConfig
from ..params import Params
from ..symbols import Format, pack_raw, raw_padded_nbytes, unpack_raw
from ..tables import ESCAPE_GROUP, PRECISION, TOTAL, Marginal, Tables, get_tables

_Categorical = constriction.stream.model.Categorical
_AnsCoder = constriction.stream.stack.AnsCoder


@dataclass
class Models:
    """Everything a window coder needs: one model per group id (tables, then p_hat), flag models per tier."""

    tables: Tables
    groups: list  # index = group id; last = p_hat
    flags: list  # per tier
    flag_freq: np.ndarray  # escape frequency per tier (out of 2^24)
    phat_freq: np.ndarray  # effective p_hat frequencies
    fmt: Format

    @classmethod
    def build(cls, tables: Tables, phat_model, phat_freq: np.ndarray, escape: tuple[int, ...], fmt: Format):
        freq = np.array([e << (PRECISION - 16) for e in escape], dtype=np.int64)
        flags = [_Categorical(np.array([TOTAL - 1 - f, f - 1], dtype=np.float64), perfect=False) for f in freq]
        return cls(tables, [*tables.models, phat_model], flags, freq, phat_freq, fmt)


@functools.lru_cache(maxsize=32)
def _models_cached(fmt: Format, marginal: Marginal, escape: tuple[int, int, int]) -> Models:
    model, freq = marginal.coding(fmt)
    return Models.build(get_tables(), model, freq, escape, fmt)


def models_for(fmt: Format, cfg: CodecConfig) -> Models:
    return _models_cached(fmt, cfg.marginal_or_default, cfg.escape)


# The symbol mapping of docs/codec_format.md section 2.3, written once against an array namespace ``xp`` (numpy
# here, torch in `device`); ``size`` / ``half``: per table id, arrays of ``xp``.


def symbol_of(keys, tid, cp, cn, s, size, half, zero_key: int, xp) -> tuple:
    """(valid, symbol) per element: the key's symbol in table ``tid``, or, for an element that escapes, its
    coded pattern (the symbol under p_hat)."""
    size_t, half_t = size[tid], half[tid]
    s0 = keys - xp.where(keys >= zero_key, cp, cn)
    valid = (s0 >= 0) & (s0 < size_t) & ((keys < cn + half_t) | (keys >= cp + half_t))
    sym = xp.where(s > 0, s0, size_t - 1 - s0)
    pattern = xp.where(keys >= zero_key, keys - zero_key, 2 * zero_key - 1 - keys)
    return valid, xp.where(valid, sym, pattern)


def key_of(sym, valid, tid, cp, cn, s, size, half, zero_key: int, xp):
    """Inverse of `symbol_of`: keys from decoded symbols and escape flags."""
    size_t = size[tid]
    s0 = xp.where(s > 0, sym, size_t - 1 - sym)
    key = s0 + xp.where(s0 >= half[tid], cp, cn)
    return xp.where(valid, key, xp.where(sym < zero_key, sym + zero_key, 2 * zero_key - 1 - sym))


def symbols(keys: np.ndarray, p: Params, tables: Tables, fmt: Format) -> tuple[np.ndarray, np.ndarray]:
    """`symbol_of` for numpy keys and `Params` (symbols int32)."""
    return symbol_of(keys, p.tid, p.cp, p.cn, p.s, tables.size, tables.half, fmt.zero_key, np)


def _group_ids(valid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Coding group per element: its table id, or ESCAPE_GROUP (p_hat) when escaped (rare: skip the pass)."""
    if valid.all():
        return np.asarray(tid, dtype=np.uint16)
    return np.where(valid, tid, ESCAPE_GROUP).astype(np.uint16)


def _segments(gid: np.ndarray, lengths: np.ndarray):
    """Stable grouping by group id inside each window: the permutation, and the (start, end, group,
    window) slices of the permuted array ordered by (group, window). Each window's own slices come in
    ascending group order, which is its coding order; walking all windows group by group keeps one table
    hot in cache while it serves every window of the chunk."""
    n = gid.size
    order = np.argsort(gid, kind="stable")  # radix sort (uint16)
    if lengths.size == 1:  # one window (the common case for cache streams): counts give the slices
        counts = np.bincount(gid, minlength=ESCAPE_GROUP + 1)
        groups = np.flatnonzero(counts)
        ends = np.cumsum(counts[groups])
        starts = ends - counts[groups]
        return order, starts.tolist(), ends.tolist(), groups.tolist(), [0] * groups.size
    win = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
    gs = gid[order]
    ws = win[order]
    brk = np.flatnonzero((gs[1:] != gs[:-1]) | (ws[1:] != ws[:-1])) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [n]])
    return order, starts.tolist(), ends.tolist(), gs[starts].tolist(), ws[starts].tolist()


def encode_chunk(keys, raw, p: Params, lengths: np.ndarray, models: Models, cfg_tiers: list[int],
                 want_costs: bool = False, pre: tuple[np.ndarray, np.ndarray] | None = None):
    """Code consecutive windows. Returns (payloads, per-window ideal model bits or None). ``pre``: (valid,
    symbol) per element when a device kernel computed them (else from ``keys`` and ``p`` here)."""
    t = models.tables
    valid, sym = symbols(keys, p, t, models.fmt) if pre is None else pre
    gid = _group_ids(valid, p.tid)
    flags = (~valid).astype(np.int32)
    order, sa, sb, sg, sw = _segments(gid, lengths)
    ssym = sym[order]
    ofs = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    groups, flag_models = models.groups, models.flags
    coders = [_AnsCoder() for _ in range(lengths.size)]
    for k in range(len(sa) - 1, -1, -1):  # ANS is LIFO: every window's last decoded group first
        coders[sw[k]].encode_reverse(ssym[sa[k] : sb[k]], groups[sg[k]])
    payloads = []
    for w, enc in enumerate(coders):
        enc.encode_reverse(flags[ofs[w] : ofs[w + 1]], flag_models[cfg_tiers[w]])
        data = enc.get_compressed().astype("<u4").tobytes()
        if raw is not None:
            data += pack_raw(raw[ofs[w] : ofs[w + 1]], models.fmt)
        payloads.append(data)
    costs = None
    if want_costs:
        costs = _model_bits(valid, sym, p, lengths, models, cfg_tiers)
    return payloads, costs


def _model_bits(valid, sym, p, lengths, models: Models, tiers) -> np.ndarray:
    """Ideal bits -sum log2 q per window under the codec's own integer model (incl. raw bits)."""
    t = models.tables
    idx = t.cost_offset[p.tid] + np.where(valid, sym, 0)
    table_bits = t.cost_bits[idx]
    esc_bits = PRECISION - np.log2(models.phat_freq[np.where(valid, 0, sym)].astype(np.float64))
    tier_e = models.flag_freq[np.repeat(np.asarray(tiers), lengths)].astype(np.float64)
    flag_bits = np.where(valid, PRECISION - np.log2(TOTAL - tier_e), PRECISION - np.log2(tier_e))
    per = np.where(valid, table_bits, esc_bits) + flag_bits + models.fmt.raw_bits
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.add.reduceat(per, starts) if per.size else np.zeros(0)


def decode_chunk(buf, offsets: np.ndarray, p: Params, lengths: np.ndarray, models: Models,
                 tiers: list[int], timings: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Inverse of `encode_chunk` for the windows whose payloads start at ``offsets[:-1]``: (keys, raw low
    bits or None). ``timings`` collects (window length, seconds in the coder for that window)."""
    fmt, t = models.fmt, models.tables
    n = int(lengths.sum())
    nw = lengths.size
    ofs = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    flags = np.empty(n, dtype=np.int32)
    raw = np.empty(n, dtype=np.int64) if fmt.raw_bits else None
    coders = []
    clock = time.perf_counter
    times = [0.0] * nw
    for w in range(nw):
        t0 = clock()
        lo, hi = int(offsets[w]), int(offsets[w + 1])
        m = ofs[w + 1] - ofs[w]
        nraw = raw_padded_nbytes(m, fmt) if fmt.raw_bits else 0
        nwords = (hi - lo - nraw) // 4
        if nwords < 0:
            raise CorruptStreamError("corrupt codec stream: window payload too short for its raw bits")
        try:
            dec = _AnsCoder(np.frombuffer(buf, dtype="<u4", count=nwords, offset=lo))
            flags[ofs[w] : ofs[w + 1]] = dec.decode(models.flags[tiers[w]], m)
        except (ValueError, RuntimeError) as err:
            raise CorruptStreamError(f"corrupt codec stream: {err}") from None
        if raw is not None:
            raw[ofs[w] : ofs[w + 1]] = unpack_raw(buf[lo + 4 * nwords : hi], m, fmt)
        coders.append(dec)
        times[w] = clock() - t0
    valid = flags == 0
    gid = _group_ids(valid, p.tid)
    order, sa, sb, sg, sw = _segments(gid, lengths)
    groups = models.groups
    try:
        if timings is None:
            pieces = [coders[w].decode(groups[g], b - a) for a, b, g, w in zip(sa, sb, sg, sw)]
        else:  # monitoring: charge every call to its window
            pieces = []
            for a, b, g, w in zip(sa, sb, sg, sw):
                t0 = clock()
                pieces.append(coders[w].decode(groups[g], b - a))
                times[w] += clock() - t0
    except (ValueError, RuntimeError) as err:
        raise CorruptStreamError(f"corrupt codec stream: {err}") from None
    if not all(dec.is_empty() for dec in coders):
        raise CorruptStreamError("corrupt codec stream: window payload has data left after decoding")
    if timings is not None:
        timings.extend(zip(lengths.tolist(), times))
    sym = np.empty(n, dtype=np.int32)
    if pieces:
        sym[order] = np.concatenate(pieces)
    keys = key_of(sym, valid, p.tid, p.cp, p.cn, p.s, t.size, t.half, fmt.zero_key, np)
    if n and (keys.min() < 0 or keys.max() >= fmt.n_patterns):
        raise CorruptStreamError("corrupt codec stream: decoded value outside the dtype")
    return keys, raw


# ---------------------------------------------------------------------------------------------------------
# Running window jobs

_JOB: tuple | None = None  # (groups, run) inherited by forked children


def split_balanced(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Contiguous groups of job indices with roughly equal total size."""
    parts = max(1, min(parts, len(sizes)))
    total = sum(sizes) or 1
    groups: list[list[int]] = [[] for _ in range(parts)]
    acc = 0
    for i, s in enumerate(sizes):
        k = min(parts - 1, acc * parts // total)
        groups[k].append(i)
        acc += s
    return [g for g in groups if g]


def fork_available() -> bool:
    return sys.platform != "win32" and "fork" in mp.get_all_start_methods()


def run_jobs(run: Callable[[int], None], sizes: Sequence[int], threads: int = 1) -> None:
    """Call ``run(i)`` for every job i (jobs write their own disjoint outputs)."""
    groups = split_balanced(sizes, threads)
    if len(groups) <= 1:
        for i in range(len(sizes)):
            run(i)
        return
    with ThreadPoolExecutor(len(groups)) as pool:
        for f in [pool.submit(lambda g=g: [run(i) for i in g]) for g in groups]:
            f.result()


def run_jobs_forked(run: Callable[[np.ndarray, int], None], sizes: Sequence[int], workers: int,
                    out_shape: int, out_dtype: np.dtype) -> np.ndarray:
    """Like `run_jobs` on ``workers`` processes; ``run(out, i)`` writes into a shared output array, which is
    returned (as a private copy)."""
    global _JOB
    groups = split_balanced(sizes, workers)
    nbytes = max(1, out_shape * np.dtype(out_dtype).itemsize)
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        out = np.ndarray((out_shape,), dtype=out_dtype, buffer=shm.buf)
        ctx = mp.get_context("fork")
        _JOB = (groups, run, out)
        procs, pipes = [], []
        for k in range(1, len(groups)):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(k, send), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            pipes.append(recv)
        err: BaseException | None = None
        try:
            for i in groups[0]:
                run(out, i)
        except BaseException as e:  # still reap the children below
            err = e
        messages = []
        for p, r in zip(procs, pipes):
            try:
                messages.append(r.recv() if r.poll(None) else ("died", ""))
            except EOFError:
                messages.append(("died", ""))
            p.join()
        if err is not None:
            raise err
        for kind, msg in messages:
            if kind == "corrupt":
                raise CorruptStreamError(msg)
            if kind != "ok":
                raise RuntimeError(f"codec decode worker failed: {kind} {msg}")
        result = out.copy()
        del out
        return result
    finally:
        _JOB = None
        shm.close()
        shm.unlink()


def _child(k: int, conn) -> None:
    assert _JOB is not None
    groups, run, out = _JOB
    try:
        for i in groups[k]:
            run(out, i)
        conn.send(("ok", ""))
    except CorruptStreamError as e:
        conn.send(("corrupt", str(e)))
    except BaseException as e:
        conn.send((type(e).__name__, str(e)))
    finally:
        conn.close()
        # skip interpreter teardown (atexit handlers, torch) in the forked child
        os._exit(0)
