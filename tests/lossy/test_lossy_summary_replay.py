"""The summary on KVzip's context replay (`methods.summary_replay`, issue 36): on a hand-made region it keeps the
needle the prompt's queries do not look at (which the summary drops) and refits what it keeps towards the replay
queries' attention output; under `kvzip.compress_context` it holds the whole context, keeps KVzip's budget across
layers, stays within each layer's budget in every entry format (batch 2 too), and is exact when nothing needs
compressing. The generate path (no replay) is in the shared matrix (test_lossy_generation, _chunked, _memory, ...)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import fresh_tiny_model, random_ids
from lossy_testutil import walked_bytes
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.blocks import LossyBlock, block_bias
from hf_kvcompress.lossy.budget import entry_bytes
from hf_kvcompress.lossy.methods import METHODS, kvzip
from hf_kvcompress.lossy.region import FitContext, Region

D, N, NEEDLE, KEEP = 8, 24, 5, 4
CONTEXT, REPEAT = 48, 5


def _ctx(method: str, queries: torch.Tensor, context_keys: torch.Tensor, context_values: torch.Tensor,
         scores: torch.Tensor | None = None, **settings) -> FitContext:
    return FitContext(queries, torch.ones(queries.shape[:-1]), context_keys, context_values,
                      torch.zeros(context_keys.shape[:-1]), 1.0, True,
                      LossyConfig.from_dict({"method": method, **settings}),
                      scores=scores)


def _output(queries, keys, values, bias) -> torch.Tensor:
    return torch.softmax(queries @ keys.transpose(-1, -2) + bias[..., None, :], dim=-1) @ values


def _needle_case():
    """A region of N entries: entries 16.. are what the prompt's last queries attend to (key axis 1), entry NEEDLE is
    a needle only a replay query looks at (key axis 0), the rest weak filler; two exact context entries."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, N, D, generator=gen) * 0.3
    keys[0, 0, 16:, 1] += 3.0
    keys[0, 0, NEEDLE] = 4 * F.one_hot(torch.tensor(0), D).float()
    values = torch.randn(1, 1, N, D, generator=gen)
    region = Region(keys, values, torch.zeros(1, 1, N), tokens=N)
    context_keys, context_values = torch.randn(1, 1, 2, D, generator=gen) * 0.3, torch.randn(1, 1, 2, D, generator=gen)
    prompt = torch.randn(1, 1, 12, D, generator=gen) * 0.3
    prompt[..., 1] += 2.0  # the prompt's recent queries: about the recent filler
    replay = torch.randn(1, 1, 12, D, generator=gen) * 0.3
    replay[0, 0, 3, 0] += 3.0  # one replay query re-reads the needle
    replay[0, 0, 7:, 1] += 2.0
    return region, (context_keys, context_values), prompt, replay


def _kept(blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    (block,) = blocks
    keys, values = block.read()
    bias = block_bias(block)
    return keys.float(), values.float(), torch.zeros(keys.shape[:-1]) if bias is None else bias.float()


def test_the_replay_keeps_the_needle_the_prompt_queries_drop():
    region, (ck, cv), prompt, replay = _needle_case()
    budget = KEEP * entry_bytes(1, D, 4, with_bias=True)
    summary = METHODS["summary"].compress(region, budget, _ctx("summary", prompt, ck, cv))
    # KVzip's score: the largest weight any replay query gives each entry (softmax over context and region)
    weights = torch.softmax(replay @ torch.cat([ck, region.keys], -2).transpose(-1, -2), dim=-1)[..., 2:]
    scores = weights.amax(-2)
    replayed = METHODS["summary_replay"].compress(region, budget, _ctx("summary_replay", replay, ck, cv, scores))
    needle = region.keys[0, 0, NEEDLE]
    held = {name: _kept(blocks)[0][0, 0] for name, blocks in (("summary", summary), ("replay", replayed))}
    assert held["summary"].shape[0] == held["replay"].shape[0] == KEEP
    assert not (held["summary"] == needle).all(-1).any()  # the prompt's queries never look at the needle
    assert (held["replay"] == needle).all(-1).any()
    index = scores[0, 0].topk(KEEP).indices.sort().values
    assert torch.equal(held["replay"], region.keys[0, 0, index])  # KVzip's choice, in position order
    # by default (refit=False) the kept entries stay exact: values as they were, no biases
    _, values, bias = _kept(replayed)
    assert torch.equal(values[0, 0], region.values[0, 0, index]) and not bias.any()
    # with refit=True they are refitted: the replay queries' output is nearer the full layer's than the entries as
    # they are
    refitted = METHODS["summary_replay"].compress(region, budget, _ctx("summary_replay", replay, ck, cv, scores,
                                                                       refit=True))
    keys, values, bias = _kept(refitted)
    assert torch.equal(keys[0, 0], region.keys[0, 0, index]) and bias.any()
    full = _output(replay, torch.cat([ck, region.keys], -2), torch.cat([cv, region.values], -2), torch.zeros(1, 1, 2 + N))
    plain = _output(replay, torch.cat([ck, region.keys[..., index, :]], -2),
                    torch.cat([cv, region.values[..., index, :]], -2), torch.zeros(1, 1, 2 + KEEP))
    fitted = _output(replay, torch.cat([ck, keys], -2), torch.cat([cv, values], -2),
                     torch.cat([torch.zeros(1, 1, 2), bias], -1))
    assert (fitted - full).norm() < 0.7 * (plain - full).norm()


def test_mass_selection_and_the_fallback_without_a_replay():
    """``selection="mass"``: the replay queries' mean weight; without a replay's scores (generate, chunked prefill)
    ``"max"`` is the largest weight of the queries at hand."""
    region, (ck, cv), _, replay = _needle_case()
    keep = 2  # the needle and entry 17 by mass, the needle and entry 18 by the largest weight
    budget = keep * entry_bytes(1, D, 4, with_bias=True)
    weights = torch.softmax(replay @ torch.cat([ck, region.keys], -2).transpose(-1, -2), dim=-1)[..., 2:]
    config = LossyConfig(method="summary_replay", selection="mass")
    ctx = FitContext(replay, torch.ones(1, 1, 12), ck, cv, torch.zeros(1, 1, 2), 1.0, True, config)
    keys = _kept(METHODS["summary_replay"].compress(region, budget, ctx))[0][0, 0]
    expected = weights.mean(-2)[0, 0].topk(keep).indices.sort().values
    assert torch.equal(keys, region.keys[0, 0, expected])
    no_replay = _kept(METHODS["summary_replay"].compress(region, budget, _ctx("summary_replay", replay, ck, cv)))[0]
    largest = weights.amax(-2)[0, 0].topk(keep).indices.sort().values
    assert torch.equal(no_replay[0, 0], region.keys[0, 0, largest])
    assert expected.tolist() == [NEEDLE, 17] and largest.tolist() == [NEEDLE, 18]
    with pytest.raises(ValueError, match=r"LossyConfig\.selection"):
        LossyConfig(method="summary_replay", selection="entropy")
    # the selection is the method's own setting, kept through the config's dict
    assert LossyConfig.from_dict(config.to_dict()).settings.selection == "mass"
    # stages 2 and 3 are off unless asked for (the needles they cost: docs/results/long_context.md)
    settings = LossyConfig(method="summary_replay").settings
    assert (settings.refit, settings.truncate) == (False, False)
    both = LossyConfig.from_dict({"method": "summary_replay", "refit": True, "truncate": True})
    assert LossyConfig.from_dict(both.to_dict()).settings == both.settings
    with pytest.raises(ValueError, match="truncate"):
        LossyConfig.from_dict({"method": "summary_replay", "truncate": "yes"})


def _cache(model, budget=0.3, **kwargs):
    lossy = LossyConfig.from_dict({"method": "summary_replay", "budget": budget, "sinks": 2, "reference_queries": 16,
                                   "interval": 8, **kwargs})
    return CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)


