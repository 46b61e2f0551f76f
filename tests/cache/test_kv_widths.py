"""Keys and values of different widths: an MLA latent cache (deepseek_v3: the compressed KV as keys, the rotary
key part as values), a model whose values are narrower than its keys (mimo_v2_flash) and per-layer head dims
(gemma4: its global layers are wider than its sliding ones). Lossless mode stays bit-exact with per-kind side data
and streams; lossy mode runs where its maths is defined and refuses where it is not."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import random_ids, same_bits
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_kvcompress.blockcoder as blockcoder
import hf_kvcompress.lossy.layer as lossy_layer
import hf_kvcompress.lossy.refusals as lossy_refusals
from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.blockcodec import CodedBlock
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec import stream_info
from hf_kvcompress.predictors.generic import KIND_MEAN, KIND_STD
from hf_kvcompress.predictors.registry import make_predictor
from hf_kvcompress_eval.env import walk_held_bytes

LAYERS = 6
SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
         "max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
CONFIGS = {
    # MLA: every layer caches a 16-wide latent (keys) and the 8-wide rotary key part (values), one "head"
    "deepseek_v3": {"moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "n_group": 1, "topk_group": 1},
    # keys 16 wide, values 8 wide: what attention reads, as cached
    "mimo_v2_flash": {"moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "head_dim": 16, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                      "layer_types": ["full_attention"] * LAYERS},
    # sliding layers 16 wide, global layers 32 wide (keys and values alike within a layer)
    "gemma4_text": {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "sliding_window": 48,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * (LAYERS // 3)},
}
#: (key width, value width) of every layer
WIDTHS = {"deepseek_v3": [(16, 8)] * LAYERS, "mimo_v2_flash": [(16, 8)] * LAYERS,
          "gemma4_text": [(16, 16), (16, 16), (32, 32)] * (LAYERS // 3)}
SPLIT = ("deepseek_v3", "mimo_v2_flash")


def fresh_model(kind: str, dtype: torch.dtype = torch.bfloat16):
    """A new tiny random ``kind`` model (lossy mode switches a model's attention function: tests that use it get
    their own)."""
    config = AutoConfig.for_model(kind, **SMALL, **CONFIGS[kind])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


model_of = functools.cache(fresh_model)


def prompt(batch: int, length: int = 60) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids and (batch 2: the first row left-padded by 7) the attention mask."""
    ids = random_ids(batch, length, seed=3)
    if batch == 1:
        return ids, None
    mask = torch.ones_like(ids)
    ids[0, :7] = 0
    mask[0, :7] = 0
    return ids, mask


def generate(model, ids, mask, cache, new: int = 8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, do_sample=False, max_new_tokens=new,
                              output_logits=True, return_dict_in_generate=True)


def lossless(**settings) -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=8, lossless=settings)


def assert_identical(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    for a, b in zip(got.logits, want.logits):
        assert same_bits(a, b)


def coded_blocks(cache) -> list[CodedBlock]:
    return [block for layer in cache.kv_layers() for block in layer.blocks if isinstance(block, CodedBlock)]


def assert_streams_per_kind(cache, kind: str) -> None:
    """Every sealed block codes its keys and values at their own widths: side data per kind where they differ
    (the stacked ``block_mean`` / ``block_std`` where they agree), and streams of the kind's width."""
    sealed = {layer.layer_idx for layer in cache.kv_layers() if layer.blocks}
    assert sealed >= {i for i, t in enumerate(CONFIGS[kind].get("layer_types", ["full_attention"] * LAYERS))
                      if t == "full_attention"}
    for layer in cache.kv_layers():
        key_width, value_width = WIDTHS[kind][layer.layer_idx]
        for block in layer.blocks:
            assert isinstance(block, CodedBlock)
            assert (block.dim, block.value_dim, block.split) == (key_width, value_width, key_width != value_width)
            for row in block.rows:
                if block.split:
                    assert sorted(row.side) == sorted([*KIND_MEAN.values(), *KIND_STD.values()])
                    for kind_name, width in (("k", key_width), ("v", value_width)):
                        assert tuple(row.side[KIND_MEAN[kind_name]].shape) == (block.heads, width)
                        assert tuple(row.side[KIND_STD[kind_name]].shape) == (block.heads, width)
                else:
                    assert tuple(row.side["block_mean"].shape) == (2, block.heads, key_width)
                assert len(row.blobs) == 2 * block.heads
                for index, blob in enumerate(row.blobs):
                    width = key_width if index < block.heads else value_width
                    config = cache.lossless.codec_for(block.layer)
                    assert tuple(stream_info(blob, config=config)[1]) == (width, block.tokens)


# ---------------------------------------------------------------------- lossless


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_lossless_generation_is_bit_identical_with_streams_per_kind(kind, dtype, batch):
    model = model_of(kind, dtype)
    ids, mask = prompt(batch)
    want = generate(model, ids, mask, DynamicCache(config=model.config))
    cache = CompressedCache(lossless(), model=model, calibration=None)
    got = generate(model, ids, mask, cache)
    assert_identical(got, want)
    assert_streams_per_kind(cache, kind)
    held = cache.stats()["held_bytes"]
    assert held == walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])


