"""Evaluation suites: small TOML files that say what to measure, on which model and text, and how much of it.

The built-in suites (``quick``, ``full``) live next to this module in ``suites/``; any other suite is a path to
a TOML file with the same tables. Every key is optional: what a suite leaves out takes the defaults below
(the ``quick`` settings). Unknown keys and wrong types are errors, reported with the key's dotted path.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from hf_kvcompress.config import LossyConfig
from hf_kvcompress.predictors.registry import FITTED
from hf_kvcompress.validation import check_bool, check_choice, check_int, check_number, fail

BUILTIN_SUITES = ("quick", "full")
PREDICTOR_RE = re.compile(r"^(generic|none|context|twin|probe:(\d+))$")
BASELINES = ("zstd-3", "zstd-19", "zipnn", "exponent-bound")
WINDOW_RE = re.compile(r"^(metadata|predicted|causal|fixed-(\d+))$")
QUANTIZED_RE = re.compile(r"^(fp8|hqq-(1|2|3|4|8)|quanto-(2|4))$")
GENERATION_CACHES = ("dynamic", "none", "lossless")
DTYPES = ("bfloat16", "float16", "float32")


class SuiteError(ValueError):
    """A suite cannot be found, read or validated."""


@dataclass
class ModelSection:
    #: "" = the embedded SmolLM2-135M-Instruct; else a hub id or a local folder
    name: str = ""
    dtype: str = "bfloat16"


@dataclass
class DataSection:
    #: "" = Shakespeare (embedded); else a hub dataset ("name" or "name:config") or local text/JSON files
    source: str = ""
    #: evaluation text (hub datasets: the dataset's own split name, e.g. "test")
    split: str = "evaluation"
    #: calibration text, disjoint from the evaluation text (hub datasets: e.g. "train")
    calibration_split: str = "calibration"


@dataclass
class CalibrationSection:
    #: "auto": the model's default calibration (`hf-kvcompress calibrate`) if it exists and has the predictors,
    #: else fit one into the results folder; "fit": always fit one; anything else: a calibration folder
    use: str = "auto"
    tokens: int = 2048
    chunk: int = 512
    predictors: list[str] = field(default_factory=lambda: ["none", "context"])
    probe_layers: list[int] = field(default_factory=list)


@dataclass
class LosslessSection:
    enabled: bool = True
    #: held-out tokens whose prefilled K/V are coded by every predictor and baseline
    tokens: int = 1024
    block_tokens: int = 256
    #: "generic" (no calibration: per-block channel statistics), "none", "context", "probe:K", "twin"
    predictors: list[str] = field(default_factory=lambda: ["generic", "none", "context"])
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))
    #: window schedulers whose choices are histogrammed: "metadata", "predicted", "causal", "fixed-N"
    windows: list[str] = field(default_factory=lambda: ["fixed-4096", "metadata", "predicted"])
    #: tokens (the first of the coded ones) given to the window schedulers
    window_tokens: int = 512


@dataclass
class GenerationSection:
    enabled: bool = True
    prompt_tokens: int = 128
    new_tokens: int = 16
    block_tokens: int = 64
    residual_tokens: int = 32
    caches: list[str] = field(default_factory=lambda: list(GENERATION_CACHES))


@dataclass
class LossySection:
    enabled: bool = True
    #: tokens compressed before the continuation is scored
    context: int = 512
    #: tokens whose perplexity is measured through the compressed cache
    continuation: int = 128
    segments: int = 1
    interval: int = 64
    #: recent tokens kept exact (the cache's residual window; also QuantizedCache's residual_length)
    window: int = 32
    sinks: int = 4
    #: every n-th continuation query is a held-out query for the attention-output error
    heldout_stride: int = 4
    budgets: list[float] = field(default_factory=lambda: [0.25, 0.5])
    #: method names of LossyConfig, or inline tables {name = "...", method = "...", <LossyConfig fields>}
    methods: list[Any] = field(default_factory=lambda: ["summary", "topk", "streaming", "svd"])
    needles: int = 10
    needle_context: int = 256
    needle_batch: int = 10
    #: transformers QuantizedCache backends: "fp8", "hqq-N" (N bits), "quanto-N"; missing packages are reported
    quantized: list[str] = field(default_factory=lambda: ["fp8", "hqq-4", "hqq-2", "quanto-4", "quanto-2"])
    q_group_size: int = 64


@dataclass
class Suite:
    name: str = "custom"
    description: str = ""
    #: torch threads (0 = the library's thread plan, `hf_kvcompress.threads`). One thread gives stable timings on a
    #: shared machine.
    threads: int = 1
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    lossless: LosslessSection = field(default_factory=LosslessSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    lossy: LossySection = field(default_factory=LossySection)
    #: where the suite came from (a built-in name or a file path) and its text, for the results JSON
    origin: str = ""
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("text")
        return data

    # ------------------------------------------------------------------ derived

    def lossy_methods(self) -> list[tuple[str, dict[str, Any]]]:
        """(label, LossyConfig fields) of every lossy method."""
        out = []
        for entry in self.lossy.methods:
            if isinstance(entry, str):
                out.append((entry, {"method": entry}))
            else:
                fields = dict(entry)
                label = fields.pop("name")
                out.append((label, fields))
        return out

    def calibration_predictors(self) -> list[str]:
        """Calibration head-set names (``none``, ``context``, ``probe8``, ``twin``) the suite uses."""
        needed = set()
        if self.lossless.enabled:
            for spec in self.lossless.predictors:
                if spec != "generic":
                    needed.add(spec.replace(":", ""))
        if self.generation.enabled and "lossless" in self.generation.caches:
            needed.add("context")
        return sorted(needed)

    def evaluation_tokens(self) -> int:
        """Tokens of evaluation text the suite reads (laid out one after another, never reused)."""
        total = 0
        if self.lossless.enabled:
            total += self.lossless.tokens
        if self.generation.enabled:
            total += self.generation.prompt_tokens
        if self.lossy.enabled:
            total += self.lossy.segments * (self.lossy.context + self.lossy.continuation)
            total += self.lossy.needles * self.lossy.needle_context
        return total


SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "calibration": CalibrationSection,
    "lossless": LosslessSection,
    "generation": GenerationSection,
    "lossy": LossySection,
}


def builtin_suite_text(name: str) -> str:
    return importlib.resources.files(__package__).joinpath("suites", f"{name}.toml").read_text()


def load_suite(name_or_path: str | Path) -> Suite:
    """A built-in suite by name (``quick``, ``full``) or a TOML file by path; raises `SuiteError`."""
    text_name = str(name_or_path)
    if text_name in BUILTIN_SUITES:
        text, origin = builtin_suite_text(text_name), f"built-in suite {text_name!r}"
    elif text_name.endswith(".toml") or Path(text_name).exists():
        path = Path(text_name)
        try:
            text = path.read_text()
        except OSError as err:
            raise SuiteError(f"cannot read suite file {text_name!r}: {err.strerror or err}") from err
        origin = str(path.resolve())
    else:
        raise SuiteError(
            f"unknown suite {text_name!r}: use one of {list(BUILTIN_SUITES)} or a path to a .toml file"
        )
    return parse_suite(text, origin)


def parse_suite(text: str, origin: str = "<string>") -> Suite:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SuiteError(f"{origin}: not valid TOML ({err})") from err
    try:
        suite = _build(Suite, data, "", origin)
        _validate(suite, origin)
    except SuiteError:
        raise
    except ValueError as err:  # the shared field checks (hf_kvcompress.validation): same message, our type
        raise SuiteError(str(err)) from err
    suite.origin, suite.text = origin, text
    return suite


def _build(cls, data: dict[str, Any], prefix: str, origin: str):
    known = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("origin", "text")}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"[{prefix.rstrip('.')}]" if prefix else "the top level"
        raise SuiteError(f"{origin}: unknown key(s) {unknown} in {where}; known: {sorted(known)}")
    kwargs = {}
    defaults = cls()
    for name, value in data.items():
        path = f"{prefix}{name}"
        if name in SECTIONS and cls is Suite:
            if not isinstance(value, dict):
                raise SuiteError(f"{origin}: [{path}] must be a table")
            kwargs[name] = _build(SECTIONS[name], value, f"{path}.", origin)
            continue
        kwargs[name] = _check_type(value, getattr(defaults, name), path, origin)
    return cls(**kwargs)


def _check_type(value: Any, default: Any, path: str, origin: str) -> Any:
    """``value`` if it has the type of the key's ``default`` (bool, int, str or list); the bounds come later."""
    where = f"{origin}: {path}"
    if isinstance(default, bool):
        check_bool(where, value)
    elif isinstance(default, int):
        check_int(where, value)
    elif isinstance(default, str) and not isinstance(value, str):
        fail(where, f"must be a string, got {value!r}")
    elif isinstance(default, list) and not isinstance(value, list):
        fail(where, f"must be a list, got {value!r}")
    return value


