"""The fused attention-score kernels against their torch reference and against the materialised formula that
hf_kvcompress.lossy uses (mass and column entropy of each entry's attention over reference queries).

Stated tolerance (float32, other summation order): |delta entropy| <= 1e-4 nats, |delta mass| <= 1e-5 +
1e-4 * mass."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import BACKENDS

from hf_kvcompress import kernels
from hf_kvcompress.kernels.attention import attention_scores_reference

ENTROPY_ATOL = 1e-4
MASS_ATOL, MASS_RTOL = 1e-5, 1e-4


def _case(b=2, h=3, m=20, n=70, c=9, d=64, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, m, d, generator=g)
    qw = torch.rand(b, h, m, generator=g)
    qw[0, 0, :3] = 0  # padding queries
    keys = (torch.randn(b, h, n, d, generator=g) * 1.5).to(dtype)
    bias = torch.zeros(b, h, n)
    bias[:, :, 5] = float("-inf")  # a dead entry
    bias[:, :, 7] = 0.7  # an earlier summary's fitted weight
    ctx = torch.randn(b, h, c, d, generator=g).to(dtype)
    return q, qw, keys, bias, ctx, torch.zeros(b, h, c), d**-0.5


def _materialised(q, qw, keys, bias, ctx, cbias, scaling):
    """hf_kvcompress.lossy.matching.Kernel's formulas, the full [m, n] matrix at once."""
    lr = q @ keys.float().transpose(-1, -2) * scaling + bias[..., None, :]
    lc = q @ ctx.float().transpose(-1, -2) * scaling + cbias[..., None, :]
    top = torch.cat([lr, lc], -1).amax(-1, keepdim=True)
    re, ce = (lr - top).exp(), (lc - top).exp()
    share = re / (re.sum(-1) + ce.sum(-1))[..., None]
    mass = (share * qw[..., None]).sum(-2) / qw[..., None].sum(-2).clamp_min(1e-12)
    w = share * qw[..., None]
    col = w / w.sum(-2, keepdim=True).clamp_min(1e-30)
    return mass, -(col * col.clamp_min(1e-30).log()).sum(-2)


def _close(a, b, live):
    (ma, ea), (mb, eb) = a, b
    assert ((ma - mb).abs() <= MASS_ATOL + MASS_RTOL * mb.abs()).all()
    assert ((ea - eb)[live].abs() <= ENTROPY_ATOL).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_the_lossy_formula(backend):
    case = _case()
    live = torch.isfinite(case[3])
    with kernels.forced(backend):
        got = kernels.attention_scores(*case)
    _close(got, _materialised(*case), live)
    assert (got[0][~live] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_without_bias_odd_head_dim_and_tiny_chunks(backend):
    q, qw, keys, _, ctx, _, _ = _case(b=1, h=2, m=37, n=45, c=3, d=40, seed=1, dtype=torch.float32)
    scaling = 40**-0.5
    with kernels.forced(backend):
        got = kernels.attention_scores(q, qw, keys, None, ctx, None, scaling)
    ref = attention_scores_reference(q, qw, keys, None, ctx, None, scaling, chunk=8)  # chunking: same answer
    _close(got, ref, torch.ones_like(ref[1], dtype=torch.bool))
    _close(ref, _materialised(q, qw, keys, torch.zeros(1, 2, 45), ctx, torch.zeros(1, 2, 3), scaling),
           torch.ones_like(ref[1], dtype=torch.bool))


def test_reference_streams_long_caches_in_chunks():
    """Memory: the reference never holds more than queries x chunk logits (the kernel: one tile)."""
    q, qw, keys, bias, ctx, cbias, scaling = _case(b=1, h=1, m=8, n=3000, c=4, seed=2)
    full = attention_scores_reference(q, qw, keys, bias, ctx, cbias, scaling, chunk=4096)
    small = attention_scores_reference(q, qw, keys, bias, ctx, cbias, scaling, chunk=256)
    _close(small, full, torch.isfinite(bias))
