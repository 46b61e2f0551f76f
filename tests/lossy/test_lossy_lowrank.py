"""Summaries on exactly low-rank data reconstruct the attention output (to 1e-4)."""

from __future__ import annotations

import torch

from hf_kvcompress.config import LossyConfig
from hf_kvcompress.lossy.blocks import LossyBlock, LowRankBlock, block_bias
from hf_kvcompress.lossy.budget import token_bytes
from hf_kvcompress.lossy.methods import summary, svd
from hf_kvcompress.lossy.region import FitContext, Region


def low_rank(b, h, n, d, rank, gen):
    return (torch.randn(b, h, n, rank, generator=gen) @ torch.randn(b, h, rank, d, generator=gen)).double()


def context(region, queries, config, context_len=0):
    b, h, _, d = region.keys.shape
    gen = torch.Generator().manual_seed(9)
    ck = torch.randn(b, h, context_len, d, generator=gen, dtype=torch.float64)
    cv = torch.randn(b, h, context_len, d, generator=gen, dtype=torch.float64)
    return FitContext(queries, torch.ones(queries.shape[:-1]), ck, cv, torch.zeros(b, h, context_len),
                      d**-0.5, True, config)


def attention(q, keys, values, bias, ctx):
    k = torch.cat([ctx.context_keys, keys], -2).double()
    v = torch.cat([ctx.context_values, values], -2).double()
    full_bias = torch.cat([ctx.context_bias, bias], -1).double()
    logits = q.double() @ k.transpose(-1, -2) * ctx.scaling + full_bias[..., None, :]
    return torch.softmax(logits, -1) @ v


def read(block):
    k, v = block.read()
    bias = block_bias(block)
    return k, v, torch.zeros(k.shape[:-1], dtype=torch.float64) if bias is None else bias.double()


def test_svd_method_is_exact_on_low_rank_keys_and_values():
    gen = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 2, 48, 16
    region = Region(low_rank(b, h, n, d, 3, gen), low_rank(b, h, n, d, 3, gen), torch.zeros(b, h, n), n)
    budget = 2 * h * 3 * (n + d) * 8  # exactly rank 3 in float64
    blocks = svd.compress(region, budget, None)
    assert isinstance(blocks[0], LowRankBlock) and blocks[0].rank == 3
    assert blocks[0].nbytes() <= b * budget
    q = torch.randn(b, h, 20, d, generator=gen, dtype=torch.float64)
    ctx = context(region, q, LossyConfig())
    expected = attention(q, region.keys, region.values, region.bias, ctx)
    got = attention(q, *read(blocks[0]), ctx)
    assert (got - expected).abs().max() < 1e-4
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_summary_rank_stage_is_exact_on_low_rank_values():
    """Values of rank 2: at full rank only ~50 % of the entries fit the budget, at rank 2 all of them do, so the
    SVD stage keeps every entry and the output is reproduced exactly."""
    gen = torch.Generator().manual_seed(1)
    b, h, n, d = 1, 2, 40, 16
    keys = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    values = low_rank(b, h, n, d, 2, gen)
    region = Region(keys, values, torch.zeros(b, h, n), n)
    elem = 8
    budget = int(0.7 * n * token_bytes(h, d, elem))
    config = LossyConfig(method="summary", error_tolerance=1e-3, ridge=1e-9)
    q = torch.randn(b, h, 64, d, generator=gen, dtype=torch.float64).float()
    ctx = context(region, q, config)
    blocks = summary.compress(region, budget, ctx)
    block = blocks[0]
    assert isinstance(block, LossyBlock) and isinstance(block.values, tuple)
    assert block.values[0].shape[-1] == 2 and block.entries == n
    assert block.nbytes() <= budget
    held_out = torch.randn(b, h, 32, d, generator=gen, dtype=torch.float64)
    expected = attention(held_out, region.keys, region.values, region.bias, ctx)
    got = attention(held_out, *read(block), ctx)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
