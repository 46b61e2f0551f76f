"""p_hat: the empirical marginal over all 2^16 bfloat16 bit patterns that escaped values are coded with."""

from __future__ import annotations

import functools
import hashlib

import constriction
import numpy as np
import torch

from .model import BUDGET, N_PATTERNS, TOTAL, default_marginal_weights, quantize_int
from .symbols import FP16, Format, format_of, split_bits, tensor_bits


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
        w = w.astype(np.int64)
        if (w < 0).any() or int(w.sum()) != BUDGET:
            raise ValueError(f"Marginal weights must be >= 0 and sum to {BUDGET}, got sum {int(w.sum())}")
        self._weights = w
        self._weights.setflags(write=False)
        self.sha256 = hashlib.sha256(b"hf_kvcompress.codec marginal v1\n" + w.astype("<i4").tobytes()).hexdigest()
        self._models: dict[int, tuple[object, np.ndarray]] = {}

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
        """(constriction model, effective frequencies) over the format's coded patterns (2^16 or 2^13)."""
        if fmt.code not in self._models:
            if fmt is FP16:
                w = quantize_int(self._weights[_fp16_to_bf16_pattern()] + 1, TOTAL - (1 << 13))
            else:
                w = self._weights
            model = constriction.stream.model.Categorical(w.astype(np.float64), perfect=False)
            self._models[fmt.code] = (model, w + 1)
        return self._models[fmt.code]


@functools.lru_cache(maxsize=1)
def _default_marginal() -> Marginal:
    return Marginal(default_marginal_weights())


def marginal_patterns(x: torch.Tensor) -> np.ndarray:
    """The coded patterns of ``x`` as `Marginal` indexes them (helper for tests and calibration)."""
    fmt = format_of(x.dtype)
    keys, _ = split_bits(tensor_bits(x), fmt)
    return keys