@pytest.fixture(scope="module")
def model():
    return fresh_tiny_model("llama-gqa", layers=6)


def test_compress_context_keeps_kvzips_layer_budgets_and_fits_on_sampled_replay_queries(model):
    context, repeat = random_ids(1, CONTEXT, seed=22), random_ids(1, REPEAT, seed=23)
    cache, reference = _cache(model, refit=True), CompressedCache(CompressionConfig(
        mode="lossy", residual_tokens=4,
        lossy=LossyConfig(method="kvzip", budget=0.3, sinks=2, reference_queries=16, interval=8)), model=model)
    found = {}
    for name, c in (("replay", cache), ("kvzip", reference)):
        with kvzip.hold_context(c):
            model(context, cache=c)
        found[name] = kvzip.replay(model, c, context, repeat, chunk_size=16)
    for mine, theirs, query in zip(found["replay"].scores, found["kvzip"].scores, found["replay"].queries):
        assert torch.equal(mine, theirs)  # the same replay, the same scores
        assert query.shape == (1, model.config.num_attention_heads, 16, model.config.head_dim)
    assert found["kvzip"].queries == [None] * len(cache.layers)
    with pytest.raises(ValueError, match="needs the replay queries"):
        kvzip.prune(cache, found["replay"].scores)
    kvzip.prune(cache, found["replay"].scores, found["replay"].queries)
    kvzip.prune(reference, found["kvzip"].scores)
    assert cache.get_seq_length() == CONTEXT
    shares = [layer.budget_share for layer in cache.layers]
    assert shares == [layer.budget_share for layer in reference.layers] and len(set(shares)) > 1
    for layer in cache.layers:
        assert layer.held_bytes() <= layer.budget_bytes()
        assert layer.stats()["held_bytes"] == walked_bytes(layer)
        assert layer.replay_state is None
        kept = layer.blocks[-1]
        assert isinstance(kept, LossyBlock) and block_bias(kept) is not None  # fitted biases
    out = model.generate(torch.cat([context, random_ids(1, 3, seed=24)], -1), cache=cache, max_new_tokens=12,
                         min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape == (1, CONTEXT + 15)
    assert [layer.budget_share for layer in cache.layers] == shares


@pytest.mark.parametrize("fmt", ["model", "int8", "int4", "mixed"])
def test_compress_context_batch_two_in_every_entry_format(model, fmt):
    context, repeat = random_ids(2, CONTEXT, seed=25), random_ids(1, REPEAT, seed=26)[0]
    cache = _cache(model, entry_format=fmt)
    kvzip.compress_context(model, cache, context, repeat)
    for layer in cache.layers:
        assert layer.held_bytes() <= layer.budget_bytes()
        assert layer.stats()["held_bytes"] == walked_bytes(layer)
    out = model.generate(torch.cat([context, random_ids(2, 2, seed=27)], -1), cache=cache, max_new_tokens=4,
                         min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, CONTEXT + 6)


def test_compress_context_is_exact_when_nothing_needs_compressing(model):
    context, repeat = random_ids(2, CONTEXT, seed=28), random_ids(1, REPEAT, seed=29)[0]
    new = random_ids(2, 3, seed=30)

    def logits(cache):
        return model(new, cache=cache).logits

    cache = _cache(model, budget=1.0)
    kvzip.compress_context(model, cache, context, repeat)
    full = DynamicCache()
    model(context, cache=full)
    assert torch.equal(logits(cache), logits(full))
    assert all(not layer.summary_seconds for layer in cache.layers)
