"""The `grid` predictor's element-wise quantization as compiled loops: one pass per maximum and one per output,
where the torch expressions they replace (`grid.quantize_features`, the weight folding of `grid.grid_means`) make
six to eight passes and float64 temporaries. The arithmetic is the same IEEE operations (power-of-two scalings,
round half to even, clamps, `frexp` exponents), so the results are the same bits: tests/predictors/
test_grid_kernels.py compares them bit for bit with the torch expressions, which stay as the reference.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
import torch

_jit = nb.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


@nb.njit(cache=True, nogil=True, inline="always")
def _pow2(k):
    """``2.0 ** k`` float64 for an integer ``k`` in float64's normal range (exact)."""
    return math.ldexp(1.0, k)


@_jit
def quantize_rows(x, bits, limit, q, exponent):
    """`grid.quantize_features` of ``x`` ``[rows, tokens, features]`` float32 (NaN and infinities read as 0):
    ``q`` (float32, same shape) and ``exponent`` (int64 ``[rows, features]``)."""
    rows, tokens, features = x.shape
    top = np.zeros(features, np.float32)
    # per channel, float32 factors as torch forms them: 2^min(shift, 127), then (a channel of subnormals, beyond
    # float32's exponent range) 2^(shift - 127), 1 elsewhere (an exact no-op)
    first = np.zeros(features, np.float32)
    second = np.ones(features, np.float32)
    for r in range(rows):
        top[:] = 0.0
        for t in range(tokens):
            for f in range(features):
                v = abs(x[r, t, f])
                if v > top[f] and v != np.inf:  # NaN compares False; infinity reads as 0 (below)
                    top[f] = v
        two_steps = False
        for f in range(features):
            e = math.frexp(np.float64(top[f]))[1]
            exponent[r, f] = e
            shift = bits - e
            first[f] = np.float32(_pow2(min(shift, 127)))
            second[f] = np.float32(_pow2(max(shift - 127, 0)))
            two_steps = two_steps or shift > 127
        for t in range(tokens):
            for f in range(features):
                v = x[r, t, f]
                if not (abs(v) < np.inf):  # NaN or infinite: 0 (`linear.finite_features`)
                    v = np.float32(0.0)
                s = v * first[f]
                if two_steps:
                    s = s * second[f]
                s = np.rint(s)
                q[r, t, f] = min(max(s, -limit), limit)


@_jit
def quantize_folded(weight, exponent, bits, limit, qw, shift):
    """`grid.grid_means`' weights: ``weight`` ``[n, out]`` float64 (finite) folded with each row's feature scales
    ``2^(exponent[r, i] - bits)`` (int64 ``[rows, n]``) and quantized per output column: ``qw`` (float32
    ``[rows, n, out]``, integers ``|q| <= limit``) and the columns' ``shift`` (int64 ``[rows, out]``)."""
    rows = exponent.shape[0]
    n, out = weight.shape
    top = np.zeros(out, np.float64)
    scale = np.zeros(n, np.float64)
    for r in range(rows):
        for i in range(n):
            scale[i] = _pow2(exponent[r, i] - bits)
        top[:] = 0.0
        for i in range(n):
            for j in range(out):
                v = abs(weight[i, j] * scale[i])  # exact: a power of two
                if v > top[j]:
                    top[j] = v
        for j in range(out):
            shift[r, j] = math.frexp(top[j])[1] - bits
        for j in range(out):
            top[j] = _pow2(-shift[r, j])  # reused: the column's scale
        for i in range(n):
            for j in range(out):
                s = np.rint((weight[i, j] * scale[i]) * top[j])
                qw[r, i, j] = min(max(s, -limit), limit)


