"""The baselines' scores on hand-made cases, against each paper's own description of them (issue 36)."""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from helpers import fresh_tiny_model, random_ids
from lossy_testutil import walked_bytes

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.blocks import RaggedBlock
from hf_kvcompress.lossy.methods import adakv, expected_attention, pyramidkv, snapkv, tova
from hf_kvcompress.lossy.queries import rotate
from hf_kvcompress.lossy.region import FitContext, Region

D = 8


def _ctx(queries, positions, context_keys=None, inv_freq=None, now=0, **config):
    b, h = queries.shape[:2]
    context_keys = torch.zeros(b, h, 0, D) if context_keys is None else context_keys
    return FitContext(queries, torch.ones(queries.shape[:-1]), context_keys, torch.ones_like(context_keys),
                      torch.zeros(context_keys.shape[:-1]), 1.0, True, LossyConfig(**config), positions, now, inv_freq)


def _region(keys, values=None):
    values = torch.ones_like(keys) if values is None else values
    return Region(keys, values, torch.zeros(keys.shape[:-1]), tokens=keys.shape[-2])


def _softmax_weights(queries, keys):
    return torch.softmax(queries @ keys.transpose(-1, -2), dim=-1)


def test_snapkv_votes_of_the_observation_window_pooled_over_neighbours():
    """Only the last WINDOW queries vote (summed attention weights), and max-pooling hands an entry's vote to its
    KERNEL // 2 neighbours on each side: with a window of 2 and a kernel of 3, entry 10, attended by the window, keeps
    9..11; entry 3, attended only by an older query, scores like any other entry."""
    n = 20
    keys = torch.randn(1, 1, n, D, generator=torch.Generator().manual_seed(0)) * 0.1
    keys[0, 0, 3] = 5 * F.one_hot(torch.tensor(0), D).float()
    keys[0, 0, 10] = 5 * F.one_hot(torch.tensor(1), D).float()
    queries = torch.zeros(1, 1, 6, D)  # one query head, six queries; the last two form the window
    queries[0, 0, :4, 0] = 3.0  # the older queries look at entry 3
    queries[0, 0, 4:, 1] = 3.0  # the window looks at entry 10
    region = _region(keys)
    ctx = _ctx(queries, torch.arange(6))
    got = snapkv.snap_scores(region, ctx, window=2, kernel=3)
    votes = _softmax_weights(queries[..., 4:, :], keys).mean(-2)  # the window's mean weight per entry
    expected = F.max_pool1d(votes, 3, stride=1, padding=1)
    torch.testing.assert_close(got, expected)
    kept = got[0, 0].topk(3).indices.sort().values
    assert kept.tolist() == [9, 10, 11]
    assert got[0, 0, 3] < got[0, 0, 10] / 10


def test_tova_keeps_what_the_newest_query_attends_to_averaged_over_heads():
    """Two KV heads: head 0's newest query looks at entry 2, head 1's at entry 5, both weakly; the older queries
    strongly at entry 7. TOVA keeps the same positions in both heads, chosen by the head-averaged weights of the
    newest query only: 2 and 5, not 7."""
    n = 9
    keys = torch.zeros(1, 2, n, D)
    for head, entry, channel in ((0, 2, 0), (1, 5, 1), (0, 7, 2), (1, 7, 2)):
        keys[0, head, entry, channel] = 1.0
    queries = torch.zeros(1, 2, 4, D)
    queries[0, :, :3, 2] = 20.0
    queries[0, 0, 3, 0] = 4.0
    queries[0, 1, 3, 1] = 4.0
    lossy = {"sinks": 0}
    region = _region(keys)
    ctx = _ctx(queries, torch.arange(4), **lossy)
    per_entry = 2 * 2 * D * 4  # two heads, key and value, float32
    blocks = tova.compress(region, 2 * per_entry, ctx)
    kept = blocks[0].keys
    assert kept.shape[-2] == 2
    expected = _softmax_weights(queries[..., 3:, :], keys)[..., 0, :].mean(1)  # [1, n] head average
    assert set(expected[0].topk(2).indices.tolist()) == {2, 5}
    for head in range(2):
        torch.testing.assert_close(kept[0, head], keys[0, head, [2, 5]])


def test_expected_attention_closed_form_of_the_gaussian_query():
    """No RoPE: queries ``mu + d e`` and ``mu - d e`` have mean ``mu`` and covariance ``d**2 e e^T``, so the expected
    logit of key k is ``mu.k + d**2 (e.k)**2 / 2`` (scale 1); the score is its softmax over every held entry times
    ``||v||``."""
    mu, e = torch.zeros(D), torch.zeros(D)
    mu[0], e[1], d = 1.0, 1.0, 2.0
    queries = torch.stack([mu + d * e, mu - d * e])[None, None]
    keys = torch.randn(1, 1, 6, D, generator=torch.Generator().manual_seed(1))
    values = torch.randn(1, 1, 6, D, generator=torch.Generator().manual_seed(2))
    context = torch.randn(1, 1, 2, D, generator=torch.Generator().manual_seed(3))
    ctx = _ctx(queries, torch.arange(2), context_keys=context)
    got = expected_attention.expected_scores(_region(keys, values), ctx)

    def logit(k):
        return k @ mu + 0.5 * d**2 * (k @ e) ** 2

    all_logits = torch.cat([logit(keys[0, 0]), logit(context[0, 0])])
    expected = torch.softmax(all_logits, 0)[:6] * values[0, 0].norm(dim=-1)
    torch.testing.assert_close(got[0, 0], expected)