def _validate(suite: Suite, origin: str) -> None:
    """Bounds and choices of every key; raises ``ValueError`` (`parse_suite` makes it a `SuiteError`)."""

    def where(path: str) -> str:
        return f"{origin}: {path}"

    def positive(path: str, value: int, minimum: int = 1) -> None:
        check_int(where(path), value, minimum=minimum)

    check_choice(where("model.dtype"), suite.model.dtype, DTYPES)
    positive("threads", suite.threads, 0)
    cal = suite.calibration
    positive("calibration.chunk", cal.chunk, 16)
    if cal.tokens < cal.chunk:
        fail(where("calibration.tokens"), f"must be >= calibration.chunk ({cal.chunk}), got {cal.tokens}")
    for i, p in enumerate(cal.predictors):
        check_choice(where(f"calibration.predictors[{i}]"), p, FITTED)
    for i, k in enumerate(cal.probe_layers):
        positive(f"calibration.probe_layers[{i}]", k)
    ll = suite.lossless
    positive("lossless.tokens", ll.tokens)
    positive("lossless.block_tokens", ll.block_tokens)
    positive("lossless.window_tokens", ll.window_tokens)
    if ll.window_tokens > ll.tokens:
        fail(where("lossless.window_tokens"), f"must be <= lossless.tokens ({ll.tokens})")
    for spec in ll.predictors:
        if not isinstance(spec, str) or not PREDICTOR_RE.match(spec):
            fail(where("lossless.predictors"), f"entries must be generic/none/context/twin/probe:K, got {spec!r}")
    for i, spec in enumerate(ll.baselines):
        check_choice(where(f"lossless.baselines[{i}]"), spec, BASELINES)
    for spec in ll.windows:
        if not isinstance(spec, str) or not WINDOW_RE.match(spec):
            fail(where("lossless.windows"), f"entries must be metadata/predicted/causal/fixed-N, got {spec!r}")
    gen = suite.generation
    positive("generation.prompt_tokens", gen.prompt_tokens)
    positive("generation.new_tokens", gen.new_tokens)
    positive("generation.block_tokens", gen.block_tokens)
    positive("generation.residual_tokens", gen.residual_tokens, 0)
    for i, spec in enumerate(gen.caches):
        check_choice(where(f"generation.caches[{i}]"), spec, GENERATION_CACHES)
    ly = suite.lossy
    for name in ("context", "continuation", "segments", "interval", "heldout_stride", "needle_context",
                 "needle_batch", "q_group_size"):
        positive(f"lossy.{name}", getattr(ly, name))
    positive("lossy.window", ly.window, 0)
    positive("lossy.sinks", ly.sinks, 0)
    positive("lossy.needles", ly.needles, 0)
    positive("lossy.continuation", ly.continuation, 2)
    for i, b in enumerate(ly.budgets):
        check_number(where(f"lossy.budgets[{i}]"), b, low=0.0, high=1.0, low_open=True)
    for spec in ly.quantized:
        if not isinstance(spec, str) or not QUANTIZED_RE.match(spec):
            fail(where("lossy.quantized"),
                 f"entries must be fp8, hqq-N (N in 1,2,3,4,8) or quanto-N (2, 4), got {spec!r}")
    labels = set()
    for entry in ly.methods:
        if isinstance(entry, str):
            fields, label = {"method": entry}, entry
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
            fields = {k: v for k, v in entry.items() if k != "name"}
            label = entry["name"]
        else:
            fail(where("lossy.methods"), f"entries must be method names or tables with a 'name', got {entry!r}")
        if label in labels:
            fail(where("lossy.methods"), f"has two methods named {label!r}")
        labels.add(label)
        try:
            LossyConfig.from_dict({**fields, "budget": 0.5})
        except (TypeError, ValueError) as err:
            fail(where("lossy.methods"), f"entry {label!r}: {err}")
