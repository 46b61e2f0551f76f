"""Run independent decode jobs serially, on threads, or on forked worker processes.

constriction holds the GIL while it codes, so threads only overlap the numpy parts; processes scale but
cost a fork (copy-on-write, no pickling of inputs: jobs and inputs are inherited) and write their output
straight into shared memory. Linux/macOS only for processes (fork); elsewhere they fall back to threads.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import numpy as np

from .errors import CorruptStreamError

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
        import os

        os._exit(0)