@pytest.mark.parametrize("predictor", ["generic", "framed", "self", "none", "context"])
@pytest.mark.parametrize("kind", SPLIT)
def test_every_uncalibrated_predictor_codes_two_widths(kind, predictor):
    """Past 128 tokens `self` predicts keys from the layer below through its fitted maps; the calibrated
    predictors without a calibration fall back to block statistics per kind."""
    model = model_of(kind, torch.bfloat16)
    ids, mask = prompt(2, 150 if predictor == "self" else 60)
    want = generate(model, ids, mask, DynamicCache(config=model.config), new=4)
    cache = CompressedCache(lossless(predictor=predictor, decoded_budget=0.0), model=model, calibration=None)
    got = generate(model, ids, mask, cache, new=4)
    assert_identical(got, want)
    assert all(block.split for block in coded_blocks(cache))
    if predictor == "self":
        assert cache.lossless.predictor._maps  # the fitted path ran
        walked = walk_held_bytes(cache, skip=[cache.model_config])
    else:
        walked = walk_held_bytes(cache, skip=[cache.model_config, cache.lossless.predictor])
    assert cache.stats()["held_bytes"] == walked


@pytest.mark.parametrize("settings", [{"coder": "ans"}, {"workers": 2, "decoded_budget": 0.0}], ids=["ans", "workers"])
def test_other_codec_settings_stay_exact(settings):
    model = model_of("deepseek_v3", torch.bfloat16)
    ids, mask = prompt(2, 40)
    want = generate(model, ids, mask, DynamicCache(config=model.config), new=4)
    got = generate(model, ids, mask, CompressedCache(lossless(**settings), model=model, calibration=None), new=4)
    assert_identical(got, want)


def test_a_layers_blocks_decode_in_one_codec_call_per_kind(monkeypatch):
    model = model_of("mimo_v2_flash", torch.bfloat16)
    cache = CompressedCache(lossless(decoded_budget=0.0, workers=1), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 80, seed=5), cache=cache)
    calls = []
    real = blockcoder.decode_streams

    def counted(blobs, mean, std, *args, **kwargs):
        calls.append((len(blobs), tuple(mean.shape[1:2])))
        return real(blobs, mean, std, *args, **kwargs)

    monkeypatch.setattr(blockcoder, "decode_streams", counted)
    blocks = len(cache.layers[0].blocks)
    heads = cache.layers[0].blocks[0].heads
    with torch.no_grad():
        model(torch.tensor([[9]]), cache=cache)
    assert blocks >= 4
    # per layer: every block's key streams in one call (16 wide), their value streams in another (8 wide)
    assert calls == [(blocks * heads, (16,)), (blocks * heads, (8,))] * LAYERS


def test_self_fits_no_map_between_layers_of_different_widths():
    """Without a model: layers of another key width than the one below keep block statistics (encoder and decoder
    agree without being told), and a crop (which drops the fitted state) refits the same way."""
    torch.manual_seed(1)
    widths = [(16, 8), (16, 8), (32, 32), (32, 8)]  # (keys, values) per layer
    tokens = 200
    states = [(torch.randn(1, 2, tokens, k).bfloat16(), torch.randn(1, 2, tokens, v).bfloat16()) for k, v in widths]
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=8,
                                              lossless={"predictor": "self", "decoded_budget": 0.0}))
    for start, stop in ((0, 150), *((t, t + 1) for t in range(150, tokens))):
        for layer, (k, v) in enumerate(states):
            cache.update(k[:, :, start:stop], v[:, :, start:stop], layer)
    predictor = cache.lossless.predictor
    # layer 2's keys are wider than layer 1's: no map; layer 3's (32 wide, values 8) map from layer 2's
    assert predictor._unmapped == {2} and {layer for layer, _ in predictor._maps} == {1, 3}
    for layer, (k, v) in zip(cache.kv_layers(), states):
        assert same_bits(layer.keys, k) and same_bits(layer.values, v)
    cache.crop(-5)
    for layer, (k, v) in zip(cache.kv_layers(), states):
        assert same_bits(layer.keys, k[:, :, : tokens - 5]) and same_bits(layer.values, v[:, :, : tokens - 5])


@pytest.mark.parametrize("kind", SPLIT)
def test_save_load_round_trips_two_widths(tmp_path, kind):
    model = model_of(kind, torch.bfloat16)
    cache = CompressedCache(lossless(), model=model, calibration=None)
    with torch.no_grad():
        model(random_ids(1, 60, seed=7), cache=cache)
    loaded = CompressedCache.load(cache.save(tmp_path / "two-widths.kvc", predictor="generic"), model=model,
                                  calibration=None)
    assert all(block.split for block in coded_blocks(loaded))
    for a, b in zip(cache.kv_layers(), loaded.kv_layers()):
        assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)


