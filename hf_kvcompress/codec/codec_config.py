"""What the caller hands the codec: `CodecConfig` (every choice the encoder makes, validated at construction, JSON
round-trippable; the coder a name stands for is `registry`'s) and the fingerprints of ``mean`` and ``std`` (their
checks are `interface`'s).

The decoder reads the config from the stream, so everything here that shapes the bits is in ``to_dict``.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np

from ..validation import check_int, check_number
from .registry import check_coder
from .tables import Marginal

MAX_WINDOW = 65536  # window lengths are stored as u16 (length - 1)
WINDOW_MODES = ("fixed", "metadata", "predicted", "causal")
MEAN_STEPS = (8, 4, 2)
HEADERS = ("full", "compact")
#: the codec's default coder (`CodecConfig()`), the LMCache chunk coder's and a predictor's unless it declares
#: another (`Predictor.coder` / `storage_coder`): decodes 5-10x faster than ``ans`` for +0.007-0.011 bit/scalar
#: (docs/results/codec.md 12.3)
DEFAULT_CODER = "lanes"
#: the coder generation's default predictor, ``generic``, declares (`Predictor.coder`, which `LosslessConfig.coder`
#: None takes): decodes ~10x faster than ``lanes`` for ~+0.28 bit/scalar, which a decode step, decoding every
#: block, needs more than the bits (docs/results/codec.md 13)
GENERATION_CODER = "huff"
LEGACY_CODER = "ans"  # the coder of a serialised config that names none (`to_dict` leaves ``ans`` out)

def _int(name: str, v: Any, lo: int, hi: int) -> None:
    check_int(f"CodecConfig.{name}", v, minimum=lo, maximum=hi)  # a wrong type: ConfigTypeError, a TypeError


def _float(name: str, v: Any, lo: float, hi: float) -> None:
    check_number(f"CodecConfig.{name}", v, low=lo, high=hi, low_open=True)


def eighth_octaves(ratio: float) -> int:
    """round(8 * log2(ratio)) computed exactly in rationals (no libm), so both sides agree everywhere:
    the k with 2^(2k-1) <= ratio^16 < 2^(2k+1)."""
    r16 = Fraction(ratio) ** 16
    k = math.floor(math.log2(ratio) * 8 + 0.5)  # guess, then fix exactly
    while Fraction(2) ** (2 * k - 1) > r16:
        k -= 1
    while Fraction(2) ** (2 * k + 1) <= r16:
        k += 1
    return k


@dataclass(frozen=True)
class CodecConfig:
    """How `encode` lays out windows and weighs the escape path.

    Attributes:
        window: how encoder and decoder agree on window boundaries: ``"fixed"`` (``fixed_window`` elements),
            ``"metadata"`` (adaptive, from the real residuals; lengths are sent), ``"predicted"`` (adaptive,
            from ``std`` alone on both sides; falls back to ``short_window`` when ``std`` is None) or
            ``"causal"`` (adaptive, the next window from already-decoded residuals; serial boundaries).
        fixed_window: window length in ``"fixed"`` mode.
        probe: W_probe, elements per locality probe block.
        tier_windows: target window length per tier (low / medium / high locality).
        thresholds: sigma_local / sigma_global below which a block is medium / high locality (0.5, 0.1).
        tau_smooth: medium-locality segments smoother than this use the full medium window, others half.
        hysteresis: consecutive disagreeing probe blocks needed to switch tier (h).
        min_window: W_min; adaptive windows are multiples of it.
        short_tokens, token_elements: inputs under ``short_tokens * token_elements`` elements use the fixed
            ``short_window`` (a fast path for sequences under 512 tokens; docs/codec_format.md section 5.2).
        short_window: that fixed medium window.
        sigma_global: optional per-layer prior for sigma_global (else estimated from std or residuals).
        escape: escape probability per window tier (windows <= tier_windows[0], <= tier_windows[1],
            larger) in units of 2^-16: small windows give the marginal p_hat more weight.
        marginal: p_hat for escaped values (None: the built-in default). Streams record its hash.
        mean_steps: resolution of ``|mean| / std`` in the wide (W) tables: steps of ``1 / mean_steps`` std
            (8, 4 or 2; the tables exist on the 1/8 grid). Coarser steps use fewer distinct tables per window
            (fewer, larger coder calls: faster with per-element means) for a small rate cost (docs/codec.md).
        header: stream header layout: ``"full"`` (self-describing: config JSON, hashes; decodes without
            the config) or ``"compact"`` (a short digest of tables, marginal and config; ``decode`` then
            needs ``config=`` and checks the digest). Ignored by ``coder="lanes"``, which has its own layout.
        coder: a registered coder (`coders.CODERS`): ``"lanes"`` (the default: compiled interleaved rANS over
            the whole stream as one window, ~24-byte header; its streams do not carry the config, ``decode``
            checks them against ``config=`` or the default `CodecConfig()`; only ``window="fixed"``, and
            ``fixed_window`` has no effect; docs/codec_format.md section 12) or ``"ans"`` (constriction, windows
            grouped by table id, every window mode; the layouts above). Every other field keeps its default
            whatever the coder, so ``CodecConfig(coder="ans")`` is the ``ans`` coder's original default.
    """

    window: str = "fixed"
    fixed_window: int = 4096
    probe: int = 128
    tier_windows: tuple[int, int, int] = (256, 1024, 4096)
    thresholds: tuple[float, float] = (0.1, 0.5)
    tau_smooth: float = 0.15
    hysteresis: int = 2
    min_window: int = 64
    short_tokens: int = 512
    token_elements: int = 64
    short_window: int = 1024
    sigma_global: float | None = None
    escape: tuple[int, int, int] = (256, 128, 64)
    marginal: Marginal | None = None
    mean_steps: int = 8
    header: str = "full"
    coder: str = DEFAULT_CODER

    _NOT_IN_DICT: ClassVar[tuple[str, ...]] = ("marginal",)

    def __post_init__(self) -> None:
        if self.window not in WINDOW_MODES:
            raise ValueError(f"CodecConfig.window must be one of {list(WINDOW_MODES)}, got {self.window!r}")
        _int("fixed_window", self.fixed_window, 1, MAX_WINDOW)
        _int("min_window", self.min_window, 1, MAX_WINDOW)
        _int("probe", self.probe, 8, MAX_WINDOW)
        tiers = tuple(self.tier_windows)
        if len(tiers) != 3:
            raise ValueError(f"CodecConfig.tier_windows needs 3 lengths, got {self.tier_windows!r}")
        for i, t in enumerate(tiers):
            _int(f"tier_windows[{i}]", t, self.min_window, MAX_WINDOW)
            if t % self.min_window:
                raise ValueError(f"CodecConfig.tier_windows[{i}]={t} must be a multiple of min_window")
        if not tiers[0] <= tiers[1] <= tiers[2]:
            raise ValueError(f"CodecConfig.tier_windows must be non-decreasing, got {tiers}")
        object.__setattr__(self, "tier_windows", tiers)
        th = tuple(self.thresholds)
        if len(th) != 2:
            raise ValueError(f"CodecConfig.thresholds needs 2 ratios, got {self.thresholds!r}")
        for i, v in enumerate(th):
            _float(f"thresholds[{i}]", v, 0.0, 1e6)
        if not th[0] < th[1]:
            raise ValueError(f"CodecConfig.thresholds must be increasing, got {th}")
        object.__setattr__(self, "thresholds", tuple(float(v) for v in th))
        _float("tau_smooth", self.tau_smooth, 0.0, 1e6)
        _int("hysteresis", self.hysteresis, 1, 1024)
        _int("short_tokens", self.short_tokens, 0, 1 << 40)
        _int("token_elements", self.token_elements, 1, 1 << 30)
        _int("short_window", self.short_window, 1, MAX_WINDOW)
        if self.sigma_global is not None:
            _float("sigma_global", self.sigma_global, 0.0, 3.0e38)
        esc = tuple(self.escape)
        if len(esc) != 3:
            raise ValueError(f"CodecConfig.escape needs 3 values, got {self.escape!r}")
        for i, e in enumerate(esc):
            _int(f"escape[{i}]", e, 1, 32768)
        object.__setattr__(self, "escape", esc)
        if isinstance(self.mean_steps, bool) or self.mean_steps not in MEAN_STEPS:
            raise ValueError(f"CodecConfig.mean_steps must be one of {list(MEAN_STEPS)}, got {self.mean_steps!r}")
        if self.header not in HEADERS:
            raise ValueError(f"CodecConfig.header must be one of {list(HEADERS)}, got {self.header!r}")
        check_coder(self)  # a registered coder, and what it takes of the rest (window modes)
        if self.marginal is not None and not isinstance(self.marginal, Marginal):
            raise TypeError(f"CodecConfig.marginal must be a Marginal or None, got {type(self.marginal).__name__}")

    @property
    def short_elements(self) -> int:
        return self.short_tokens * self.token_elements

    @property
    def marginal_or_default(self) -> Marginal:
        return self.marginal if self.marginal is not None else Marginal.default()

    def tier_of_length(self, length: int) -> int:
        """Window tier by length: the escape probability follows it."""
        return 0 if length <= self.tier_windows[0] else 1 if length <= self.tier_windows[1] else 2

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of everything that shapes the bits; the marginal is represented by its hash (pass
        it to `from_dict`)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in self._NOT_IN_DICT:
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        out["marginal_sha256"] = None if self.marginal is None else self.marginal.sha256
        # the layout is not a coding choice, and the default mean_steps is left out, so that streams of the
        # default config keep the exact bytes of earlier versions (likewise ``ans``, the coder of the first
        # format: `from_dict` reads a missing coder as it)
        del out["header"]
        if self.mean_steps == 8:
            del out["mean_steps"]
        if self.coder == LEGACY_CODER:
            del out["coder"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], marginal: Marginal | None = None) -> CodecConfig:
        """Inverse of `to_dict`. Unknown keys are an error; a recorded marginal hash must match ``marginal``."""
        if not isinstance(data, dict):
            raise TypeError(f"CodecConfig.from_dict expects a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls) if f.name not in cls._NOT_IN_DICT} | {"marginal_sha256"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"CodecConfig: unknown field(s) {unknown}")
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k != "marginal_sha256"}
        kwargs.setdefault("coder", LEGACY_CODER)  # `to_dict` leaves it out
        want = data.get("marginal_sha256")
        if want is not None and (marginal is None or marginal.sha256 != want):
            have = None if marginal is None else marginal.sha256
            raise ValueError(f"CodecConfig: config was made with marginal {want}, got {have}")
        return cls(**kwargs, marginal=marginal if want is not None else None)


# ---------------------------------------------------------------------------------------------------------
# The mean/std fingerprints (the argument checks are `interface`'s).

_NO_FP = bytes(16)


def fingerprint(arr: np.ndarray | None, tag: bytes) -> bytes:
    """16-byte hash of the float32 values and (padded) shape the coder used; zeros for None."""
    if arr is None:
        return _NO_FP
    h = hashlib.blake2b(tag, digest_size=16)
    h.update(np.asarray(arr.shape, dtype="<u8").tobytes())
    h.update(arr.astype("<f4").tobytes())
    return h.digest()


def fingerprint8(arr: np.ndarray | None, tag: bytes) -> bytes:
    """8-byte fingerprint for the compact layout: CRC-32 and Adler-32 of the same bytes `fingerprint`
    hashes (4x cheaper than BLAKE2b; it guards against a predictor that did not reproduce, not an
    adversary). Zeros for None."""
    if arr is None:
        return bytes(8)
    head = tag + np.asarray(arr.shape, dtype="<u8").tobytes()
    data = np.ascontiguousarray(arr, dtype="<f4").view(np.uint8).reshape(-1)
    crc = zlib.crc32(data, zlib.crc32(head))
    adler = zlib.adler32(data, zlib.adler32(head))
    return crc.to_bytes(4, "little") + adler.to_bytes(4, "little")
