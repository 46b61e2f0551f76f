"""How many threads the library runs: torch's intra-op threads and the codec's workers, chosen within the cores
this process may run on (its CPU affinity), with one override, ``HF_KVCOMPRESS_THREADS=N`` or
`configure_threads` (N cores to plan for).

Why a plan at all: a lossless decode step alternates torch's work with the codec's, and torch's OpenMP threads
spin on the other cores between operations, so torch on every core beside codec workers on every core
oversubscribes them: the first demo on 2 shared cores took 2.1-2.2 s a token with torch's default threads
against 0.23 s with one torch thread (issue 38), and on an idle 2-vCPU machine one torch thread with two codec
workers made a 2,048-token decode step 4.16x DynamicCache's against 8.89x with two torch threads
(docs/results/lossless.md, "Codec threads"). The plan gives torch half the cores (at least one) and the codec
all of them (it runs between torch's operations, and its decode-ahead beside torch's one thread). Only the
2-core case is measured; more cores follow the same rule untested.

Where it applies: the command line (`hf-kvcompress demo`, `calibrate`, `eval`, `bench`) sets torch's threads from
the plan at start; a `CompressedCache` takes the plan's codec workers (``LosslessConfig.workers=None``). The
library never changes torch's threads on its own: ``torch.set_num_threads`` is process-wide, and a cache that
changed it would slow the rest of a user's program (a `DynamicCache` baseline included) behind their back, which
no transformers cache does; library users call `configure_threads()` once (the README's quick start does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .validation import check_int

# torch is imported where threads are set, not here: the command line's --help and `hf-kvcompress bench NAME --help`
# import this module (and its `MAX_WORKERS`) and must not wait seconds for torch

#: the environment variable that overrides the cores the plan uses (an int in [1, MAX_WORKERS])
ENV = "HF_KVCOMPRESS_THREADS"
#: the most cores a plan takes and the most codec workers a `LosslessConfig` asks for. Every worker is an OS thread
#: (``coder="lanes"``) or a forked process (``"ans"``) started for each block batch, and past the cores they only
#: oversubscribe them; a count such as 2**40 was accepted and then failed in generate() starting its threads. 256 is
#: above the core count of any single machine this runs on today and far below the OS's thread limits.
MAX_WORKERS = 256

#: cores given to `configure_threads` (None: not called, or called without a count)
_configured: int | None = None


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadPlan:
    """The threads chosen for ``cores`` cores: ``torch`` intra-op threads, ``codec`` workers per block batch;
    ``source`` says where the core count came from."""

    cores: int
    torch: int
    codec: int
    source: str

    def __str__(self) -> str:
        return f"{self.torch} torch thread(s), {self.codec} codec worker(s) ({self.cores} cores: {self.source})"


def _check_cores(cores: object, owner: str) -> int:
    check_int(f"{owner}: cores", cores, minimum=1, maximum=MAX_WORKERS)
    return cores


def _env_cores() -> int | None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        cores = int(text)
    except ValueError:
        cores = 0
    if not 1 <= cores <= MAX_WORKERS:
        raise ValueError(f"{ENV}={text!r}: expected a number of cores >= 1 and <= {MAX_WORKERS} (threads.MAX_WORKERS; "
                         "unset it to use the CPU affinity)")
    return cores


def thread_plan(cores: int | None = None) -> ThreadPlan:
    """The threads for ``cores`` cores; None: those given to `configure_threads`, else ``$HF_KVCOMPRESS_THREADS``,
    else the process's CPU affinity (`available_cores`)."""
    if cores is not None:
        count, source = _check_cores(cores, "thread_plan"), "given"
    elif _configured is not None:
        count, source = _configured, "configure_threads"
    elif (from_env := _env_cores()) is not None:
        count, source = from_env, ENV
    else:
        count, source = min(available_cores(), MAX_WORKERS), "CPU affinity"
    return ThreadPlan(cores=count, torch=max(1, count // 2), codec=count, source=source)


def configure_threads(cores: int | None = None) -> ThreadPlan:
    """Apply the plan for ``cores`` cores (None: ``$HF_KVCOMPRESS_THREADS``, else the CPU affinity): set torch's
    intra-op threads, and make it the codec workers of every `CompressedCache` built from now on whose
    ``LosslessConfig.workers`` is None. A count given here stays the override for the process. Returns the plan."""
    import torch

    global _configured
    if cores is not None:
        _configured = _check_cores(cores, "configure_threads")
    plan = thread_plan()
    torch.set_num_threads(plan.torch)
    return plan


class torch_threads:
    """Set torch's intra-op threads for a ``with`` block, restoring the count before it on exit; ``count`` 0
    takes the plan's (`thread_plan`)."""

    def __init__(self, count: int):
        check_int("torch_threads: count (0: the thread plan's)", count, minimum=0)
        import torch

        self.count = count or thread_plan().torch
        self.before = torch.get_num_threads()

    def __enter__(self) -> torch_threads:
        import torch

        torch.set_num_threads(self.count)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.before)
