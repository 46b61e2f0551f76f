"""Batched least-squares solvers for summary fits, and the truncated SVD (summary values, plain SVD method).

Everything here works on a leading batch dimension (batch rows x KV heads, one batched call for all of them). The
systems are ill-conditioned (attention kernels of neighbouring keys are nearly collinear): the ridge solve runs a
float32 Cholesky and solves again in float64 every system whose pivots say float32 cannot resolve it; a batched
float32 *and* float64 LU on CPU (MKL) was seen to fail outright on such matrices ("pivots must be >= 1"), so no
`torch.linalg.solve` here.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch

from .products import linear, matmul


def ridge_lstsq(
    design: torch.Tensor,
    target: torch.Tensor,
    *,
    ridge: float,
    prior: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``argmin_X ||W (A X - Y)||^2 + lam ||X - X0||^2`` for ``A`` = design ``[G, m, t]``, ``Y`` = target ``[G, m, c]``.

    ``lam = ridge * mean(diag(A^T W^2 A))`` so ``ridge`` is scale free (``ridge=0``: plain least squares by
    ``gelsd``); ``X0`` = ``prior`` (zeros if None) is what
    the fit shrinks towards (the original values, so few queries cannot drag kept entries far). Solved by
    Cholesky on the normal equations (`ridge_solve`: float32, float64 where float32 cannot resolve the system);
    where that fails, by ``gelsd`` on the stacked system.
    """
    a, y = design, target
    if ridge == 0:
        # plain least squares (the proposal's OLS, docs/lossy.md): rank-revealing SVD driver, never the normal equations; singular
        # values below 1e-7 of the largest are cut (with LAPACK's default cut the solutions blew up to inf here)
        a64, y64 = a.double().cpu(), y.double().cpu()
        if not (bool(torch.isfinite(a64).all()) and bool(torch.isfinite(y64).all())):
            raise FloatingPointError("ridge_lstsq: non-finite design or target")
        return torch.linalg.lstsq(a64, y64, rcond=1e-7, driver="gelsd").solution.to(a.device)
    if row_weight is not None:
        a, y = a * row_weight[..., None], y * row_weight[..., None]
    # the products over thousands of queries run in the inputs' precision (fast)
    gram = a.transpose(-1, -2) @ a
    return ridge_solve(gram, a.transpose(-1, -2) @ y, ridge=ridge, prior=prior, design=a, target=y)


