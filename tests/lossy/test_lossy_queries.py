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


def test_generate_keeps_post_rope_queries_between_summaries(llama):
    """The prefill's summary is fitted on that forward's queries and keeps none; the decode queries after it are
    kept (int8, exact up to half a quantisation step) until the next summary, at most ``kept_queries``. (A prompt
    longer than the sinks and the window: a shorter one is never summarised.)"""
    lossy = LossyConfig(method="topk", budget=0.9, interval=1000, reference_queries=64)
    cache = CompressedCache(CompressionConfig(mode="lossy", residual_tokens=8, lossy=lossy), model=llama)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    out = llama.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, cache=cache, pad_token_id=0)
    layer = cache.layers[0]  # its queries depend on the tokens only, not on what the cache kept
    assert len(layer.summary_seconds) == 1  # the prefill's
    buffer = layer.query_buffer
    assert len(buffer) == 3 and buffer.positions.tolist() == [20, 21, 22]
    assert layer.stats()["query_bytes"] == buffer.nbytes() > 0

    attn = llama.model.layers[0].self_attn
    seen = {}

    def grab(module, args, kwargs):
        seen["h"] = kwargs["hidden_states"]

    hook = attn.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        llama(out[:, :23])
    hook.remove()
    module = importlib.import_module(type(attn).__module__)
    hidden = seen["h"]
    q = attn.q_proj(hidden).view(1, 23, -1, attn.head_dim).transpose(1, 2)
    cos, sin = llama.model.rotary_emb(hidden, torch.arange(23)[None])
    q, _ = module.apply_rotary_pos_emb(q, q, cos, sin)
    kept, positions, valid = buffer.read(None, 64)
    assert positions.tolist() == [20, 21, 22] and bool(valid.all())
    step = q[..., 20:, :].abs().amax(-1, keepdim=True) / 127
    assert bool(((kept - q[..., 20:, :]).abs() <= step / 2 + 1e-5).all())

    few = CompressedCache(
        CompressionConfig(mode="lossy", residual_tokens=8, lossy=LossyConfig(method="topk", budget=0.9, kept_queries=2)),
        model=llama,
    )
    llama.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, cache=few, pad_token_id=0)
    assert few.layers[0].query_buffer.positions.tolist() == [21, 22]
