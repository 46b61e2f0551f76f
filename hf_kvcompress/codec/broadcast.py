"""Element parameters for any flat range of ``x`` from a compact (broadcast) mean / std.

Per-channel statistics (``std`` of shape ``[1, H, 1, D]`` for ``x`` of ``[B, H, T, D]``) are turned into
table ids once, on their own small shape, and gathered per range by index arithmetic, so no full-size copy
of mean or std is ever made.
"""

from __future__ import annotations

import numpy as np

from .params import Params, element_params
from .symbols import Format
from .windows import log_codes

SIGMA_CODE_MIN, SIGMA_CODE_MAX = 8, 2039  # normal, finite float32 log codes


def sigma_bits_of_code(codes: np.ndarray) -> np.ndarray:
    """A window sigma code (8 * exponent + 3 mantissa bits) -> float32 bits of its sub-octave midpoint."""
    return (codes.astype(np.int64) << 20) | (1 << 19)


class ParamSource:
    """Maps flat element ranges of a tensor of ``shape`` to the compact mean/std arrays."""

    def __init__(self, shape: tuple[int, ...], mean: np.ndarray | None, std: np.ndarray | None, fmt: Format,
                 mean_steps: int = 8):
        self.fmt = fmt
        self.mean_steps = mean_steps
        nd = len(shape)
        mean_c = np.zeros((1,) * nd, dtype=np.float32) if mean is None else mean
        std_c = None if std is None else std
        cshape = np.broadcast_shapes(mean_c.shape, std_c.shape) if std_c is not None else mean_c.shape
        self.mean_bits = np.ascontiguousarray(np.broadcast_to(mean_c, cshape)).view(np.uint32).reshape(-1)
        self.std_bits = None
        self._compact: Params | None = None
        if std_c is not None:
            self.std_bits = np.ascontiguousarray(np.broadcast_to(std_c, cshape)).view(np.uint32).reshape(-1)
        # collapse dims into groups of [extent, x stride, compact stride (0: broadcast)], innermost first;
        # neighbouring dims that are both kept or both broadcast merge into one group
        groups: list[list[int]] = []
        xs, cs = 1, 1
        for d in range(nd - 1, -1, -1):
            ext, kept = shape[d], cshape[d] == shape[d]
            if ext != 1:
                if groups and (groups[-1][2] != 0) == kept:
                    groups[-1][0] *= ext
                else:
                    groups.append([ext, xs, cs if kept else 0])
            xs *= ext
            cs *= cshape[d]
        self._groups = [(g[0], g[1], g[2]) for g in groups if g[2] != 0]
        self._identity = cshape == tuple(shape)
        self._scalar = not self._groups

    @property
    def compact(self) -> Params:
        """Params of the compact mean / std, computed on first use (a device path may never need them)."""
        if self._compact is None:
            assert self.std_bits is not None
            self._compact = element_params(self.mean_bits, self.std_bits, self.fmt, self.mean_steps)
        return self._compact

    def index(self, a: int, b: int) -> np.ndarray | slice | None:
        """Compact flat indices of elements a..b-1 (a slice when contiguous, None when scalar)."""
        if self._identity:
            return slice(a, b)
        if self._scalar:
            return None
        i = np.arange(a, b, dtype=np.int64)
        idx = np.zeros(b - a, dtype=np.int64)
        for ext, xs, cs in self._groups:
            idx += (i // xs % ext) * cs
        return idx

    @staticmethod
    def _take(arr: np.ndarray, idx, n: int) -> np.ndarray:
        if idx is None:
            return np.broadcast_to(arr[:1], (n,))
        return arr[idx]

    def params(self, a: int, b: int, sigma_bits: np.ndarray | None = None) -> Params:
        """Params of elements a..b-1; ``sigma_bits`` (per element) when std is None."""
        idx = self.index(a, b)
        n = b - a
        if self.std_bits is not None:
            c = self.compact
            return Params(*(self._take(arr, idx, n) for arr in c))
        assert sigma_bits is not None
        return element_params(self._take(self.mean_bits, idx, n), sigma_bits, self.fmt, self.mean_steps)

    def mean_f32(self, a: int, b: int) -> np.ndarray:
        return self._take(self.mean_bits, self.index(a, b), b - a).view(np.float32)

    def std_f32(self, a: int, b: int) -> np.ndarray:
        assert self.std_bits is not None
        return self._take(self.std_bits, self.index(a, b), b - a).view(np.float32)

    def std_codes(self, a: int, b: int) -> np.ndarray:
        assert self.std_bits is not None
        return log_codes(self._take(self.std_bits, self.index(a, b), b - a))

    def std_code_mean(self) -> int:
        """Integer mean of lc(std) over the compact array (equal to the mean over all elements, since
        broadcasting repeats every compact entry equally often)."""
        assert self.std_bits is not None
        codes = log_codes(self.std_bits)
        return int(codes.astype(np.int64).sum()) // max(1, codes.size)
