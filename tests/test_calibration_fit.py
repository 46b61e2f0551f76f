"""The calibration fit's linear algebra against plain reference computations."""

from __future__ import annotations

import torch

from hf_kvcompress.calibration import ALPHAS, RIDGE, SIGMA_FLOOR, fit_alpha, ridge_factor, ridge_solve


def test_one_cholesky_factor_solves_every_prefix():
    torch.manual_seed(0)
    z = torch.cat([torch.ones(500, 1), torch.randn(500, 40) * torch.logspace(-3, 2, 40)], dim=1).double()
    gram = z.T @ z
    factor = ridge_factor(gram)
    assert factor is not None
    for n_feat in (1, 5, 17, 33):
        a = gram[:n_feat, :n_feat].clone()
        a[1:, 1:] += torch.diag(RIDGE * a.diagonal()[1:])
        want = torch.linalg.solve(a, gram[:n_feat, 33:41])
        got = ridge_solve(gram, factor, n_feat, 33, 8)
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
        assert torch.allclose(ridge_solve(gram, None, n_feat, 33, 8), want, rtol=1e-9, atol=1e-12)


def test_the_surprise_exponent_is_the_one_of_least_code_length():
    torch.manual_seed(1)
    surprise = [torch.rand(200) * 3 + 0.3 for _ in range(2)]
    for true_alpha in (0.0, 0.5, 1.0):
        residuals = [torch.randn(200, 8, dtype=torch.float64) * g.double().pow(true_alpha)[:, None] for g in surprise]
        log_g = float(sum(g.double().log().sum() for g in surprise))
        costs = []
        for alpha in ALPHAS:
            ss = sum(((r / g.double().pow(alpha)[:, None]) ** 2).sum(0) for r, g in zip(residuals, surprise))
            var = (ss / 400).clamp_min(SIGMA_FLOOR**2)
            costs.append((0.5 * float(var.log().sum()) + alpha * log_g * 8 / 400, alpha, var.sqrt()))
        _, want_alpha, want_sigma = min(costs, key=lambda c: c[0])
        alpha, sigma = fit_alpha(residuals, surprise, 400)
        assert alpha == want_alpha == true_alpha
        assert torch.allclose(sigma, want_sigma, rtol=1e-12)
