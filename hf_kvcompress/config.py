"""`CompressionConfig`: one validated, JSON-serialisable dataclass that selects everything."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar

from .codec import CodecConfig
from .jsonconfig import JsonConfig
from .lossy import methods as _lossy_methods  # noqa: F401 (the registry line: LossyConfig checks names against it)
from .lossy.settings import LossyConfig
from .predictors import registry as predictor_registry
from .predictors.base import PredictorSettings
from .predictors.probe import ProbeSettings
from .threads import MAX_WORKERS
from .validation import (
    check_choice,
    check_fraction,
    check_int,
    check_number,
    checked,
    checked_as,
    fail,
    validate,
)

MODES = ("none", "lossless", "lossy")


def _codec_config(values: tuple) -> CodecConfig:
    """The validated `CodecConfig` of `LosslessConfig.CODEC_FIELDS`' values, built once per distinct settings (a
    load parses its file's config more than once; CodecConfig is frozen, so they share it)."""
    try:
        hash(values)
    except TypeError:  # a value of the wrong type: CodecConfig names it
        return _new_codec_config(values)
    return _shared_codec_config((*values, *map(type, values)))  # typed: True and 1.0 are not the int 1


def _new_codec_config(values: tuple) -> CodecConfig:
    return CodecConfig(**dict(zip(LosslessConfig.CODEC_FIELDS, values)))  # zip stops at the fields' values


_shared_codec_config = functools.lru_cache(maxsize=64)(_new_codec_config)


