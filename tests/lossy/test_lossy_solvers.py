"""The summary fit's numerical paths (docs/lossy.md, *Numerics*): the float32 Cholesky and its float64 fallback, the symmetric Gram,
one Gram shared by NNLS and the value refit, the refit that reuses the first fit's Gram, and the dual (``m x m``)
form of wide systems (more kept entries than reference queries). Work is counted (`solvers.SOLVE_COUNTS`), never
timed."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress.config import LossyConfig
from hf_kvcompress.lossy import solvers
from hf_kvcompress.lossy.matching import Kernel, fit_row
from hf_kvcompress.lossy.region import FitContext, Region
from hf_kvcompress.lossy.scores import top_entries
from hf_kvcompress.lossy.solvers import nnls, ridge_solve, ridge_solve_wide, symmetric_gram


def reference(gram: torch.Tensor, rhs: torch.Tensor, ridge: float, prior: torch.Tensor) -> torch.Tensor:
    g = gram.double()
    lam = ridge * g.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
    eye = torch.eye(g.shape[-1], dtype=torch.float64)
    return torch.linalg.solve(g + lam * eye, rhs.double() + lam * prior.double())


def counts() -> dict[str, int]:
    return dict(solvers.SOLVE_COUNTS)


def spent(before: dict[str, int]) -> dict[str, int]:
    return {k: solvers.SOLVE_COUNTS[k] - before[k] for k in before}


def ill_conditioned(gen: torch.Generator, m: int = 96, t: int = 40, c: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 design whose columns are nearly collinear (singular values down to 1e-5 of the largest)."""
    u, _ = torch.linalg.qr(torch.randn(m, t, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(t, t, generator=gen, dtype=torch.float64))
    a = u @ torch.diag(torch.logspace(0, -5, t, dtype=torch.float64)) @ v.T
    x = torch.randn(t, c, generator=gen, dtype=torch.float64)
    return a.float(), (a @ x).float()


def test_well_conditioned_systems_stay_in_float32():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 200, 30, generator=gen)
    y = torch.randn(3, 200, 5, generator=gen)
    prior = torch.randn(3, 30, 5, generator=gen)
    gram, rhs = a.mT @ a, a.mT @ y
    before = counts()
    x = ridge_solve(gram, rhs, ridge=1e-3, prior=prior, design=a, target=y)
    assert spent(before) == {"float32": 3, "float64": 0, "gelsd": 0}
    assert x.dtype == torch.float32
    torch.testing.assert_close(x.double(), reference(gram, rhs, 1e-3, prior), atol=1e-4, rtol=1e-4)


def test_ill_conditioned_system_falls_back_to_float64():
    """One well- and one ill-conditioned system in one batch: only the second is solved again, in float64 from the
    design (Gram included), and its solution is the float64 one, which the float32 Cholesky does not reach."""
    gen = torch.Generator().manual_seed(1)
    good = torch.randn(96, 40, generator=gen)
    bad, y_bad = ill_conditioned(gen)
    a = torch.stack([good, bad])
    y = torch.stack([torch.randn(96, 8, generator=gen), y_bad])
    gram, rhs, prior = a.mT @ a, a.mT @ y, torch.zeros(2, 40, 8)
    ridge = 1e-8
    a64, y64 = a.double(), y.double()
    expected = reference(a64.mT @ a64, a64.mT @ y64, ridge, prior)
    before = counts()
    x = ridge_solve(gram, rhs, ridge=ridge, prior=prior, design=lambda: a, target=y)
    assert spent(before) == {"float32": 1, "float64": 1, "gelsd": 0}
    relative = ((x.double() - expected).norm(dim=(-1, -2)) / expected.norm(dim=(-1, -2)))
    assert relative.max() < 1e-6
    # the float32 Cholesky alone breaks down or is far off on the ill-conditioned system: the fallback fixes it
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
    chol, info = torch.linalg.cholesky_ex(gram + lam * torch.eye(40))
    plain = torch.cholesky_solve(rhs, chol)[1].double()
    assert int(info[1]) != 0 or not bool((plain - expected[1]).norm() / expected[1].norm() < 1e-4)


def test_without_design_the_fallback_solves_the_gram_in_float64():
    gen = torch.Generator().manual_seed(1)
    bad, y = ill_conditioned(gen)
    gram, rhs, prior = (bad.mT @ bad)[None], (bad.mT @ y)[None], torch.zeros(1, 40, 8)
    before = counts()
    x = ridge_solve(gram, rhs, ridge=3e-7, prior=prior)
    assert spent(before) == {"float32": 0, "float64": 1, "gelsd": 0}
    expected = reference(gram, rhs, 3e-7, prior)
    assert (x.double() - expected).norm() / expected.norm() < 1e-6


def test_symmetric_gram_equals_the_product():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(2, 50, 250, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(symmetric_gram(a.mT.contiguous()), a.mT @ a, atol=1e-10, rtol=1e-10)
    small = a[..., :20]
    torch.testing.assert_close(symmetric_gram(small.mT.contiguous()), small.mT @ small, atol=1e-10, rtol=1e-10)


def fit_setup(seed: int = 3, h: int = 2, n: int = 60, d: int = 16, m: int = 90, context_len: int = 6):
    gen = torch.Generator().manual_seed(seed)
    region = Region(torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen),
                    torch.zeros(1, h, n), n)
    ctx = FitContext(torch.randn(1, h, m, d, generator=gen), torch.rand(1, h, m, generator=gen) + 0.5,
                     torch.randn(1, h, context_len, d, generator=gen), torch.randn(1, h, context_len, d, generator=gen),
                     torch.zeros(1, h, context_len), d**-0.5, True, LossyConfig())
    kernel = Kernel(region, ctx)
    return region, kernel