def test_calibration_refuses_two_widths_before_any_slow_work():
    model = model_of("deepseek_v3", torch.bfloat16)
    with pytest.raises(ValueError, match=r"layer 0 caches keys 16 and values 8 wide.*predictor='generic'"):
        Calibration.fit(model, None, ids=random_ids(1, 256, seed=9), tokens=256, chunk=128, progress=False)
    gemma = model_of("gemma4_text", torch.bfloat16)
    with pytest.raises(ValueError, match=r"layer 2 caches keys 32 and values 32 wide \(layer 0's keys: 16\)"):
        Calibration.fit(gemma, None, ids=random_ids(1, 256, seed=9), tokens=256, chunk=128, progress=False)


def test_a_calibrated_predictor_refuses_two_widths():
    predictor = make_predictor("context")
    predictor.calibration = object()  # stands in for a calibration: its heads have one width
    keys, values = torch.zeros(1, 1, 8, 16), torch.zeros(1, 1, 8, 8)
    with pytest.raises(ValueError, match=r"layer 3: keys 16 and values 8 wide.*predictor='generic'"):
        predictor.side_data(3, keys, values)


# ---------------------------------------------------------------------- lossy


def lossy(method: str, fmt: str = "model") -> CompressionConfig:
    return CompressionConfig(mode="lossy", block_tokens=16, residual_tokens=16,
                             lossy={"method": method, "budget": 0.3, "interval": 4, "sinks": 2, "entry_format": fmt})


def run_lossy(kind: str, method: str, fmt: str = "model", batch: int = 2):
    model = fresh_model(kind)
    ids, mask = prompt(batch, 120)
    cache = CompressedCache(lossy(method, fmt), model=model)
    got = generate(model, ids, mask, cache, new=6)
    assert all(bool(torch.isfinite(logits).all()) for logits in got.logits)
    return cache


def assert_budget_and_bytes(cache) -> None:
    stats = cache.stats(per_layer=True)
    summarised = 0
    for layer, layer_stats in zip(cache.kv_layers(), stats["per_layer"]):
        if not isinstance(layer, lossy_layer.LossyLayer):
            continue  # a sliding layer: a plain window
        keys, values = layer.residual_keys, layer.residual_values
        assert layer.token_bytes == keys.shape[1] * (keys.shape[-1] + values.shape[-1]) * keys.element_size()
        assert layer.held_bytes() <= layer.budget_bytes() + layer.since_summary * layer.token_bytes + 1
        assert layer_stats["held_bytes"] == walk_held_bytes(layer)
        summarised += len(layer.summary_seconds) > 0
    assert summarised > 0


@pytest.mark.parametrize("method", ["streaming", "topk", "summary", "svd"])
@pytest.mark.parametrize("kind", ["mimo_v2_flash", "gemma4_text"])
def test_lossy_methods_run_on_other_value_widths(kind, method):
    assert_budget_and_bytes(run_lossy(kind, method))


@pytest.mark.parametrize(("method", "fmt"), [("topk", "int4"), ("summary", "mixed")])
def test_lossy_packed_entries_of_two_widths(method, fmt):
    assert_budget_and_bytes(run_lossy("mimo_v2_flash", method, fmt))


@pytest.mark.parametrize("method", ["streaming", "svd"])
@pytest.mark.parametrize("with_model", [True, False])
def test_lossy_keeps_or_factors_an_mla_latent(method, with_model):
    model = fresh_model("deepseek_v3")
    ids, _ = prompt(1, 120)
    cache = CompressedCache(lossy(method), model=model if with_model else None)
    got = generate(model, ids, None, cache, new=6)
    assert all(bool(torch.isfinite(logits).all()) for logits in got.logits)
    assert_budget_and_bytes(cache)


@pytest.mark.parametrize("method", ["topk", "summary"])
def test_query_scored_methods_refuse_an_mla_latent_when_built(method):
    with pytest.raises(ValueError, match=r"layers 0\.\.5 .* MLA latent \(keys 16 wide, values 8 wide\).*'streaming'"):
        CompressedCache(lossy(method), model=fresh_model("deepseek_v3"))


def test_query_scored_methods_refuse_other_attention_inputs_at_the_first_attention(monkeypatch):
    """The generic check behind the config one: attention reading per-head keys computed from the cached latent."""
    monkeypatch.setattr(lossy_refusals, "refuse_latent_cache", lambda config, model: None)
    model = fresh_model("deepseek_v3")
    cache = CompressedCache(lossy("summary"), model=model)
    with pytest.raises(ValueError, match=r"lossy layer 0: attention reads keys \[4, 24\] and values \[4, 8\] .* "
                                         r"cached keys \[1, 16\] and values \[1, 8\]"):
        generate(model, *prompt(1, 120), cache)
    assert all(not layer.summary_seconds for layer in cache.kv_layers())