def test_expected_attention_mean_is_rotated_over_the_next_positions():
    """With RoPE and every query the same pre-RoPE vector (no covariance), the expected logit is the logit of that
    query averaged over the next ``query_horizon`` positions (``E[R(p)] q . k``, RoPE being linear in q)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    q0 = torch.randn(D, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(5, 9)
    queries = rotate(q0.expand(1, 1, 4, D).clone(), positions.double(), inv_freq)  # q0 at its own positions
    keys = torch.randn(1, 1, 3, D, generator=torch.Generator().manual_seed(5))
    ctx = _ctx(queries, positions, inv_freq=inv_freq, now=9, query_horizon=16)
    mean, cov = expected_attention.query_moments(ctx)
    torch.testing.assert_close(mean[0, 0, 0], q0, atol=1e-5, rtol=0)
    assert float(cov.abs().max()) < 1e-5
    got = expected_attention.expected_logits(keys, mean, cov, ctx)[0, 0, 0]
    future = rotate(q0.expand(16, D).clone(), torch.arange(9, 25).double(), inv_freq)  # q0 at positions 9..24
    expected = (future @ keys[0, 0].T).mean(0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_pyramid_layer_budgets():
    """The paper's arithmetic sequence: the top layer gets 1 / BETA of the uniform budget, the bottom 2 - 1 / BETA,
    the layers sum to their count; in a cache each layer's budget falls with depth and the whole stays within the
    uniform budgets' total."""
    shares = [pyramidkv.layer_share(i, 6) for i in range(6)]
    assert math.isclose(sum(shares), 6.0)
    assert math.isclose(shares[-1], 1 / pyramidkv.BETA) and math.isclose(shares[0], 2 - 1 / pyramidkv.BETA)
    assert all(a > b for a, b in pairwise(shares))
    model = fresh_tiny_model("llama-gqa", layers=6)
    lossy = LossyConfig(method="pyramidkv", budget=0.3, sinks=2, reference_queries=32)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)
    with torch.no_grad():
        model(random_ids(1, 200), cache=cache)
    budgets = [layer.budget_bytes() for layer in cache.layers]
    assert all(a > b for a, b in pairwise(budgets))
    uniform = math.floor(0.3 * 200 * cache.layers[0].token_bytes)
    assert sum(budgets) <= 6 * uniform
    assert all(layer.held_bytes() <= budget for layer, budget in zip(cache.layers, budgets))
    entries = [layer.entries for layer in cache.layers]
    assert entries[0] > 2 * entries[-1]


def test_adakv_shares_the_layer_budget_by_score_with_a_safeguard():
    """Head 0's scores are concentrated (one large), head 1's spread (all middling): of 10 entries over both heads
    each first keeps its best floor(0.2 * 10 / 2) = 1, then the 8 best remaining of either head: head 1 gets them."""
    score = torch.tensor([[[0.9, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01],
                           [0.12, 0.12, 0.12, 0.12, 0.12, 0.12, 0.12, 0.11]]])
    keep = adakv.adaptive_keep(score, 10)
    assert keep.sum().item() == 10
    assert keep[0, 1].all()  # every spread entry beats head 0's tail
    assert keep[0, 0, 0] and keep[0, 0].sum().item() == 2  # its best, and one of its tail for the last slot
    # the safeguard: a head whose every score is below the other's still keeps its share
    low = torch.tensor([[[0.001] * 8, [0.5] * 8]])
    kept = adakv.adaptive_keep(low, 10, safeguard=0.4)
    assert kept[0, 0].sum().item() == 2 and kept[0, 1].sum().item() == 8
    # dead entries (-inf) are never kept, even when the budget would pay for them
    dead = score.clone()
    dead[0, 1, 4:] = float("-inf")
    assert adakv.adaptive_keep(dead, 16)[0, 1, 4:].sum().item() == 0


def test_adakv_in_a_cache_holds_ragged_heads_in_their_own_bytes():
    """A left-padded batch of 2 in int8: heads keep different numbers of entries, every held byte is the walk, the
    budget holds, and a row selection keeps each row's entries."""
    model = fresh_tiny_model("llama-gqa")
    ids = random_ids(2, 80, seed=11)
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    lossy = LossyConfig(method="adakv", budget=0.3, sinks=2, reference_queries=32, entry_format="int8")
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    ragged = [block for layer in cache.layers for block in layer.blocks if isinstance(block, RaggedBlock)]
    assert ragged and any(len(set(block.counts.flatten().tolist())) > 1 for block in ragged)
    for layer in cache.layers:
        assert layer.stats()["held_bytes"] == walked_bytes(layer)
        assert layer.held_bytes() <= layer.budget_bytes()
    block = ragged[0]
    keys, _ = block.read()
    picked = block.select_rows(torch.tensor([1]))
    assert torch.equal(picked.read()[0], keys[1:, :, : picked.entries])
    assert torch.equal(picked.counts, block.counts[1:])
