"""KVzip (issue 36): the replay's scores against the paper's description (the largest attention weight any replay
query gives each context entry), computed independently from transformers' eager attention weights; the prune
across layers keeps, in every layer and head, exactly the entries above one threshold."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import fresh_tiny_model, random_ids, sliding_model
from lossy_testutil import walked_bytes
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.blocks import RaggedBlock
from hf_kvcompress.lossy.methods import kvzip

CONTEXT, REPEAT = 48, 5


def _cache(model, budget=0.3):
    lossy = LossyConfig(method="kvzip", budget=budget, sinks=2, reference_queries=32, interval=8)
    return CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=model)


@torch.no_grad()
def test_replay_scores_are_the_largest_weight_any_replay_query_gives():
    context, repeat = random_ids(1, CONTEXT, seed=20), random_ids(1, REPEAT, seed=21)
    reference = fresh_tiny_model("llama-gqa", layers=6)
    reference.set_attn_implementation("eager")
    full = DynamicCache()
    reference(context, cache=full)
    weights = reference(torch.cat([repeat, context], -1), cache=full, output_attentions=True).attentions
    model = fresh_tiny_model("llama-gqa", layers=6)
    cache = _cache(model)
    for layer in cache.layers:
        layer.replay_state = kvzip.ReplayState("hold")
    model(context, cache=cache)
    for layer in cache.layers:
        layer.replay_state = kvzip.ReplayState("score")
    for start in (0, 20):  # the replay in two forwards: the scores are the running maximum
        model(torch.cat([repeat, context], -1)[:, start : start + 20 if start == 0 else None], cache=cache)
    for layer, attn in zip(cache.layers, weights):
        heads = layer.residual_keys.shape[1]
        expected = attn[..., :CONTEXT].unflatten(1, (heads, -1)).amax(dim=(2, 3))  # [b, kv heads, context]
        torch.testing.assert_close(layer.replay_state.scores, expected, atol=1e-5, rtol=1e-4)
        assert not layer.summary_seconds  # nothing was summarised while the context was held for the replay


def test_compress_context_prunes_across_layers_at_one_threshold():
    model = fresh_tiny_model("llama-gqa", layers=6)
    cache = _cache(model)
    context, repeat = random_ids(1, CONTEXT, seed=22), random_ids(1, REPEAT, seed=23)
    captured = {}
    share = kvzip._share_budget

    def capture(layers):
        captured.update({layer.layer_idx: layer.replay_state.scores.clone() for layer in layers})
        share(layers)

    kvzip._share_budget = capture
    try:
        kvzip.compress_context(model, cache, context, repeat, chunk_size=16)
    finally:
        kvzip._share_budget = share
    assert cache.get_seq_length() == CONTEXT  # the replay's entries are gone
    regions = {i: scores[..., 2 : CONTEXT - 4] for i, scores in captured.items()}  # less 2 sinks, 4 window
    kept = {layer.layer_idx: block for layer in cache.layers for block in layer.blocks if isinstance(block, RaggedBlock)}
    total = sum(int(block.counts.sum()) for block in kept.values())
    threshold = torch.cat([r.flatten() for r in regions.values()]).topk(total).values[-1]
    for i, block in kept.items():
        assert torch.equal(block.counts[0], (regions[i][0] >= threshold).sum(-1).to(block.counts.dtype)), i
    budgets = [layer.budget_bytes() for layer in cache.layers]
    uniform = int(0.3 * CONTEXT * cache.layers[0].token_bytes)
    assert len(set(budgets)) > 1 and sum(budgets) <= len(budgets) * uniform + len(budgets)
    for layer in cache.layers:
        assert layer.held_bytes() <= layer.budget_bytes()
        assert layer.stats()["held_bytes"] == walked_bytes(layer)
    # generation goes on from the pruned cache; later summaries keep each layer's share
    shares = [layer.budget_share for layer in cache.layers]
    out = model.generate(torch.cat([context, random_ids(1, 3, seed=24)], -1), cache=cache, max_new_tokens=12,
                         min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape == (1, CONTEXT + 15)
    assert [layer.budget_share for layer in cache.layers] == shares
    assert all(len(layer.summary_seconds) >= 2 for layer in cache.layers)  # decode steps summarised again


def test_compress_context_refuses_other_caches():
    model = fresh_tiny_model("llama-gqa")
    lossy = LossyConfig(method="topk", budget=0.3)
    cache = CompressedCache(CompressionConfig(mode="lossy", lossy=lossy), model=model)
    with pytest.raises(ValueError, match="no lossy layer with method 'kvzip'"):
        kvzip.compress_context(model, cache, random_ids(1, 8), random_ids(1, 2))


def test_compress_context_refuses_layers_a_replay_would_change_for_good():
    base = sliding_model(12)  # shared: a fresh copy, since a lossy cache switches the model's attention
    model = type(base)(copy.deepcopy(base.config)).eval()
    lossy = LossyConfig(method="kvzip", budget=0.3)
    cache = CompressedCache(CompressionConfig(mode="lossy", lossy=lossy), model=model)
    with pytest.raises(ValueError, match="sliding windows drop context entries"):
        kvzip.compress_context(model, cache, random_ids(1, 8), random_ids(1, 2))


def test_the_replay_state_is_kvzips_own():
    """KVzip's replay lives in its module's `ReplayState`: the shared lossy layer holds one such state while a
    replay runs (None otherwise), counted in its bytes, and none of its parts as attributes of its own."""
    model = fresh_tiny_model("llama-gqa", layers=2)
    cache = _cache(model)
    model(random_ids(1, CONTEXT, seed=24), cache=cache)
    layer = cache.layers[0]
    assert layer.replay_state is None
    assert not {"replay_phase", "replay_scores", "replay_picks", "replay_queries"} & set(vars(layer))
    before = layer.total_held_bytes()
    layer.replay_state = kvzip.ReplayState("prune", scores=torch.zeros(1, 2, 10))
    assert layer.total_held_bytes() == before + 80
    layer.reset()
    assert layer.replay_state is None
    with pytest.raises(ValueError, match=r"ReplayState.phase must be one of \['hold', 'score', 'prune'\]"):
        kvzip.ReplayState("replay")
