"""Reference queries: captured inside generate() exactly as attention used them, and moved to future positions
by a pure RoPE rotation."""

from __future__ import annotations

import importlib

import torch

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.queries import reposition, rotate


def test_rotation_moves_a_query_to_another_position(llama):
    rotary = llama.model.rotary_emb
    module = importlib.import_module(type(llama.model.layers[0].self_attn).__module__)
    raw = torch.randn(1, 4, 5, 16)
    at = torch.tensor([3, 10, 17, 40, 41])
    to = torch.tensor([100, 250, 77, 41, 1000])
    cos, sin = rotary(raw, at[None])
    placed, _ = module.apply_rotary_pos_emb(raw, raw, cos, sin)
    cos2, sin2 = rotary(raw, to[None])
    expected, _ = module.apply_rotary_pos_emb(raw, raw, cos2, sin2)
    moved = rotate(placed, to - at, rotary.inv_freq)
    torch.testing.assert_close(moved, expected, atol=1e-4, rtol=1e-4)


def test_reposition_spreads_queries_over_the_horizon():
    q = torch.randn(1, 2, 8, 16)
    positions = torch.arange(8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    out = reposition(q, positions, now=8, horizon=16, inv_freq=inv_freq)
    assert out.shape == q.shape
    # a rotation keeps every query's norm
    torch.testing.assert_close(out.norm(dim=-1), q.norm(dim=-1))
    assert torch.equal(reposition(q, positions, now=8, horizon=0, inv_freq=inv_freq), q)


def test_generate_records_post_rope_queries(llama):
    lossy = LossyConfig(method="topk", budget=0.9, interval=1000, reference_queries=64)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=lossy), model=llama)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    llama.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, cache=cache, pad_token_id=0)
    buffer = cache.layers[1].query_buffer
    assert len(buffer) == 14 and buffer.positions.tolist() == list(range(14))

    attn = llama.model.layers[1].self_attn
    seen = {}

    def grab(module, args, kwargs):
        seen["h"] = kwargs["hidden_states"]

    hook = attn.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        llama(ids)
    hook.remove()
    module = importlib.import_module(type(attn).__module__)
    hidden = seen["h"]
    q = attn.q_proj(hidden).view(1, 12, -1, attn.head_dim).transpose(1, 2)
    cos, sin = llama.model.rotary_emb(hidden, torch.arange(12)[None])
    q, _ = module.apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(buffer.queries[..., :12, :], q, atol=1e-5, rtol=1e-4)
