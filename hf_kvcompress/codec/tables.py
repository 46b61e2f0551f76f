"""The coding tables: bin-integrated Gaussian mixtures, quantised to integer frequencies, exactly.

Each table is the mass of ``W_MAIN * N(mu, s^2) + W_WIDE * N(mu, (3 s)^2)`` over every bin of its alphabet,
normalised over the alphabet (mass outside it is what the escape path carries). Two families:

- N ("narrow", ``|mean| >~ 8 std``): alphabet = key offsets ``d`` in ``[-R, R]`` from the rounded mean, bins of
  one ulp of the mean (``[d - 1/2, d + 1/2]``); indexed by ``s`` in ulps of the mean (72 levels, 8 per octave,
  ``2^-4 .. 2^5`` ulps) and, below 4 ulps, by the mean's sub-ulp offset ``mu`` (9 levels of 1/16 ulp).
- W ("wide"): alphabet = all values whose magnitude lies in ``[2^(E-12), 2^(E+6))``, both signs, where
  ``2^E <= std < 2^(E+1)``; in units of ``2^E`` these bins are the same for every ``E`` (floats are scale
  invariant), so a table only depends on ``std / 2^E`` (8 levels) and ``t = |mean| / std`` (64 levels of 1/8).

Construction is float64 with the bit-reproducible fdlibm port in `detmath` and no float reductions; masses
become integers ``floor(p * 2^32)`` and are quantised to weights summing to ``2^24 - n`` by an exact integer
largest-remainder rule. constriction's ``Categorical(weights, perfect=False)`` then uses frequency
``weight + 1`` for every symbol exactly (its scale factor is ``(2^24 - n) / sum = 1.0``), so every symbol has
probability >= 2^-24 and the model is reproducible anywhere. A SHA-256 over all tables and constants is
compared with `TABLES_SHA256` once per process.

Also here: `Marginal` (p_hat, the distribution escaped values are coded with; its default is part of the
tables' hash) and the optional on-disk cache of the built tables, in a folder the caller names
(`set_table_cache`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TypeVar

import constriction
import numpy as np
import torch

from .detmath import det_erfc_nonneg, det_exp
from .symbols import FP16, Format, format_of, tensor_bits

T = TypeVar("T")

PRECISION = 24  # constriction's default Categorical precision
TOTAL = 1 << PRECISION
# the three-component mixture of speculative KV coding (https://fergusfinn.com/blog/kv-entropy-coder/; weights
# in docs/codec_format.md section 3): its 0.02 p_hat part is the escape path, whose per-tier weights section 9 measures
W_MAIN, W_WIDE, WIDE_FACTOR = 0.95, 0.03, 3.0

SUB = 8  # sub-octave levels of std (its top 3 mantissa bits)
N_OCT_MIN, N_OCTAVES = -4, 9
N_LEVELS = N_OCTAVES * SUB  # 72: std from 2^-4 to 2^5 ulps of the mean
N_OFFSET_LEVELS = 48  # levels below 4 ulps also resolve the mean's sub-ulp offset
N_OFFSETS = 9  # |offset| in 1/16 ulp: 0..8
N_RADIUS_SIGMAS = 12  # alphabet half-width: 4 sd of the wide component
N_COUNT = N_OFFSET_LEVELS * N_OFFSETS + (N_LEVELS - N_OFFSET_LEVELS)  # 456

W_LOW, W_HIGH = 12, 6  # binades below / above 2^E in the W alphabet
W_HALF = (W_LOW + W_HIGH) * 128  # M: symbols per sign (7 mantissa bits -> 128 per binade)
W_T_LEVELS = 64  # t = |mean| / std in steps of 1/8 up to 8: beyond that the N family takes over
W_BASE = N_COUNT
W_COUNT = SUB * W_T_LEVELS  # 512
N_TABLES = N_COUNT + W_COUNT  # 968
ESCAPE_GROUP = N_TABLES  # group id of escaped elements (coded with the marginal p_hat)

# SHA-256 of every table's integer frequencies, the default marginal and the constants above. A different
# value on this platform means this build would write streams other builds cannot read: refuse.
TABLES_SHA256 = "1e032ca4225a3271835ccf4ee594b6b8efb7658d7415c54b219f7df2b8a81cfa"


def sigma_rep(level: int) -> Fraction:
    """Representative std (in ulps for N, in units of 2^E for W) of a sub-octave level: bin midpoint."""
    octave, j = divmod(level, SUB)
    return Fraction(17 + 2 * j, 16) * Fraction(2) ** octave


def n_radius(level: int) -> int:
    """R of N level ``level`` (0..71): ceil(12 * s) + 2, exact in rationals."""
    s = sigma_rep(level) * Fraction(2) ** N_OCT_MIN
    v = N_RADIUS_SIGMAS * s
    return int(-(-v.numerator // v.denominator)) + 2


def n_table_params(tid: int) -> tuple[int, int, int]:
    """N table id -> (std level 0..71, offset level 0..8, radius R)."""
    if tid < N_OFFSET_LEVELS * N_OFFSETS:
        level, q = divmod(tid, N_OFFSETS)
    else:
        level, q = N_OFFSET_LEVELS + tid - N_OFFSET_LEVELS * N_OFFSETS, 0
    return level, q, n_radius(level)


_INV_SQRT2 = 0.7071067811865476


def _edge_terms(edges: np.ndarray, mu: np.ndarray | float, s: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """z = (edge - mu) / s and erfc(|z| / sqrt 2) at every bin edge (computed once per edge)."""
    z = (edges - mu) / s
    return z, det_erfc_nonneg(np.abs(z * _INV_SQRT2))


def _bin_mass(z_lo: np.ndarray, e_lo: np.ndarray, z_hi: np.ndarray, e_hi: np.ndarray) -> np.ndarray:
    """Standard normal mass of [z_lo, z_hi] from same-side erfc differences (no cancellation in the tails).
    The operation order is part of the format."""
    right = 0.5 * e_lo - 0.5 * e_hi  # 0 <= z_lo
    left = 0.5 * e_hi - 0.5 * e_lo  # z_hi <= 0
    mid = (1.0 - 0.5 * e_lo) - 0.5 * e_hi  # z_lo < 0 < z_hi
    return np.where(z_lo >= 0.0, right, np.where(z_hi <= 0.0, left, mid))


def _mixture_on_edges(edges: np.ndarray, mu, s) -> np.ndarray:
    """W_MAIN N(mu, s^2) + W_WIDE N(mu, (3s)^2) mass between consecutive edges along the last axis."""
    out = None
    for weight, scale in ((W_MAIN, s), (W_WIDE, WIDE_FACTOR * s)):
        z, e = _edge_terms(edges, mu, scale)
        m = weight * _bin_mass(z[..., :-1], e[..., :-1], z[..., 1:], e[..., 1:])
        out = m if out is None else out + m
    return out


def quantize(masses: np.ndarray, budget: int) -> np.ndarray:
    """Float masses (each in [0, 1]) -> int64 weights summing exactly to ``budget``.

    ``P = floor(mass * 2^32)`` (exact), ``w = floor(P * budget / sum P)``, and the remainder goes +1 to the
    largest ``P * budget mod sum P``, ties to the lower index. All integer: reproducible anywhere.
    """
    p = np.floor(np.asarray(masses, dtype=np.float64) * 2.0**32).astype(np.int64)
    return quantize_int(p, budget)


def quantize_int(p: np.ndarray, budget: int) -> np.ndarray:
    """`quantize` from integer masses (each < 2^32; at most 2^16 of them)."""
    p = np.asarray(p, dtype=np.int64)
    total = int(p.sum())
    if total == 0:
        p = np.ones_like(p)
        total = p.size
    num = p * budget
    w = num // total
    rem = num - w * total
    left = budget - int(w.sum())
    if left:
        order = np.lexsort((np.arange(p.size), -rem))
        w[order[:left]] += 1
    return w


def n_masses_all() -> list[np.ndarray]:
    """Masses of every N table (symbol d + R for offset d in [-R, R]), bins [d - 1/2, d + 1/2] ulps."""
    out = []
    for tid in range(N_COUNT):
        level, q, r = n_table_params(tid)
        s = float(sigma_rep(level) * Fraction(2) ** N_OCT_MIN)
        edges = np.arange(-r, r + 2, dtype=np.float64) - 0.5
        out.append(_mixture_on_edges(edges, q / 16.0, s))
    return out


def w_edges() -> np.ndarray:
    """Edges (units of 2^E) of the positive magnitude bins 2^b (1 + k/128), b in [-12, 6): exact. M + 1
    values: below a binade edge the ulp halves, so the edge under 2^b sits a quarter of its ulp below."""
    mi = np.arange(W_HALF + 1)
    b = (mi // 128 - W_LOW).astype(np.int64)
    k = (mi % 128).astype(np.float64)
    value = np.ldexp(1.0 + k / 128.0, b)
    return np.where(k > 0, value - np.ldexp(0.5, b - 7), value - np.ldexp(0.25, b - 7))


def w_masses_all() -> np.ndarray:
    """[W_COUNT, 2M] masses in symbol order: s0 = 0..M-1 negative (most negative first), M..2M-1 positive."""
    edges = w_edges()
    tids = np.arange(W_BASE, N_TABLES)
    j, t = np.divmod(tids - W_BASE, W_T_LEVELS)
    s = ((17 + 2 * j) / 16.0)[:, None]  # exact in float64
    mu = (t / 8.0)[:, None] * s  # t/8 exact, product exact (few significant bits)
    pos = _mixture_on_edges(edges[None, :], mu, s)
    neg = _mixture_on_edges(-edges[None, ::-1], mu, s)
    return np.concatenate([neg, pos], axis=1)


@dataclass(frozen=True)
class Tables:
    """All N and W tables: effective frequencies (sum 2^24 each) and their constriction models."""

    freqs: tuple[np.ndarray, ...]  # int64, effective (weight + 1)
    size: np.ndarray  # int32 [N_TABLES]: alphabet size
    half: np.ndarray  # int32 [N_TABLES]: M for W tables, 0 for N (see params: side split)
    radius: np.ndarray  # int32 [N_TABLES]: R for N tables, 0 for W
    models: tuple  # constriction Categorical per table
    cost_bits: np.ndarray  # float64, concatenated -log2(f / 2^24)
    cost_offset: np.ndarray  # int64 [N_TABLES]: start of each table in cost_bits
    sha256: str


def constants() -> dict:
    """Every constant that shapes the tables; hashed with them."""
    return {
        "precision": PRECISION, "w_main": W_MAIN, "w_wide": W_WIDE, "wide_factor": WIDE_FACTOR, "sub": SUB,
        "n_oct_min": N_OCT_MIN, "n_octaves": N_OCTAVES, "n_offset_levels": N_OFFSET_LEVELS,
        "n_offsets": N_OFFSETS, "n_radius_sigmas": N_RADIUS_SIGMAS, "w_low": W_LOW, "w_high": W_HIGH,
        "w_t_levels": W_T_LEVELS, "mass_scale_log2": 32,
    }


def build_weights() -> list[np.ndarray]:
    """Integer weights (sum ``2^24 - n``) of every table, in table id order."""
    masses = n_masses_all() + list(w_masses_all())
    return [quantize(m, TOTAL - m.size) for m in masses]


N_PATTERNS = 1 << 16
BUDGET = TOTAL - N_PATTERNS  # weights sum; every pattern's frequency is weight + 1 >= 1 (no zero probability)


@functools.lru_cache(maxsize=1)
def default_marginal_weights() -> np.ndarray:
    """The generic p_hat (the escape path's default marginal; part of the tables' contract, so it lives here), built deterministically: finite values log-normally spread over binades (centred
    on |x| ~ 2^-3, 8 binades wide, uniform over sign and mantissa), +-0 a little extra, and every other
    pattern (inf, every NaN payload, far subnormals) only the floor frequency 1/2^24."""
    pattern = np.arange(N_PATTERNS)
    exp_field = (pattern >> 7) & 0xFF
    g = det_exp(-0.5 * ((exp_field - 124.0) / 8.0) ** 2)  # in (0, 1]: exact-op-order, reproducible
    p = np.floor(g * 2.0**20).astype(np.int64)
    p[exp_field == 0xFF] = 0  # inf / NaN
    p[(pattern & 0x7FFF) == 0] = 1 << 14  # +-0
    return quantize_int(p, BUDGET)


def tables_digest(weights: list[np.ndarray], extra: bytes = b"") -> str:
    h = hashlib.sha256(b"hf_kvcompress.codec tables v1\n")
    h.update(json.dumps(constants(), sort_keys=True).encode())
    for w in weights:
        h.update(np.array(w.size, dtype="<i8").tobytes())
        h.update(w.astype("<i4").tobytes())
    h.update(extra)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def get_tables() -> Tables:
    """Build (once per process) and verify the tables; through the on-disk cache when one is set
    (`set_table_cache`)."""
    marginal_bytes = default_marginal_weights().astype("<i4").tobytes()
    weights = _cache_load(TABLES_SHA256)
    if weights is None or tables_digest(weights, marginal_bytes) != TABLES_SHA256:
        weights = build_weights()  # no (valid) cached copy: build, verify below, cache
        digest = tables_digest(weights, marginal_bytes)
        if digest == TABLES_SHA256:
            _cache_save(digest, weights)
    else:
        digest = TABLES_SHA256
    if digest != TABLES_SHA256:
        raise RuntimeError(
            "hf_kvcompress.codec: this platform builds different coding tables than the reference "
            f"(sha256 {digest}, expected {TABLES_SHA256}); streams written here would not decode elsewhere. "
            "Please report your platform (CPU, OS, numpy version)."
        )
    freqs = tuple(w + 1 for w in weights)
    size = np.array([f.size for f in freqs], dtype=np.int32)
    half = np.array([0] * W_BASE + [W_HALF] * W_COUNT, dtype=np.int32)
    radius = np.array([n_table_params(t)[2] for t in range(W_BASE)] + [0] * W_COUNT, dtype=np.int32)
    models = tuple(constriction.stream.model.Categorical(w.astype(np.float64), perfect=False) for w in weights)
    cost = np.concatenate([PRECISION - np.log2(f.astype(np.float64)) for f in freqs])
    offset = np.concatenate([[0], np.cumsum(size[:-1], dtype=np.int64)])
    return Tables(freqs, size, half, radius, models, cost, offset, digest)


# ---------------------------------------------------------------------------------------------------------
# p_hat: the empirical marginal over all 2^16 bfloat16 bit patterns that escaped values are coded with.


@functools.lru_cache(maxsize=1)
def _fp16_to_bf16_pattern() -> np.ndarray:
    """The 13-bit float16 prefix (sign, 5 exponent, top 7 mantissa bits) -> the bfloat16 pattern of the
    same value (exact: every such value is a bfloat16), used to induce the float16 marginal."""
    p = np.arange(1 << 13)
    sign = (p >> 12) & 1
    e5 = (p >> 7) & 31
    m7 = p & 127
    normal = (e5 + 112) << 7 | m7
    special = 255 << 7 | m7
    hb = np.floor(np.log2(np.maximum(m7, 1))).astype(np.int64)  # exact for integers < 2^7
    sub = np.where(m7 == 0, 0, (hb + 106) << 7 | ((m7 << (7 - hb)) & 127))
    mag = np.where(e5 == 31, special, np.where(e5 == 0, sub, normal))
    return sign << 15 | mag


class Marginal:
    """A distribution over the 2^16 bfloat16 bit patterns, as integer weights summing to ``2^24 - 2^16``
    (each pattern's coding frequency is weight + 1, so none has zero probability).

    Streams record its SHA-256; decoding with a different marginal fails loudly. Save it with
    `to_tensor` (an int32 tensor, e.g. into safetensors) and load with `from_tensor`.
    """

    def __init__(self, weights: np.ndarray | torch.Tensor) -> None:
        w = weights.detach().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
        if w.shape != (N_PATTERNS,):
            raise ValueError(f"Marginal needs {N_PATTERNS} weights, got shape {tuple(w.shape)}")
        if not np.issubdtype(w.dtype, np.integer):
            raise TypeError(f"Marginal weights must be integers, got {w.dtype}")
        total = int(w.sum(dtype=np.int64))
        if (w < 0).any() or total != BUDGET:
            raise ValueError(f"Marginal weights must be >= 0 and sum to {BUDGET}, got sum {total}")
        # int32 (every weight is below BUDGET < 2^31): an int32 tensor's weights are a read-only view of it, not a
        # copy (a calibration's marginal is held once, by the calibration; `frequencies` widens on use)
        self._weights = w if w.dtype == np.int32 else w.astype(np.int32)
        self._weights = self._weights.view()
        self._weights.setflags(write=False)
        self.sha256 = hashlib.sha256(b"hf_kvcompress.codec marginal v1\n" + w.astype("<i4").tobytes()).hexdigest()
        self._models: dict[int, tuple[object, np.ndarray]] = {}
        #: tables other coders derive from this marginal (`memo`): kept as long as the marginal is, no longer
        self._derived: dict[tuple[str, int], object] = {}

    @property
    def weights(self) -> np.ndarray:
        return self._weights

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Marginal) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)

    def __repr__(self) -> str:
        return f"Marginal(sha256={self.sha256[:16]}...)"

    @classmethod
    def default(cls) -> Marginal:
        return _default_marginal()

    @classmethod
    def from_samples(cls, x: torch.Tensor, prior_weight: float = 1.0 / 64) -> Marginal:
        """Histogram of the coded 16-bit patterns of ``x`` (bfloat16; float32's top half; float16 mapped to
        the bfloat16 pattern of its 13-bit prefix), mixed with ``prior_weight`` of the default so unseen
        patterns stay cheap enough."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Marginal.from_samples expects a torch.Tensor, got {type(x).__name__}")
        if not 0.0 < prior_weight <= 1.0:
            raise ValueError(f"prior_weight must lie in (0, 1], got {prior_weight}")
        fmt = format_of(x.dtype)
        bits = tensor_bits(x)
        pattern = _fp16_to_bf16_pattern()[bits >> 3] if fmt is FP16 else bits >> fmt.raw_bits
        counts = np.bincount(pattern, minlength=N_PATTERNS).astype(np.float64)
        total = max(1.0, counts.sum())
        mix = (1.0 - prior_weight) * counts / total + prior_weight * default_marginal_weights() / BUDGET
        return cls(quantize_int(np.floor(mix * 2.0**32).astype(np.int64), BUDGET))

    def to_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self._weights.astype(np.int32))

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Marginal:
        return cls(t)

    def coding(self, fmt: Format) -> tuple[object, np.ndarray]:
        """(constriction model, effective frequencies) over the format's coded patterns (2^16 or 2^13), kept (the
        ``ans`` coder's; coders that need only the frequencies call `frequencies`, which keeps nothing)."""
        if fmt.code not in self._models:
            w = self._coding_weights(fmt)
            model = constriction.stream.model.Categorical(w.astype(np.float64), perfect=False)
            self._models[fmt.code] = (model, w + 1)
        return self._models[fmt.code]

    def memo(self, name: str, fmt: Format, make: Callable[[], T]) -> T:
        """``make()`` once per ``(name, fmt)`` for this marginal's lifetime: a coder's tables derived from it (the
        lanes coder's p_hat tables) are freed with it (a calibration's marginals go with the calibration), where a
        module-level memo would keep every marginal's tables for the life of the process."""
        key = (name, fmt.code)
        if key not in self._derived:
            self._derived[key] = make()  # a race computes the same tables twice; either is kept
        return self._derived[key]

    def frequencies(self, fmt: Format) -> np.ndarray:
        """`coding`'s effective frequencies (int64), computed on each call and not kept."""
        return self._coding_weights(fmt) + 1

    def _coding_weights(self, fmt: Format) -> np.ndarray:
        weights = self._weights.astype(np.int64)
        if fmt is FP16:
            return quantize_int(weights[_fp16_to_bf16_pattern()] + 1, TOTAL - (1 << 13))
        return weights


