"""`LossyConfig`: lossy mode's settings, beside the methods it names (`registry`), validated at construction.

It holds what every method shares; a method's own settings are its `registry.MethodSettings` dataclass
(``LossyConfig.settings``, in ``lossy/methods/<method>.py`` with its paper), as a kvpress press holds its own.
The summary's five settings were fields of `LossyConfig` before each method owned its own: they are still accepted
as keyword arguments and dict keys and read as attributes (`LEGACY_FIELDS`), and `to_dict` writes the keys in the
order it did, so configs and files written before load and a default config's JSON keeps its bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from typing import Any, ClassVar

from ..jsonconfig import JsonConfig
from ..validation import check_choice, check_fraction, check_int, check_keys, checked, fail, validate
from . import registry

#: the method whose settings were `LossyConfig` fields before each method owned its own, and those fields
LEGACY_METHOD = "summary"
LEGACY_FIELDS = ("entropy_threshold", "error_tolerance", "selection", "fit_bias", "ridge")
#: `to_dict`'s key order: that of configs written before (a lossless file's header holds the default lossy config,
#: so its bytes stay the same); a method's own keys that are not among these follow, in their field order
KEY_ORDER = ("method", "budget", "budget_tokens", "entropy_threshold", "error_tolerance", "interval", "sinks",
             "reference_queries", "kept_queries", "selection", "fit_bias", "ridge", "query_horizon", "entry_format")


@dataclass(frozen=True)
class LossyConfig(JsonConfig):
    """Lossy mode: old tokens are periodically replaced by a smaller summary.

    Attributes:
        method: a registered lossy method (`hf_kvcompress.lossy.registry`, one file each under ``lossy/methods/``
            with its settings and paper): ``"summary"`` (attention-mass selection, biased least-squares fit, SVD of
            the rest: docs/lossy.md) or a baseline at the same memory: ``"topk"`` (accumulated attention, H2O/SnapKV
            style), ``"streaming"`` (sinks + recent window), ``"svd"`` (plain per-head low rank of K and V), and
            ``"snapkv"``, ``"tova"``, ``"expected_attention"``, ``"pyramidkv"``, ``"adakv"``, ``"kvzip"``.
        budget: memory budget per layer as a fraction of the full cache's bytes, a float in (0, 1] (side data
            included; 1.0 keeps everything). Default 0.3 unless ``budget_tokens`` is given. An int is refused
            (``budget=1`` once meant one token): a count goes in ``budget_tokens``. JSON written before
            ``budget_tokens`` existed with an int ``budget`` is refused with the same message, not converted.
        budget_tokens: memory budget per layer as a count of token-equivalents (bytes of that many full-cache
            tokens), instead of ``budget``; giving both is an error.
        interval: new tokens between two summaries.
        sinks: initial tokens that are always kept exact. A sequence no longer than ``sinks + residual_tokens``
            (the sinks and the recent window a summary keeps exact anyway: 132 tokens at the defaults) is never
            summarised: it is held as it is, as in a full cache, whatever the budget.
        reference_queries: how many recent queries per layer (per query head) a summary is scored and fitted on
            (those of the forward that triggers it, used in place, plus the kept ones).
        kept_queries: how many queries per layer (per query head) are kept between summaries for the next fit
            (at most ``interval``; int8, counted in the held bytes and reserved in the budget).
        query_horizon: reference queries are moved (RoPE-rotated) to positions spread over this many tokens after
            the summary, where the queries that will read it sit; 0 keeps their own positions.
        entry_format: how the entries a method keeps are stored: ``"model"`` (the cache dtype), ``"int8"`` or
            ``"fp8"`` (8-bit codes with a float16 scale per vector), ``"int4"`` (4-bit codes with a float16 scale and
            offset per vector), ``"mixed"`` (every entry that fits in int4, the most important ones upgraded to
            int8 with what the budget leaves; a method drops entries only when int4 cannot hold them all); sinks and
            the recent window stay exact.
        settings: the method's own settings (``METHODS[method].settings``, e.g. `methods.summary.SummarySettings`,
            `methods.snapkv.SnapKVSettings`); None (the default): the method's defaults.
        entropy_threshold, error_tolerance, selection, fit_bias, ridge: the summary's settings
            (`methods.summary.SummarySettings`), accepted here as before (and for a method whose settings extend
            the summary's); with another method they are checked and not kept (that method never read them).
    """

    method: str = checked("summary", check_choice, choices=registry.METHODS)
    budget: float | None = None
    budget_tokens: int | None = None
    interval: int = checked(256, check_int, minimum=1)
    sinks: int = checked(4, check_int, minimum=0)
    reference_queries: int = checked(256, check_int, minimum=1)
    kept_queries: int = checked(16, check_int, minimum=0)
    query_horizon: int = checked(512, check_int, minimum=0)
    entry_format: str = checked("model", check_choice, choices=registry.ENTRY_FORMATS)
    settings: registry.MethodSettings | None = None
    entropy_threshold: InitVar[float | None] = None
    error_tolerance: InitVar[float | None] = None
    selection: InitVar[str | None] = None
    fit_bias: InitVar[bool | None] = None
    ridge: InitVar[float | None] = None

    DEFAULT_BUDGET: ClassVar[float] = 0.3
    #: the registered lossy methods by name (`hf_kvcompress.lossy.registry`)
    METHODS: ClassVar[Mapping[str, registry.LossyMethod]] = registry.METHODS
    ENTRY_FORMATS: ClassVar[tuple[str, ...]] = registry.ENTRY_FORMATS
    # `to_dict` writes the method's settings flat beside the shared fields, in the order configs were written before
    _flat: ClassVar[tuple[str, ...]] = ("settings",)
    _key_order: ClassVar[tuple[str, ...]] = KEY_ORDER

    def __post_init__(self, *legacy: Any) -> None:
        owner = "LossyConfig"
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
        validate(self, owner)
        given = {name: value for name, value in zip(LEGACY_FIELDS, legacy) if value is not None}
        object.__setattr__(self, "settings", _method_settings(self.method, self.settings, given))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LossyConfig:
        """The inverse of `to_dict`: the shared fields, the method's own settings and the `LEGACY_FIELDS`, flat."""
        method = data.get("method", "summary") if isinstance(data, dict) else None
        own = cls.METHODS[method].settings if method in cls.METHODS else registry.MethodSettings
        own_names = {f.name for f in dataclasses.fields(own)}
        shared = {f.name for f in dataclasses.fields(cls)} - {"settings"}
        check_keys(cls.__name__, data, shared | own_names | set(LEGACY_FIELDS))
        kwargs = {name: value for name, value in data.items() if name in shared or name in LEGACY_FIELDS}
        mine = {name: value for name, value in data.items() if name in own_names and name not in LEGACY_FIELDS}
        if mine:
            kwargs["settings"] = own(**mine)
        return cls(**kwargs)


def _legacy_property(name: str) -> property:
    def get(config: LossyConfig) -> Any:
        settings = config.settings
        if config.method != LEGACY_METHOD:  # never read by this method: the summary's default
            settings = LossyConfig.METHODS[LEGACY_METHOD].settings()
        return getattr(settings, name)

    return property(get, doc=f"The summary's ``{name}`` (``settings.{name}``; kept for configs written before).")


# the legacy names are init-only arguments (InitVar), read afterwards from the summary's settings: set after the
# class is built, since a property in the class body would be taken for the field's default
for _name in LEGACY_FIELDS:
    setattr(LossyConfig, _name, _legacy_property(_name))


def _method_settings(method: str, settings: Any, legacy: dict[str, Any]) -> registry.MethodSettings:
    """The settings a config of ``method`` holds: ``settings`` (None: the method's defaults; another method's at
    their defaults, as ``dataclasses.replace(config, method=...)`` carries them, too), with the summary's
    ``legacy`` keyword arguments applied (with another method: checked, then dropped)."""
    owner = "LossyConfig"
    cls = LossyConfig.METHODS[method].settings
    if settings is None or (isinstance(settings, registry.MethodSettings) and not isinstance(settings, cls)
                            and settings == type(settings)()):
        settings = cls()
    if not isinstance(settings, cls):
        fail(f"{owner}.settings", f"must be a {cls.__name__} (method {method!r}'s settings) or None, got {settings!r}")
    if legacy:
        legacy_cls = LossyConfig.METHODS[LEGACY_METHOD].settings
        try:
            # a method whose settings extend the summary's (`methods.summary_replay`) takes them as its own
            own = issubclass(cls, legacy_cls)
            built = dataclasses.replace(settings, **legacy) if own else legacy_cls(**legacy)
        except ValueError as err:  # ConfigTypeError too: name the fields as the keyword arguments were given
            raise type(err)(str(err).replace(f"{cls.__name__}.", f"{owner}.").replace(
                f"{legacy_cls.__name__}.", f"{owner}.")) from err
        if own:
            settings = built
    return settings
