"""`lossy.products`: the summary's float32 products through oneDNN where torch has it (docs/lossy.md, *Speed and
queries*). Results are checked against ``torch.matmul``; which path ran is counted (`products.COUNTS`), never
timed."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress.config import LossyConfig
from hf_kvcompress.lossy import products
from hf_kvcompress.lossy.matching import Kernel, fit_row
from hf_kvcompress.lossy.products import linear, matmul
from hf_kvcompress.lossy.region import FitContext, Region
from hf_kvcompress.lossy.scores import top_entries


def spent(before: dict[str, int]) -> dict[str, int]:
    return {k: products.COUNTS[k] - before[k] for k in before}


@pytest.mark.parametrize(
    ("x_shape", "w_shape"),
    [((7, 5), (3, 5)), ((2, 3, 7, 5), (2, 3, 4, 5)), ((1, 3, 7, 5), (3, 4, 5)), ((2, 7, 5), (4, 5))],
)
def test_linear_and_matmul_equal_torch_matmul(x_shape, w_shape):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(*x_shape, generator=gen), torch.randn(*w_shape, generator=gen)
    out = linear(x, w)
    torch.testing.assert_close(out, x @ w.mT, atol=1e-5, rtol=1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(matmul(x, w.mT), x @ w.mT, atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs_are_multiplied_in_float32_and_float64_stays_float64():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 8, generator=gen), torch.randn(5, 8, generator=gen)
    got = linear(x, w.bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w.bfloat16().float().mT, atol=1e-5, rtol=1e-5)
    before = dict(products.COUNTS)
    got64 = linear(x.double(), w.double())
    assert got64.dtype == torch.float64 and spent(before) == {"onednn": 0, "matmul": 1}
    torch.testing.assert_close(got64, x.double() @ w.double().mT, atol=1e-12, rtol=1e-12)


def test_matmul_wherever_onednn_is_off_or_refuses(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 6, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.mkldnn, "enabled", False)
        before = dict(products.COUNTS)
        torch.testing.assert_close(linear(x, w), x @ w.mT)
        assert spent(before) == {"onednn": 0, "matmul": 1}
    assert torch.backends.mkldnn.enabled

    def refuse(x, w):
        raise RuntimeError("refused")

    monkeypatch.setattr(products, "_onednn", refuse)
    monkeypatch.setattr(products, "_ONEDNN", True)
    before = dict(products.COUNTS)
    torch.testing.assert_close(linear(x, w), x @ w.mT)
    assert spent(before) == {"onednn": 0, "matmul": 1}


def test_empty_products():
    assert linear(torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 3, 4)).shape == (1, 2, 0, 3)
    assert linear(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 0, 4)).shape == (1, 2, 5, 0)
    torch.testing.assert_close(linear(torch.zeros(3, 0), torch.zeros(2, 0)), torch.zeros(3, 2))


def test_the_summary_fit_runs_its_products_through_onednn_where_torch_has_it():
    """Kernel logits and output, the Gram, the refit's right-hand side: one oneDNN product per head each (the
    check `_onednn_ok` passed), else all of them through ``torch.matmul``."""
    gen = torch.Generator().manual_seed(3)
    h, n, d, m = 2, 60, 16, 90
    region = Region(torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen),
                    torch.zeros(1, h, n), n)
    context = torch.randn(1, h, 6, d, generator=gen)
    ctx = FitContext(torch.randn(1, h, m, d, generator=gen), torch.ones(1, h, m), context,
                     torch.randn(1, h, 6, d, generator=gen), torch.zeros(1, h, 6), d**-0.5, True, LossyConfig())
    before = dict(products.COUNTS)
    kernel = Kernel(region, ctx)
    fit_row(kernel, region, top_entries(kernel.mass(), 24), use_bias=True, ridge=1e-3)
    used = spent(before)
    if products._onednn_ok():
        assert used["onednn"] >= 2 * 4 and used["matmul"] == 0  # 2 heads x (2 logits, Gram, right-hand side)
    else:
        assert used["onednn"] == 0 and used["matmul"] >= 4


def test_exp_logits_one_head_at_a_time_equals_the_whole_computation():
    """`FitContext.exp_logits` (per head, exp written in place) against the logits of all heads at once: biases
    (with a dead entry), the row maximum taken with the other entries' (``floor``), a row with nothing live."""
    gen = torch.Generator().manual_seed(5)
    h, n, d, m = 3, 40, 16, 12
    keys = torch.randn(1, h, n, d, generator=gen)
    bias = torch.randn(1, h, n, generator=gen)
    bias[0, 1, 7] = float("-inf")
    ctx = FitContext(torch.randn(1, h, m, d, generator=gen), torch.ones(1, h, m), keys[..., :0, :], keys[..., :0, :],
                     bias[..., :0], d**-0.5, True, LossyConfig())
    floor = torch.randn(1, h, m, 1, generator=gen) + 2.0
    got, top = ctx.exp_logits(keys, bias, floor)
    logits = ctx.logits(keys, bias)
    expected_top = torch.maximum(logits.amax(-1, keepdim=True), floor)
    torch.testing.assert_close(top, expected_top)
    torch.testing.assert_close(got, (logits - expected_top).exp())
    assert bool((got[0, 1, :, 7] == 0).all())
    dead, dead_top = ctx.exp_logits(keys, torch.full_like(bias, float("-inf")), None)
    assert bool((dead == 0).all()) and bool((dead_top == 0).all())


def test_shape_buckets_are_few_and_waste_at_most_an_eighth():
    sizes = range(1, 5000)
    buckets = [products.shape_bucket(n) for n in sizes]
    assert all(n <= b <= (n * 9 // 8 if n > 64 else -(-n // 16) * 16) for n, b in zip(sizes, buckets))
    assert [products.shape_bucket(n) for n in (1, 15, 16, 17, 64, 65, 2048, 2049)] == [1, 15, 16, 32, 64, 72, 2048, 2304]
    assert len(set(buckets)) <= 16 + 3 + 8 * 7  # sizes below 16 as they are, 32 / 48 / 64, eight per octave up to 8,192
    assert all(products.shape_bucket(b) == b for b in set(buckets))


@pytest.mark.skipif(not products._onednn_ok(), reason="this torch has no oneDNN float32 product")
def test_a_growing_region_meets_few_product_shapes_with_the_same_results():
    """The sizes a chunked prefill's summaries meet (the region grows by a few entries per chunk) reach oneDNN in a few
    padded shapes (`products.SHAPES`), each product equal to ``torch.matmul``'s and to its own unpadded oneDNN
    product."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(96, 16, generator=gen)
    products.SHAPES.clear()
    for n in range(200, 400, 7):  # 29 region sizes
        keys = torch.randn(n, 16, generator=gen)
        got = linear(q, keys)
        assert got.shape == (96, n) and got.is_contiguous() and got.untyped_storage().nbytes() == 96 * n * 4
        torch.testing.assert_close(got, q @ keys.T, atol=1e-5, rtol=1e-5)
        assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(q, keys, None, "none", [], ""))
        out = matmul(got, keys)  # the inner size grows too
        torch.testing.assert_close(out, got @ keys, atol=1e-3, rtol=1e-5)
    # 29 sizes in [200, 400) fall in 10 buckets (eight per octave), two products each: 58 shapes unpadded
    assert len(products.SHAPES) <= 2 * 10