@dataclass(frozen=True)
class LosslessConfig(JsonConfig):
    """Lossless mode: sealed blocks are stored as entropy-coded streams that decode bit-exactly.

    Attributes:
        predictor: where each element's predicted mean comes from inside ``generate()``: ``"generic"``
            (per-block channel statistics as side data; needs nothing, the fastest: the default, see
            docs/lossless.md "Inside generate()"), ``"framed"`` (generic with key statistics in an
            estimated pre-RoPE frame), ``"self"`` (generic plus key maps from the layer below that the cache fits
            on its own sealed blocks: no model, no calibration), ``"context"`` (the layers below and earlier heads
            through a calibration's linear maps: ~2 bits/scalar smaller, 3-5x slower steps) or ``"none"`` (a
            calibration's per-channel statistics). ``"probe"`` / ``"twin"`` are refused here: they rerun the model
            to decode every block, so they are for storage only (``save_predictor`` or
            ``cache.save(path, predictor=...)``).
        save_predictor: the predictor `CompressedCache.save` codes files with unless told otherwise. ``"auto"``
            (the default): calibrated storage, `predictors.registry.CALIBRATED_STORAGE`, where the cache's
            calibration (given, or the model's saved one: found, never fitted by a save) has the heads it reads
            and every layer holds every token; else ``"generic"`` (the blocks generation codes: `load` adopts
            them without decoding). ``"generic"`` turns calibrated storage off; any of `PREDICTORS` names one,
            ``"probe"`` / ``"twin"`` included (docs/lossless.md "Save / load").
        probe_layer: k, the layer whose hidden state the probe heads read (``probe`` only): sets
            `predictors.probe.ProbeSettings`, which declares its default and check.
        window, fixed_window, header, mean_steps, coder: the `CodecConfig` fields of the same names (the
            codec's documentation says what each does), validated by `CodecConfig` itself (`codec_config`): one
            source for their choices and bounds. ``coder`` None (the default) becomes the predictor's own coder
            (`Predictor.coder`): ``"huff"`` for ``"generic"`` (sign and exponent Huffman-coded per stream,
            mantissa raw, decoded ~10x faster than ``"lanes"`` for ~0.28 bit/scalar more: a decode step decodes
            every block, so it takes the speed, docs/results/codec.md 13), the rate's coder for the predictors
            chosen for their rate (docs/codec.md "The coders" says which codes what). Saves that code the tokens
            again use the predictor's `Predictor.storage_coder` whatever this says; files saved
            with ``"lanes"`` or ``"ans"`` still load (docs/results/codec.md 12.3). The other four differ from
            `CodecConfig`'s on purpose: the codec's are those of the ``ans`` format's first streams (which record only the
            fields that differ from them, so they keep their bytes), these the settings measured best inside
            the cache, where blocks are small and the cache keeps the config: ``window="fixed"`` (measured
            best on SmolLM2, docs/results/codec.md 10); ``fixed_window=65536``, the codec's largest window
            (one window per 64 x 256-token stream, the fastest and smallest setting measured; ``lanes`` codes
            a stream as one window whatever it is); ``header="compact"`` (~40 bytes where the self-describing
            ``"full"`` takes ~450; ``lanes`` has its own ~24-byte header); ``mean_steps=4`` (0.002
            bit/scalar more than 8, coded ~20 % faster).
        workers: how many threads or processes code a block's streams; None (the default) takes the thread
            plan's codec workers (`hf_kvcompress.threads`: every core the process may run on, its CPU affinity,
            or ``HF_KVCOMPRESS_THREADS`` / `configure_threads`), an int from 1 to `threads.MAX_WORKERS` (256: each
            worker is a thread or process, past the cores they only oversubscribe them) fixes the count. With ``coder="lanes"``:
            threads, over the block's streams, when encoding and decoding (``codec.encode_batch`` /
            ``decode_batch``'s ``threads``); the calling thread runs one share. With ``coder="ans"``: forked
            processes over the windows of one stream, when decoding only (``codec.decode``'s ``workers``),
            which run only when a stream holds more than one window: ``fixed_window`` below a block's
            ``block_tokens * head_dim`` elements (never at the default 65536 with 128-token blocks). The
            bytes are the same whatever the count. On this project's 2-vCPU machine a second codec thread
            made a decode step 1.2-1.5x faster beside torch on one thread, and neither faster nor slower
            beside torch on two (torch's OpenMP threads spin on the second core between operations); it
            loses where other processes keep the cores busy: pass ``workers=1`` there (docs/results/lossless.md,
            "Codec threads"). On a CUDA model with Triton, ``generic`` and ``framed`` blocks of ``coder="lanes"``,
            ``"huff"`` or ``"mhuff"`` decode on the GPU and this only affects encoding (docs/lossless.md, "On a
            GPU").
        decoded_budget: bytes of decoded blocks the cache may keep between steps, as a fraction of the
            sealed blocks' raw (uncompressed) size: 0 decodes every block at every step, 1 keeps them all
            decoded (faster steps, no memory saved). The most recent blocks are kept (see
            ``hf_kvcompress/cache/pool.py``; ``hf-kvcompress bench generate`` measures the trade).
    """

    predictor: str = checked("generic", check_choice, choices=predictor_registry.NAMES)
    save_predictor: str = checked(predictor_registry.AUTO, check_choice,
                                  choices=(predictor_registry.AUTO, *predictor_registry.NAMES))
    probe_layer: int = checked_as(ProbeSettings, "probe_layer")
    window: str = "fixed"
    fixed_window: int = 65536
    header: str = "compact"
    mean_steps: int = 4
    workers: int | None = checked(None, check_int, optional=True, minimum=1, maximum=MAX_WORKERS)
    decoded_budget: float = checked(0.05, check_number, low=0.0, high=1.0)
    coder: str | None = None

    #: every predictor name, and those that rerun the model to decode a block (fine for a saved file,
    #: impractical at every step): both from the predictor registry
    PREDICTORS: ClassVar[tuple[str, ...]] = predictor_registry.NAMES
    STORAGE_ONLY: ClassVar[tuple[str, ...]] = predictor_registry.STORAGE_ONLY
    #: the fields that are `CodecConfig`'s (same names, same meaning, validated there)
    CODEC_FIELDS: ClassVar[tuple[str, ...]] = ("window", "fixed_window", "header", "mean_steps", "coder")

    def __post_init__(self) -> None:
        owner = "LosslessConfig"
        validate(self, owner)  # the declared checks (`checked`); the codec's fields are `CodecConfig`'s (below)
        # remembered (not serialised: `to_dict` writes the coder chosen, so files keep their bytes): `coder_auto`
        object.__setattr__(self, "_coder_auto", self.coder is None)
        if self.coder is None:  # the predictor's own choice (`Predictor.coder`)
            object.__setattr__(self, "coder", predictor_registry.predictor_class(self.predictor).coder)
        if self.predictor in self.STORAGE_ONLY:
            fail(f"{owner}.predictor", f"cannot be {self.predictor!r}: it reruns the model to decode every block, "
                                      "which is impractical at every step of generate() (storage only); generate "
                                      "with 'generic' or 'context' and store with "
                                      f"LosslessConfig(save_predictor={self.predictor!r}) or "
                                      f"cache.save(path, predictor={self.predictor!r})")
        try:  # built and validated once: every reader of these settings shares it (CodecConfig is frozen)
            object.__setattr__(self, "_codec", _codec_config(tuple(getattr(self, name) for name in self.CODEC_FIELDS)))
        except ValueError as err:  # ConfigTypeError too; the fields have CodecConfig's names: name them as ours
            message = str(err).replace("CodecConfig.", f"{owner}.").replace("CodecConfig(", f"{owner}(")
            raise type(err)(message) from err

    @property
    def coder_auto(self) -> bool:
        """Whether ``coder`` was chosen automatically (constructed with ``coder=None``: the predictor's own coder;
        every one of them has a Triton decoder, so its blocks decode on a CUDA model's device) rather than named
        by the caller. Not serialised: a config read back from `to_dict` names its coder."""
        return self._coder_auto

    def predictor_settings(self) -> PredictorSettings:
        """The settings of ``predictor`` (`Predictor.settings`), from the fields of the same names here."""
        return predictor_registry.settings_for(self.predictor, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def codec_config(self) -> CodecConfig:
        """The `CodecConfig` of these settings (the codec's defaults for every field not set here)."""
        return self._codec


@dataclass(frozen=True)
class CompressionConfig(JsonConfig):
    """Selects how a `CompressedCache` holds its tokens.

    Attributes:
        mode: ``"none"`` (plain tensors, the reference), ``"lossless"`` or ``"lossy"``.
        block_tokens: tokens per sealed block; sealing happens once the residual holds
            ``residual_tokens + block_tokens`` tokens. Default (None): 128 in lossless mode, 256 otherwise.
        residual_tokens: most recent tokens that always stay as plain tensors. Default (None): 0 in lossless
            mode, 128 otherwise. Lossless blocks decode exactly, so nothing needs to stay raw: 128 / 0 holds
            0.70x of DynamicCache's bytes at 2,048 tokens where 256 / 128 held 0.73x, and seals a 128-token
            prompt at prefill (docs/lossless.md, "Inside generate()").
        lossless: parameters of lossless mode.
        lossy: parameters of lossy mode.
        budget: shortcut for ``lossy.budget`` (lossy mode only): ``CompressionConfig(mode="lossy", budget=0.3)``.
            Not stored twice: afterwards ``config.budget`` reads ``lossy.budget`` (None in other modes), and
            `to_dict` writes it inside ``lossy`` only. A ``lossy`` given with its own different budget (or
            ``budget_tokens``) is an error, not silently overridden. ``dataclasses.replace`` carries the budget
            in force over: pass ``budget=None`` with it when changing ``mode`` or ``lossy``'s budget.
    """

    mode: str = checked("lossless", check_choice, choices=MODES)
    block_tokens: int | None = checked(None, check_int, minimum=1)
    residual_tokens: int | None = checked(None, check_int, minimum=0)
    lossless: LosslessConfig = field(default_factory=LosslessConfig)
    lossy: LossyConfig = field(default_factory=LossyConfig)
    budget: InitVar[float | None] = None

    _nested: ClassVar[dict[str, type]] = {"lossless": LosslessConfig, "lossy": LossyConfig}
    _shortcuts: ClassVar[tuple[str, ...]] = ("budget",)

    def __post_init__(self, budget: float | None) -> None:
        owner = "CompressionConfig"
        lossless = self.mode == "lossless"  # a bad mode is refused by `validate`, its first check
        if self.block_tokens is None:
            object.__setattr__(self, "block_tokens", 128 if lossless else 256)
        if self.residual_tokens is None:
            object.__setattr__(self, "residual_tokens", 0 if lossless else 128)
        validate(self, owner)
        for name, sub in self._nested.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, sub.from_dict(value))
            elif not isinstance(value, sub):
                fail(f"{owner}.{name}", f"must be a {sub.__name__} or a dict, got {type(value).__name__}")
        if budget is not None:
            self._apply_budget(budget)

    def _apply_budget(self, budget: Any) -> None:
        owner = "CompressionConfig"
        if self.mode != "lossy":
            fail(f"{owner}.budget", f"applies to mode='lossy' only (the fraction of the cache a summary keeps), got "
                                   f"budget={budget!r} with mode={self.mode!r}")
        check_fraction(f"{owner}.budget", budget, count_hint="lossy=LossyConfig(budget_tokens={})")
        lossy = self.lossy
        if getattr(lossy, "_budget_given", False) and lossy.budget != budget:
            given = (f"budget_tokens={lossy.budget_tokens}" if lossy.budget_tokens is not None
                     else f"budget={lossy.budget}")
            fail(f"{owner}.budget", f"({budget!r}) conflicts with lossy.{given}; give the budget once")
        filled = dataclasses.replace(lossy, budget=float(budget), budget_tokens=None)
        object.__setattr__(filled, "_budget_given", False)  # filled from here: a later replace() may refill it
        object.__setattr__(self, "lossy", filled)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> CompressionConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"CompressionConfig.from_json: not valid JSON ({err})") from err
        return cls.from_dict(data)


def _budget_in_force(self: CompressionConfig) -> float | None:
    """The lossy budget fraction in force (``lossy.budget``); None outside lossy mode or with ``budget_tokens``."""
    return self.lossy.budget if self.mode == "lossy" else None


# `budget` is an init-only shortcut (InitVar): reading it afterwards gives the budget in force, so it is not stored
# twice. Set after the class is built, since a property in the class body would be taken for the field's default.
CompressionConfig.budget = property(_budget_in_force)  # type: ignore[assignment,method-assign]
