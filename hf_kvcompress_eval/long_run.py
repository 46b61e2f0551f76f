"""What one run of the long-context suite measures (`LongRun`), apart from its engine (`long_suite`): the command
line reads its defaults for ``hf-kvcompress eval --help``, which must not import torch (the lossy methods' registry
loads when a run is built)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_kvcompress.validation import check_int, check_number

from .long_context import TASKS

#: the method name of the full cache
FULL = "none"


def all_methods() -> tuple[str, ...]:
    """The full cache and every registered lossy method (the registry imports torch: loaded here, on first use)."""
    from hf_kvcompress.lossy.methods import METHODS

    return (FULL, *METHODS)


@dataclass
class LongRun:
    """What one run measures. ``samples[i]`` samples per task at ``lengths[i]``; methods are registered lossy
    method names plus ``"none"`` (the full cache); ``nll_samples`` text windows of ``nll_lengths[i]`` context
    tokens and ``continuation`` scored tokens each."""

    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (2048, 4096)
    samples: tuple[int, ...] = (50, 25)
    methods: tuple[str, ...] = field(default_factory=lambda: all_methods())
    budgets: tuple[float, ...] = (0.5, 0.25, 0.125)
    nll_lengths: tuple[int, ...] = (2048, 4096, 8192)
    nll_samples: int = 8
    continuation: int = 64
    #: rows per batch (samples of one task and length with equally long questions)
    batch: int = 16
    #: the lossy caches' exact recent window (``residual_tokens``), sinks and summary interval
    window: int = 32
    sinks: int = 4
    interval: int = 64
    own_prefill: tuple[str, ...] = ()
    #: methods whose shared prefill is checked against a real one at the start (`Engine.verify_prefill`)
    verify_prefill: tuple[str, ...] = ("summary",)
    #: the lossy methods run only on tasks the full cache scores at least this on (issue 36: ~30 %); 0 runs all
    min_full_score: float = 0.3
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"long suite: task must be among {list(TASKS)}, got {task!r}")
        known = all_methods()
        for method in (*self.methods, *self.own_prefill, *self.verify_prefill):
            if method not in known:
                raise ValueError(f"long suite: method must be among {list(known)}, got {method!r}")
        if len(self.samples) not in (1, len(self.lengths)):
            raise ValueError(f"long suite: give one sample count, or one per length ({len(self.lengths)}), "
                             f"got {list(self.samples)}")
        for length in (*self.lengths, *self.nll_lengths):
            check_int("long suite: lengths", length, minimum=64)
        for count in self.samples:
            check_int("long suite: samples", count, minimum=0)
        for budget in self.budgets:
            check_number("long suite: budgets", budget, low=0.0, high=1.0, low_open=True)
        for name in ("nll_samples", "batch", "continuation", "window", "sinks", "interval"):
            check_int(f"long suite: {name}", getattr(self, name), minimum=0 if name in ("nll_samples", "sinks") else 1)
        if self.continuation < 2:
            raise ValueError(f"long suite: continuation must be >= 2 tokens, got {self.continuation}")
        check_number("long suite: min_full_score", self.min_full_score, low=0.0, high=1.0)
        if self.max_seconds is not None:
            check_number("long suite: max_seconds", self.max_seconds, low=0.0, high=math.inf, low_open=True)

    def count(self, length: int) -> int:
        return self.samples[0] if len(self.samples) == 1 else self.samples[self.lengths.index(length)]

    def configs(self) -> list[tuple[str, float | None]]:
        """(method, budget) pairs: the full cache once, every lossy method at every budget."""
        return [(m, None) if m == FULL else (m, b) for m in self.methods for b in ((None,) if m == FULL else self.budgets)]
