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
    #: torch threads (0 = torch's default). One thread gives stable timings on a shared machine.
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
    suite = _build(Suite, data, "", origin)
    suite.origin, suite.text = origin, text
    _validate(suite, origin)
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
    def fail(want: str) -> SuiteError:
        return SuiteError(f"{origin}: {path} must be {want}, got {value!r}")

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise fail("true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise fail("a string")
    elif isinstance(default, list) and not isinstance(value, list):
        raise fail("a list")
    return value


def _validate(suite: Suite, origin: str) -> None:
    def fail(path: str, problem: str) -> None:
        raise SuiteError(f"{origin}: {path} {problem}")

    def positive(path: str, value: int, minimum: int = 1) -> None:
        if value < minimum:
            fail(path, f"must be >= {minimum}, got {value}")

    if suite.model.dtype not in DTYPES:
        fail("model.dtype", f"must be one of {list(DTYPES)}, got {suite.model.dtype!r}")
    positive("threads", suite.threads, 0)
    cal = suite.calibration
    positive("calibration.chunk", cal.chunk, 16)
    if cal.tokens < cal.chunk:
        fail("calibration.tokens", f"must be >= calibration.chunk ({cal.chunk}), got {cal.tokens}")
    for p in cal.predictors:
        if p not in ("none", "context", "probe", "twin"):
            fail("calibration.predictors", f"entries must be none/context/probe/twin, got {p!r}")
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in cal.probe_layers):
        fail("calibration.probe_layers", f"must be integers >= 1, got {cal.probe_layers}")
    ll = suite.lossless
    positive("lossless.tokens", ll.tokens)
    positive("lossless.block_tokens", ll.block_tokens)
    positive("lossless.window_tokens", ll.window_tokens)
    if ll.window_tokens > ll.tokens:
        fail("lossless.window_tokens", f"must be <= lossless.tokens ({ll.tokens})")
    for spec in ll.predictors:
        if not isinstance(spec, str) or not PREDICTOR_RE.match(spec):
            fail("lossless.predictors", f"entries must be generic/none/context/twin/probe:K, got {spec!r}")
    for spec in ll.baselines:
        if spec not in BASELINES:
            fail("lossless.baselines", f"entries must be among {list(BASELINES)}, got {spec!r}")
    for spec in ll.windows:
        if not isinstance(spec, str) or not WINDOW_RE.match(spec):
            fail("lossless.windows", f"entries must be metadata/predicted/causal/fixed-N, got {spec!r}")
    gen = suite.generation
    positive("generation.prompt_tokens", gen.prompt_tokens)
    positive("generation.new_tokens", gen.new_tokens)
    positive("generation.block_tokens", gen.block_tokens)
    positive("generation.residual_tokens", gen.residual_tokens, 0)
    for spec in gen.caches:
        if spec not in GENERATION_CACHES:
            fail("generation.caches", f"entries must be among {list(GENERATION_CACHES)}, got {spec!r}")
    ly = suite.lossy
    for name in ("context", "continuation", "segments", "interval", "heldout_stride", "needle_context",
                 "needle_batch", "q_group_size"):
        positive(f"lossy.{name}", getattr(ly, name))
    positive("lossy.window", ly.window, 0)
    positive("lossy.sinks", ly.sinks, 0)
    positive("lossy.needles", ly.needles, 0)
    if ly.continuation < 2:
        fail("lossy.continuation", "must be >= 2")
    for b in ly.budgets:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0 < b <= 1):
            fail("lossy.budgets", f"entries must be fractions in (0, 1], got {b!r}")
    for spec in ly.quantized:
        if not isinstance(spec, str) or not QUANTIZED_RE.match(spec):
            fail("lossy.quantized", f"entries must be fp8, hqq-N (N in 1,2,3,4,8) or quanto-N (2, 4), got {spec!r}")
    labels = set()
    for entry in ly.methods:
        if isinstance(entry, str):
            fields, label = {"method": entry}, entry
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
            fields = {k: v for k, v in entry.items() if k != "name"}
            label = entry["name"]
        else:
            fail("lossy.methods", f"entries must be method names or tables with a 'name', got {entry!r}")
        if label in labels:
            fail("lossy.methods", f"has two methods named {label!r}")
        labels.add(label)
        try:
            LossyConfig.from_dict({**fields, "budget": 0.5})
        except (TypeError, ValueError) as err:
            fail("lossy.methods", f"entry {label!r}: {err}")