def symmetric_gram(columns: torch.Tensor, blocks: int = 3) -> torch.Tensor:
    """``A^T A`` for ``A`` ``[G, m, t]`` given as ``columns`` = ``A^T`` (``[G, t, m]``, contiguous: `products.linear`
    reads rows), from the block rows on and right of the diagonal only (BLAS's syrk, which torch does not expose):
    with 3 column blocks 6 of the 9 block products, ~25 % faster than one product on CPU."""
    t = columns.shape[-2]
    if t < 64 * blocks:
        return linear(columns, columns)
    edges = [t * i // blocks for i in range(blocks + 1)]
    gram = columns.new_empty(*columns.shape[:-2], t, t, dtype=torch.promote_types(columns.dtype, torch.float32))
    for lo, hi in pairwise(edges):
        row = linear(columns[..., lo:hi, :], columns[..., lo:, :])  # [G, hi - lo, t - lo]
        gram[..., lo:hi, lo:] = row
        gram[..., hi:, lo:hi] = row[..., hi - lo:].transpose(-1, -2)
    return gram


#: work counters of `ridge_solve` (tests count work, never time): systems solved by the float32 Cholesky, systems
#: that fell back to float64, systems that needed ``gelsd`` after that
SOLVE_COUNTS = {"float32": 0, "float64": 0, "gelsd": 0}

#: a float32 Cholesky is trusted while the squared ratio of its largest to smallest pivot stays below this. That
#: ratio is an estimate from below of the system's condition number (~50x below on a synthetic test); in the range
#: it admits, the float32 solve is the exact solution of a system perturbed at float32's resolution, the same order
#: as the float32 rounding of the Gram itself (computed in float32 in earlier versions too), so what the fit minimises
#: moves by ~eps^2 * cond. With the default relative ridge (1e-3 of the mean diagonal) SmolLM2's summary systems
#: measured 1e3 (median) to 1.5e5 (largest of 360); the error and perplexity of the reduced setting of
#: docs/lossy.md did not move at 4 decimals against float64.
FLOAT32_CONDITION = 1e6


def ridge_solve(
    gram: torch.Tensor,
    rhs: torch.Tensor,
    *,
    ridge: float,
    prior: torch.Tensor | None = None,
    design: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ridge solve from the normal equations: ``(G + lam I) X = R + lam X0`` for ``G`` = ``gram`` ``[G, t, t]``
    (``A^T W^2 A``) and ``R`` = ``rhs`` ``[G, t, c]`` (``A^T W^2 Y``), ``lam = ridge * mean(diag(G))``.

    A float32 Cholesky first (all systems in one batched call); the systems whose pivots say float32 cannot
    resolve them (or that fail or give non-finite solutions) are solved again in float64, from ``design`` and
    ``target`` (``[G, m, t]``, ``[G, m, c]``; or a function making the design, called only then) when given, so
    the Gram too is float64; what fails even there (the ridge underflowed) goes to ``gelsd`` on the stacked system.
    Returns float32 (float64 where ``gram`` is float64)."""
    t = gram.shape[-1]
    out_dtype = torch.promote_types(gram.dtype, torch.float32)
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None, None]
    x0 = torch.zeros_like(rhs) if prior is None else prior.to(rhs.dtype)
    x = torch.empty(rhs.shape, dtype=out_dtype, device=rhs.device)
    todo = torch.ones(gram.shape[0], dtype=torch.bool, device=gram.device)
    if gram.dtype != torch.float64:
        chol, info = torch.linalg.cholesky_ex(_plus_diagonal(gram.float(), lam.float()))
        pivots = chol.diagonal(dim1=-2, dim2=-1).abs()
        ratio = pivots.amax(-1) / pivots.amin(-1).clamp_min(1e-30)
        x32 = torch.cholesky_solve((rhs + lam * x0).float(), chol)
        ok = (info == 0) & (ratio.square() < FLOAT32_CONDITION) & torch.isfinite(x32).flatten(1).all(-1)
        x = torch.where(ok[:, None, None], x32.to(out_dtype), x)
        todo = ~ok
        SOLVE_COUNTS["float32"] += int(ok.sum())
        if not bool(todo.any()):
            return x
    idx = todo.nonzero()[:, 0]
    x0_64 = x0[idx].double()
    if design is not None and target is not None:
        design = design() if callable(design) else design
        a, y = design[idx].double(), target[idx].double()
        g64, r64 = a.transpose(-1, -2) @ a, a.transpose(-1, -2) @ y
        lam64 = ridge * g64.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None, None]
    else:
        a = y = None
        g64, r64, lam64 = gram[idx].double(), rhs[idx].double(), lam[idx].double()
    chol, info = torch.linalg.cholesky_ex(_plus_diagonal(g64, lam64))
    SOLVE_COUNTS["float64"] += len(idx)
    if bool((info == 0).all()):
        x[idx] = torch.cholesky_solve(r64 + lam64 * x0_64, chol).to(out_dtype)
        return x
    # rank-deficient even with the ridge (lam underflowed): the SVD-based driver copes
    if a is None:
        raise FloatingPointError("ridge_solve: singular system and no design to fall back on")
    SOLVE_COUNTS["gelsd"] += len(idx)
    root = lam64.sqrt() * torch.eye(t, dtype=torch.float64, device=g64.device).expand_as(g64)
    stacked_a = torch.cat([a, root], dim=-2)
    stacked_y = torch.cat([y, lam64.sqrt() * x0_64], dim=-2)
    x[idx] = torch.linalg.lstsq(stacked_a.cpu(), stacked_y.cpu(), driver="gelsd").solution.to(x.device, out_dtype)
    return x


def ridge_solve_wide(
    design: torch.Tensor, target: torch.Tensor, *, ridge: float, prior: torch.Tensor | None = None
) -> torch.Tensor:
    """`ridge_solve`'s problem (``G = A^T A``, ``R = A^T Y``, the same ``lam``) for a *wide* design ``A`` ``[G, m, t]``
    (more unknowns ``t`` than equations ``m``), solved in its dual form: ``X = X0 + A^T (A A^T + lam I)^-1 (Y - A X0)``
    (the push-through identity; ``(A^T A + lam I) A^T = A^T (A A^T + lam I)``). The system is ``m x m`` instead of
    ``t x t``: ``O(m^2 t)`` work and ``m^2`` memory instead of ``O(t^2 m + t^3)`` and ``t^2``. A chunked prefill's
    summary keeps ~0.25 of the tokens seen per head (2,048 at 8k) against 768 reference queries per KV head, so its
    systems grow wide as the context grows (docs/results/lossy.md, "Chunked prefill").

    Same numerics as `ridge_solve`: a float32 Cholesky whose pivots are checked (the dual system's non-zero spectrum
    is the primal's, so its condition number is the same), float64 from ``design`` for the systems float32 cannot
    resolve, ``gelsd`` on the stacked primal system where even that fails. Returns float32 ``[G, t, c]``."""
    a, y = design.float(), target.float()
    t = a.shape[-1]
    x0 = torch.zeros(*a.shape[:-2], t, y.shape[-1], dtype=torch.float32, device=a.device) if prior is None \
        else prior.float()
    kernel = symmetric_gram(a)  # [G, m, m]: A A^T from the blocks on and right of the diagonal
    # lam = ridge * mean(diag(A^T A)) = ridge * trace(A A^T) / t
    lam = ridge * (kernel.diagonal(dim1=-2, dim2=-1).sum(-1) / t).clamp_min(1e-30)[:, None, None]
    residual = y - matmul(a, x0)
    x = torch.empty_like(x0)
    chol, info = torch.linalg.cholesky_ex(_plus_diagonal(kernel, lam))
    pivots = chol.diagonal(dim1=-2, dim2=-1).abs()
    ratio = pivots.amax(-1) / pivots.amin(-1).clamp_min(1e-30)
    x32 = x0 + matmul(a.transpose(-1, -2), torch.cholesky_solve(residual, chol))
    ok = (info == 0) & (ratio.square() < FLOAT32_CONDITION) & torch.isfinite(x32).flatten(1).all(-1)
    x = torch.where(ok[:, None, None], x32, x)
    SOLVE_COUNTS["float32"] += int(ok.sum())
    if bool(ok.all()):
        return x
    idx = (~ok).nonzero()[:, 0]
    a64, y64, x0_64 = a[idx].double(), y[idx].double(), x0[idx].double()
    k64 = a64 @ a64.transpose(-1, -2)
    lam64 = ridge * (k64.diagonal(dim1=-2, dim2=-1).sum(-1) / t).clamp_min(1e-30)[:, None, None]
    chol, info = torch.linalg.cholesky_ex(_plus_diagonal(k64, lam64))
    SOLVE_COUNTS["float64"] += len(idx)
    if bool((info == 0).all()):
        x[idx] = (x0_64 + a64.transpose(-1, -2) @ torch.cholesky_solve(y64 - a64 @ x0_64, chol)).float()
        return x
    SOLVE_COUNTS["gelsd"] += len(idx)
    root = lam64.sqrt() * torch.eye(t, dtype=torch.float64, device=a.device).expand(len(idx), t, t)
    stacked_a, stacked_y = torch.cat([a64, root], dim=-2), torch.cat([y64, lam64.sqrt() * x0_64], dim=-2)
    x[idx] = torch.linalg.lstsq(stacked_a.cpu(), stacked_y.cpu(), driver="gelsd").solution.to(x.device, x.dtype)
    return x


def _plus_diagonal(gram: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``gram + lam I`` (``lam`` ``[G, 1, 1]``) as one new ``[G, t, t]`` tensor: the same values as adding ``lam``
    times an identity, without the identity and the product, two more ``t x t`` temporaries per head (a chunked
    prefill's summaries fit ~1,900 entries per head at 8k tokens: 14 MB each; docs/results/lossy.md, "Chunked
    prefill")."""
    out = gram.clone() if gram.is_contiguous() else gram.contiguous()
    out.diagonal(dim1=-2, dim2=-1).add_(lam[..., 0])
    return out


def nnls(
    design: torch.Tensor,
    target: torch.Tensor,
    *,
    init: torch.Tensor | None = None,
    iters: int = 200,
    gram: torch.Tensor | None = None,
) -> torch.Tensor:
    """``argmin_{w >= 0} ||A w - z||`` for ``A`` = design ``[G, m, t]`` (non-negative), ``z`` = target ``[G, m]``.

    Multiplicative updates (Lee & Seung): every step keeps ``w`` non-negative without an active set, works on the
    whole batch at once and only needs ``A^T A`` and ``A^T z`` (t x t), so it stays cheap for thousands of queries.
    ``gram``: ``A^T A`` when the caller has it already (a summary fit shares it with the value refit); without one
    a wide ``A`` (``t > m``) is never formed into a Gram.
    """
    a = design.float()
    # a wide design (more entries than queries, as a chunked prefill's summary grows): ``A^T (A w)``, two mat-vecs
    # of ``m t`` each, in place of the ``t x t`` Gram (``t^2 m`` to build, ``t^2`` per iteration)
    wide = gram is None and a.shape[-1] > a.shape[-2]
    # float32 on purpose: the iteration is a memory-bound batched mat-vec; the update is self-correcting
    if not wide:
        gram = a.transpose(-1, -2) @ a if gram is None else gram.float()
    # as a row vector times A: A is read along its rows (A^T z as a transposed mat-vec took 13x longer)
    atz = (target.float()[..., None, :] @ a)[..., 0, :].clamp_min(0.0)
    w = torch.ones(a.shape[0], a.shape[-1]) if init is None else init.float().clone()
    # a zero start can never move under multiplicative updates: give such weights a small foothold
    w = torch.where(w > 0, w, torch.full_like(w, 1e-3))
    # one system at a time: its t x t Gram (1.4 MB at t = 600) stays in the core's cache for all the iterations,
    # where a batched product streams every head's Gram from memory at each one (1.8x faster for 3 heads x 600)
    out = []
    for i, (wi, zi) in enumerate(zip(w, atz)):
        g, ai = (None, a[i]) if wide else (gram[i], None)
        for _ in range(iters):
            wi = wi * zi / ((ai.transpose(-1, -2) @ (ai @ wi)) if wide else (g @ wi)).clamp_min(1e-30)
        out.append(wi)
    return torch.stack(out) if out else w


def truncated_svd(x: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U S, W)`` of the rank-``rank`` truncated SVD of ``x`` (``[..., n, d]``, computed in float32), in ``dtype``:
    ``x ~ (U S) @ W`` with ``U S`` ``[..., n, rank]`` and ``W`` ``[..., rank, d]`` (Eckart-Young: the best rank-r
    approximation in Frobenius norm)."""
    u, s, vh = torch.linalg.svd(x.float(), full_matrices=False)
    return (u[..., :rank] * s[..., None, :rank]).to(dtype), vh[..., :rank, :].contiguous().to(dtype)