@_jit
def error_sums(x, predicted, sigma, cap, bits, out):
    """`grid.GridLayer`'s surprise sums: ``x`` ``[rows, heads, tokens, dim]`` (float32, in the means' frame),
    ``predicted`` ``[rows, tokens, heads * dim]`` (float32 means), ``sigma`` ``[heads, dim]``; per row and token the
    int64 sum over heads and channels of ``floor(min(((x - mean) / sigma)^2, cap) * 2^bits)`` (NaN counts 0):
    `grid.squared_error_sums` of the standardised errors, each element the same float32 operations."""
    rows, heads, tokens, dim = x.shape
    scale = np.float32(_pow2(bits))
    for r in range(rows):
        for t in range(tokens):
            total = 0
            for h in range(heads):
                for d in range(dim):
                    e = (x[r, h, t, d] - predicted[r, t, h * dim + d]) / sigma[h, d]
                    e2 = e * e
                    if e2 != e2:  # NaN
                        continue
                    if e2 > cap:
                        e2 = cap
                    total += np.int64(math.floor(e2 * scale))
            out[r, t] = total


@_jit
def unrotate(x, cos, sin, out):
    """`rope.RopeFrame.unrotate_by` of float32 keys ``x`` ``[blocks, rows, tokens, dim]`` with each block's tables
    ``cos`` / ``sin`` ``[blocks, tokens, dim]``: ``x * cos - rotate_half(x) * sin`` element by element, the same
    float32 products and difference (a NaN's payload aside: the grid reads a NaN key as 0 wherever it reads one)."""
    blocks, rows, tokens, dim = x.shape
    half = dim // 2
    low = dim - half  # rotate_half: [-x[half:], x[:half]]
    for b in range(blocks):
        for r in range(rows):
            for t in range(tokens):
                for d in range(dim):
                    rot = -x[b, r, t, half + d] if d < low else x[b, r, t, d - low]
                    out[b, r, t, d] = x[b, r, t, d] * cos[b, t, d] - rot * sin[b, t, d]


def quantize_features_compiled(x: torch.Tensor, bits: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a float32 ``[rows, tokens, features]`` tensor: ``q`` and exponents ``[rows, 1,
    features]`` as `grid.quantize_features` gives them."""
    x = x.contiguous()
    rows, _, features = x.shape
    q = torch.empty_like(x)
    exponent = torch.empty((rows, features), dtype=torch.int64)
    if x.numel():
        quantize_rows(x.numpy(), bits, np.float32(limit), q.numpy(), exponent.numpy())
    else:
        exponent.zero_()
    return q, exponent.unsqueeze(1)


def quantize_folded_compiled(weight: torch.Tensor, exponent: torch.Tensor, bits: int,
                             limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_folded` of float64 weights ``[n, out]`` and feature exponents ``[rows, 1, n]``: float32 ``qw``
    ``[rows, n, out]`` and int64 shifts ``[rows, 1, out]``."""
    weight = weight.to(torch.float64).contiguous()
    exponent = exponent.reshape(exponent.shape[0], -1).to(torch.int64).contiguous()
    rows, (n, out) = exponent.shape[0], weight.shape
    qw = torch.empty((rows, n, out), dtype=torch.float32)
    shift = torch.empty((rows, out), dtype=torch.int64)
    quantize_folded(weight.numpy(), exponent.numpy(), bits, float(limit), qw.numpy(), shift.numpy())
    return qw, shift.unsqueeze(1)


def error_sums_compiled(x: torch.Tensor, predicted: torch.Tensor, sigma: torch.Tensor, cap: float,
                        bits: int) -> torch.Tensor:
    """`error_sums` of float32 tensors: int64 ``[rows, tokens]``."""
    x, predicted = x.contiguous(), predicted.contiguous()
    sigma = sigma.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], x.shape[2], dtype=torch.int64)
    error_sums(x.numpy(), predicted.numpy(), sigma.numpy(), np.float32(cap), bits, out.numpy())
    return out


def unrotate_compiled(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`unrotate` of float32 keys ``[blocks, ..., tokens, dim]`` with float32 tables ``[blocks, 1, ..., tokens,
    dim]`` (one per block, broadcast over the dims between): the same shape."""
    blocks, tokens, dim = x.shape[0], x.shape[-2], x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    unrotate(x.view(blocks, -1, tokens, dim).numpy(), cos.reshape(blocks, tokens, dim).contiguous().numpy(),
             sin.reshape(blocks, tokens, dim).contiguous().numpy(), out.view(blocks, -1, tokens, dim).numpy())
    return out
