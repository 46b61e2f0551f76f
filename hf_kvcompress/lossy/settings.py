"""`LossyConfig`: lossy mode's settings, beside the methods it names (`registry`), validated at construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from ..validation import JsonConfig, check_bool, check_choice, check_fraction, check_int, check_number, fail
from . import registry


@dataclass(frozen=True)
class LossyConfig(JsonConfig):
    """Lossy mode: old tokens are periodically replaced by a smaller summary.

    Attributes:
        method: a registered lossy method (`hf_kvcompress.lossy.registry`, one file each under ``lossy/methods/``
            with its paper): ``"summary"`` (attention-mass selection, biased least-squares fit, SVD of the rest:
            docs/lossy.md) or a baseline at the same memory: ``"topk"`` (accumulated attention, H2O/SnapKV
            style), ``"streaming"`` (sinks + recent window), ``"svd"`` (plain per-head low rank of K and V).
        budget: memory budget per layer as a fraction of the full cache's bytes, a float in (0, 1] (side data
            included; 1.0 keeps everything). Default 0.3 unless ``budget_tokens`` is given. An int is refused
            (``budget=1`` once meant one token): a count goes in ``budget_tokens``. JSON written before
            ``budget_tokens`` existed with an int ``budget`` is refused with the same message, not converted.
        budget_tokens: memory budget per layer as a count of token-equivalents (bytes of that many full-cache
            tokens), instead of ``budget``; giving both is an error.
        entropy_threshold: attention entropy (nats) above which a cached entry counts as compressible.
        error_tolerance: relative attention-output error that picks the smallest sufficient SVD rank.
        interval: new tokens between two summaries.
        sinks: initial tokens that are always kept exact.
        reference_queries: how many recent queries per layer (per query head) a summary is scored and fitted on
            (those of the forward that triggers it, used in place, plus the kept ones).
        kept_queries: how many queries per layer (per query head) are kept between summaries for the next fit
            (at most ``interval``; int8, counted in the held bytes and reserved in the budget).
        selection: the summary's stage 1: ``"mass"`` (keep the most attended entries) or ``"entropy"`` (the
            criterion of the proposal docs/lossy.md tests: entries above ``entropy_threshold`` are compressible, the lowest-entropy ones are kept).
        fit_bias: fit a per-entry logit bias (Attention Matching) for summary entries; needs a model attached.
        ridge: ridge strength of the value refit, relative to the mean diagonal of its normal matrix (0 = plain
            least squares, solved with ``gelsd``).
        query_horizon: reference queries are moved (RoPE-rotated) to positions spread over this many tokens after
            the summary, where the queries that will read it sit; 0 keeps their own positions.
        entry_format: how the entries a method keeps are stored: ``"model"`` (the cache dtype), ``"int8"`` or
            ``"fp8"`` (8-bit codes with a float16 scale per vector), ``"int4"`` (4-bit codes with a float16 scale and
            offset per vector), ``"mixed"`` (every entry that fits in int4, the most important ones upgraded to
            int8 with what the budget leaves; a method drops entries only when int4 cannot hold them all); sinks and
            the recent window stay exact.
    """

    method: str = "summary"
    budget: float | None = None
    budget_tokens: int | None = None
    entropy_threshold: float = 2.5
    error_tolerance: float = 0.05
    interval: int = 256
    sinks: int = 4
    reference_queries: int = 256
    kept_queries: int = 16
    selection: str = "mass"
    fit_bias: bool = True
    ridge: float = 1e-3
    query_horizon: int = 512
    entry_format: str = "model"

    DEFAULT_BUDGET: ClassVar[float] = 0.3
    #: the registered lossy methods by name (`hf_kvcompress.lossy.registry`)
    METHODS: ClassVar[Mapping[str, registry.LossyMethod]] = registry.METHODS
    SELECTIONS: ClassVar[tuple[str, ...]] = ("mass", "entropy")
    ENTRY_FORMATS: ClassVar[tuple[str, ...]] = registry.ENTRY_FORMATS

    def __post_init__(self) -> None:
        owner = "LossyConfig"
        check_choice(f"{owner}.method", self.method, tuple(self.METHODS))
        # whether the budget was given (not defaulted): CompressionConfig(budget=...) may fill a defaulted one only
        object.__setattr__(self, "_budget_given", self.budget is not None or self.budget_tokens is not None)
        if self.budget_tokens is not None:
            check_int(f"{owner}.budget_tokens", self.budget_tokens, minimum=1)
            if self.budget is not None:
                fail(f"{owner}.budget", f"and budget_tokens are alternatives; got budget={self.budget!r} and "
                                       f"budget_tokens={self.budget_tokens!r}")
        else:
            if self.budget is None:
                object.__setattr__(self, "budget", self.DEFAULT_BUDGET)
            check_fraction(f"{owner}.budget", self.budget, count_hint="budget_tokens={}")
        check_number(f"{owner}.entropy_threshold", self.entropy_threshold, low=0.0, high=100.0)
        check_number(f"{owner}.error_tolerance", self.error_tolerance, low=0.0, high=1.0, low_open=True)
        check_int(f"{owner}.interval", self.interval, minimum=1)
        check_int(f"{owner}.sinks", self.sinks, minimum=0)
        check_int(f"{owner}.reference_queries", self.reference_queries, minimum=1)
        check_int(f"{owner}.kept_queries", self.kept_queries, minimum=0)
        check_choice(f"{owner}.selection", self.selection, self.SELECTIONS)
        check_bool(f"{owner}.fit_bias", self.fit_bias)
        check_number(f"{owner}.ridge", self.ridge, low=0.0, high=1e6)
        check_int(f"{owner}.query_horizon", self.query_horizon, minimum=0)
        check_choice(f"{owner}.entry_format", self.entry_format, self.ENTRY_FORMATS)
