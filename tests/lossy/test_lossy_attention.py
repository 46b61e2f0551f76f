"""Positions and masks: the lossy attention path computes exactly softmax(q K^T * s + bias) V over the entries the
layer holds plus the new tokens, with new tokens at their true RoPE positions."""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.blocks import block_bias


def held(layer):
    keys, values = layer.keys, layer.values
    parts = []
    for block in layer.blocks:
        bias = block_bias(block)
        parts.append(torch.zeros(keys.shape[0], keys.shape[1], block.entries) if bias is None else bias.float())
    res = torch.zeros(keys.shape[0], keys.shape[1], layer.residual_length)
    if layer.residual_valid is not None:
        res = torch.where(layer.residual_valid[:, None, :], 0.0, float("-inf")).expand_as(res)
    return keys.float(), values.float(), torch.cat([*parts, res], dim=-1)


@pytest.mark.parametrize("method", list(LossyConfig.METHODS))
def test_attention_matches_manual_computation(tiny_model, method):
    lossy = LossyConfig(method=method, budget=0.35, interval=4, sinks=2, reference_queries=32)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=6, lossy=lossy), model=tiny_model)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_model(ids, cache=cache)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 60
    # the layer's own budget (a share of the uniform one for layer budgets: PyramidKV); the cache's within the whole
    assert layer.held_bytes() <= layer.budget_bytes()
    assert sum(each.budget_bytes() for each in cache.layers) <= 0.35 * 60 * layer.token_bytes * len(cache.layers)
    assert method == "svd" or layer.entries < 60
    keys, values, bias = held(layer)
    if method == "summary":
        assert bool((bias != 0).any())  # fitted biases are really in play

    attn = tiny_model.model.layers[0].self_attn
    captured = {}

    def grab_input(module, args, kwargs):
        captured["hidden"] = kwargs["hidden_states"]
        captured["pos"] = kwargs["position_embeddings"]

    def grab_output(module, args, output):
        captured["out"] = args[0]

    hooks = [attn.register_forward_pre_hook(grab_input, with_kwargs=True),
             attn.o_proj.register_forward_hook(grab_output)]
    new = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tiny_model(new, cache=cache)
    for h in hooks:
        h.remove()

    # manual attention for layer 0 at the true positions 60, 61, 62
    module = importlib.import_module(type(attn).__module__)
    hidden = captured["hidden"]
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden).view(shape)
    k = attn.k_proj(hidden).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(hidden).view(shape).transpose(1, 2)
    rotary = tiny_model.model.rotary_emb
    cos, sin = rotary(hidden, torch.arange(60, 63)[None])
    assert torch.allclose(cos, captured["pos"][0]) and torch.allclose(sin, captured["pos"][1])
    q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // keys.shape[1]
    all_k = torch.cat([keys, k], dim=-2).repeat_interleave(groups, 1)
    all_v = torch.cat([values, v], dim=-2).repeat_interleave(groups, 1)
    causal = torch.full((3, 3), float("-inf")).triu(1)
    full_bias = torch.cat([bias.repeat_interleave(groups, 1)[:, :, None, :].expand(-1, -1, 3, -1),
                           causal.expand(1, q.shape[1], 3, 3)], dim=-1)
    weights = torch.softmax(q @ all_k.transpose(-1, -2) * attn.scaling + full_bias, dim=-1)
    expected = (weights @ all_v).transpose(1, 2).reshape(1, 3, -1)
    torch.testing.assert_close(captured["out"], expected, atol=1e-5, rtol=1e-4)


def test_mask_sizes_follow_physical_length(llama):
    lossy = LossyConfig(method="topk", budget=0.25, interval=4, sinks=2, reference_queries=16)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=4, lossy=lossy), model=llama)
    with torch.no_grad():
        llama(torch.randint(3, 128, (1, 40)), cache=cache)
    held_entries = cache.layers[0].entries
    assert held_entries <= 10
    assert cache.get_mask_sizes(1, 0) == (held_entries + 1, 40 - held_entries)
    assert cache.get_seq_length() == 40
    assert all(layer.entries == held_entries for layer in cache.layers)
