"""Batched least-squares solvers for summary fits.

Everything here works on a leading batch dimension (batch rows x KV heads) and in float64: the systems are
ill-conditioned (attention kernels of neighbouring keys are nearly collinear), and a batched float32 LU on CPU
(MKL) was seen to fail outright on such matrices ("pivots must be >= 1"), so no `torch.linalg.solve` here.
"""

from __future__ import annotations

import torch


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
    Cholesky on the float64 normal equations; where that fails, by ``gelsd`` on the stacked system.
    """
    a, y = design, target
    if ridge == 0:
        # plain least squares (the seed's OLS): rank-revealing SVD driver, never the normal equations; singular
        # values below 1e-7 of the largest are cut (with LAPACK's default cut the solutions blew up to inf here)
        a64, y64 = a.double().cpu(), y.double().cpu()
        if not (bool(torch.isfinite(a64).all()) and bool(torch.isfinite(y64).all())):
            raise FloatingPointError("ridge_lstsq: non-finite design or target")
        return torch.linalg.lstsq(a64, y64, rcond=1e-7, driver="gelsd").solution.to(a.device)
    if row_weight is not None:
        a, y = a * row_weight[..., None], y * row_weight[..., None]
    x0 = torch.zeros(a.shape[0], a.shape[-1], y.shape[-1], dtype=torch.float64) if prior is None else prior.double()
    # the products over thousands of queries run in the inputs' precision (fast); the solve runs in float64
    gram = (a.transpose(-1, -2) @ a).double()
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None, None]
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    rhs = (a.transpose(-1, -2) @ y).double() + lam * x0
    chol, info = torch.linalg.cholesky_ex(gram + lam * eye)
    if bool((info == 0).all()):
        return torch.cholesky_solve(rhs, chol)
    # rank-deficient even with the ridge (lam underflowed): the SVD-based driver copes
    a, y = a.double(), y.double()
    root = lam.sqrt() * eye.expand_as(gram)
    stacked_a = torch.cat([a, root], dim=-2)
    stacked_y = torch.cat([y, lam.sqrt() * x0], dim=-2)
    return torch.linalg.lstsq(stacked_a.cpu(), stacked_y.cpu(), driver="gelsd").solution.to(a.device)


def nnls(
    design: torch.Tensor,
    target: torch.Tensor,
    *,
    init: torch.Tensor | None = None,
    iters: int = 200,
) -> torch.Tensor:
    """``argmin_{w >= 0} ||A w - z||`` for ``A`` = design ``[G, m, t]`` (non-negative), ``z`` = target ``[G, m]``.

    Multiplicative updates (Lee & Seung): every step keeps ``w`` non-negative without an active set, works on the
    whole batch at once and only needs ``A^T A`` and ``A^T z`` (t x t), so it stays cheap for thousands of queries.
    """
    a = design.float()
    # float32 on purpose: the iteration is a memory-bound batched mat-vec; the update is self-correcting
    gram = a.transpose(-1, -2) @ a
    atz = (a.transpose(-1, -2) @ target.float()[..., None])[..., 0].clamp_min(0.0)
    w = torch.ones(a.shape[0], a.shape[-1]) if init is None else init.float().clone()
    # a zero start can never move under multiplicative updates: give such weights a small foothold
    w = torch.where(w > 0, w, torch.full_like(w, 1e-3))
    for _ in range(iters):
        denom = torch.bmm(gram, w[..., None])[..., 0]
        w = w * atz / denom.clamp_min(1e-30)
    return w