@functools.lru_cache(maxsize=1)
def _default_marginal() -> Marginal:
    return Marginal(default_marginal_weights())


# ---------------------------------------------------------------------------------------------------------
# On-disk cache of the built weights: a new process skips ~1-3 s of float64 table building. Only a shortcut:
# `get_tables` verifies whatever it loads against `TABLES_SHA256` (the check a fresh build gets) and rebuilds
# on any mismatch or read error. The codec has no folder of its own: the application names one
# (`set_table_cache`; hf_kvcompress sets its download/cache folder), else nothing is cached.
# ``HF_KVCOMPRESS_TABLE_CACHE=0`` turns it off. Writes are atomic (temporary file, then rename) and failures
# to write are ignored.

_cache_dir: Path | Callable[[], Path] | None = None


def set_table_cache(folder: Path | str | Callable[[], Path] | None) -> None:
    """Keep the built table weights in ``folder`` (or in the folder a zero-argument function returns on first
    use, so that setting it creates nothing); None: no on-disk cache."""
    global _cache_dir
    _cache_dir = Path(folder) if isinstance(folder, str) else folder


def _cache_path(digest: str) -> Path | None:
    if _cache_dir is None or os.environ.get("HF_KVCOMPRESS_TABLE_CACHE", "1") == "0":
        return None
    try:
        folder = _cache_dir() if callable(_cache_dir) else _cache_dir
    except OSError:
        return None
    return Path(folder) / f"tables-{digest[:16]}.npz"


def _cache_load(digest: str) -> list[np.ndarray] | None:
    """Weights cached for tables of hash ``digest``, unverified (the caller hashes them), or None."""
    path = _cache_path(digest)
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as z:
            flat, sizes = z["weights"].astype(np.int64), z["sizes"].astype(np.int64)
    except (OSError, ValueError, KeyError):
        return None
    if sizes.sum() != flat.size or (sizes <= 0).any():
        return None
    return np.split(flat, np.cumsum(sizes)[:-1])


def _cache_save(digest: str, weights: list[np.ndarray]) -> None:
    path = _cache_path(digest)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, weights=np.concatenate(weights).astype(np.int32),
                     sizes=np.array([w.size for w in weights], dtype=np.int32))
        os.replace(tmp, path)
    except OSError:
        pass