@pytest.mark.parametrize("queries", [90, 16])
def test_value_refit_solves_the_stated_weighted_problem(queries):
    """The value refit shares NNLS's Gram: ``sum_j (w_j e_qj / Z^) c_j ~ o - N_ctx / Z^`` with each query's row
    weighted by ``sqrt(query weight) Z^ / Z``. Checked against that problem built explicitly in float64; with 16
    queries for 24 kept entries the fit is wide and runs in the dual form, with no Gram."""
    region, kernel = fit_setup(m=queries)
    index = top_entries(kernel.mass(), 24)
    ridge = 1e-3
    fit = fit_row(kernel, region, index, use_bias=True, ridge=ridge)
    assert (fit.gram is None) == (queries < 24)
    w = fit.bias.exp().double()  # [1, h, t]
    e = torch.gather(kernel.region_exp, -1, index[..., None, :].expand(1, 2, kernel.region_exp.shape[-2], -1)).double()
    z_hat = kernel.context_z.double() + (e * w[..., None, :]).sum(-1)
    z = kernel.full_z.double()
    row = kernel.query_weight.double().sqrt() * z_hat / z
    design = (e * w[..., None, :] / z_hat[..., None]) * row[..., None]
    target = (kernel.output.double() - kernel.context_n.double() / z_hat[..., None]) * row[..., None]
    gram, rhs = design.mT @ design, design.mT @ target
    prior = torch.gather(region.values, 2, index[..., None].expand(1, 2, 24, 16)).double()
    expected = reference(gram[0], rhs[0], ridge, prior[0])[None]
    relative = (fit.values.double() - expected).norm() / expected.norm()
    assert relative < 1e-3
    # and the normalised weights the rank test reads are the kept entries' attention in the summary
    torch.testing.assert_close(fit.weights.double(), e * w[..., None, :] / z_hat[..., None], atol=1e-5, rtol=1e-4)


def test_refit_reusing_the_first_fit_gram_equals_a_fresh_fit():
    region, kernel = fit_setup(seed=4)
    score = kernel.mass()
    first_index = top_entries(score, 20)
    first = fit_row(kernel, region, first_index, use_bias=True, ridge=1e-3)
    taken = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, first_index, True)
    added = top_entries(score.masked_fill(taken, float("-inf")), 8)
    index = torch.cat([first_index, added], -1)
    reused = fit_row(kernel, region, index, use_bias=True, ridge=1e-3, prefix=first, weights=False)
    fresh = fit_row(kernel, region, index, use_bias=True, ridge=1e-3)
    torch.testing.assert_close(reused.gram, fresh.gram, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(reused.values, fresh.values, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(reused.bias, fresh.bias, atol=1e-5, rtol=1e-5)


def test_wide_systems_are_solved_in_the_dual_form():
    """``t > m``: `ridge_solve_wide` gives the primal ridge solution (the same ``lam``) from the ``m x m`` system,
    in float32 when its pivots allow; an ill-conditioned one falls back to float64 like `ridge_solve`."""
    gen = torch.Generator().manual_seed(5)
    a = torch.rand(3, 40, 120, generator=gen)
    y, prior = torch.randn(3, 40, 8, generator=gen), torch.randn(3, 120, 8, generator=gen)
    a64 = a.double()
    expected = reference(a64.mT @ a64, a64.mT @ y.double(), 1e-3, prior)
    before = counts()
    x = ridge_solve_wide(a, y, ridge=1e-3, prior=prior)
    assert spent(before) == {"float32": 3, "float64": 0, "gelsd": 0} and x.shape == (3, 120, 8)
    assert ((x.double() - expected).norm(dim=(-1, -2)) / expected.norm(dim=(-1, -2))).max() < 2e-3
    bad = ill_conditioned(gen)[0].mT.contiguous()  # [40, 96]: singular values down to 1e-5 of the largest
    y_bad = bad @ torch.randn(96, 8, generator=gen)
    bad64 = bad.double()
    expected = reference((bad64.mT @ bad64)[None], (bad64.mT @ y_bad.double())[None], 1e-9, torch.zeros(1, 96, 8))
    before = counts()
    x = ridge_solve_wide(bad[None], y_bad[None], ridge=1e-9)
    assert spent(before)["float64"] == 1
    assert (x.double() - expected).norm() / expected.norm() < 1e-4


def test_nnls_of_a_wide_design_needs_no_gram():
    """Without a Gram, a wide design runs the multiplicative updates as ``A^T (A w)``: the iterates of the Gram form."""
    gen = torch.Generator().manual_seed(6)
    a, z = torch.rand(2, 30, 80, generator=gen), torch.rand(2, 30, generator=gen)
    torch.testing.assert_close(nnls(a, z, iters=40), nnls(a, z, iters=40, gram=a.mT @ a), atol=1e-6, rtol=1e-4)
