"""The ``below`` predictor: calibrated maps from the layer below, two batched phases per block (keys, then values
given the keys). Six-layer models (a per-step cost or a memo of the last layers could hide behind two)."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import fresh_tiny_model, random_ids, same_bits, sliding_model, tiny_calibration
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig, PrefixStore, blockcoder
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.predictors.base import BlockInputs, LayerValues
from hf_kvcompress.predictors.below import BelowPredictor, LayerBlockSession, PhasedLayer, PhasedSession
from hf_kvcompress.predictors.linear import FeatureRecipe, flat_heads
from hf_kvcompress_eval.env import walk_held_bytes

LAYERS, BLOCK, RESIDUAL = 6, 16, 4


@functools.cache
def model6():
    return fresh_tiny_model("llama-gqa", torch.bfloat16, layers=LAYERS)


@functools.cache
def calibration() -> Calibration:
    return tiny_calibration(model6(), 512, predictors=("below",))


def config(predictor: str = "below", coder: str | None = None) -> CompressionConfig:
    return CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=RESIDUAL,
                             lossless={"predictor": predictor, "decoded_budget": 0.0, "coder": coder})


def count_codec_calls(monkeypatch) -> list[int]:
    """The number of streams of every `decode_streams` call the block coder makes from now on."""
    calls: list[int] = []
    original = blockcoder.decode_streams

    def counted(blobs, *args, **kwargs):
        calls.append(len(blobs))
        return original(blobs, *args, **kwargs)

    monkeypatch.setattr(blockcoder, "decode_streams", counted)
    return calls


def test_the_fit_records_the_phased_features_and_their_widths():
    cal = calibration()
    assert cal.meta["predictors"]["below"]["features"] == {"below": 1, "inter_head": True, "extras": [],
                                                            "phased": True}
    heads, dim = cal.meta["model"]["kv_heads"], cal.meta["model"]["head_dim"]
    below = 2 * heads * dim
    for layer, base in ((0, 1), (3, 1 + below)):  # layer 0 has no layer below: a bias alone for its keys
        found = cal.stream_heads("below", layer)
        assert all(found[("k", h)].weight.shape == (base, dim) for h in range(heads))
        assert all(found[("v", h)].weight.shape == (base + heads * dim, dim) for h in range(heads))


def test_a_session_equals_the_maps_written_out():
    """Keys: rotate([1, K_below pre-RoPE, V_below] @ W); values: [1, below, every key head pre-RoPE] @ W; the std
    the fitted sigma (rotated for keys) times the surprise known before the kind, to the power alpha."""
    cal, layer, tokens = calibration(), 2, 12
    predictor = BelowPredictor(cal)
    g = torch.Generator().manual_seed(3)
    heads, dim = cal.meta["model"]["kv_heads"], cal.meta["model"]["head_dim"]
    below_k, below_v, keys = (torch.randn(1, heads, tokens, dim, generator=g).bfloat16() for _ in range(3))
    surprise = torch.rand(1, tokens, generator=g) + 0.5
    positions = torch.arange(40, 40 + tokens)
    inputs = BlockInputs(layer, 1, positions, LayerValues(below_k, below_v, surprise))
    session = predictor.session(inputs)
    assert isinstance(session, PhasedSession) and session.kind_independent and not session.independent
    frame, stream = predictor.frame, cal.stream_heads("below", layer)
    base = torch.cat([torch.ones(1, tokens, 1), flat_heads(frame.unrotate(below_k, positions)), flat_heads(below_v)], -1)
    for h in range(heads):
        mean, std = session.predict("k", h)
        head = stream[("k", h)]
        want = frame.rotate(base @ head.weight, positions)
        sigma = frame.rotate_variance(head.sigma.square().expand(tokens, -1), positions).sqrt()
        torch.testing.assert_close(mean, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(std, sigma * surprise.clamp(0.25, 8.0).pow(head.alpha)[..., None])
    with pytest.raises(RuntimeError, match="before every key head"):
        session.predict("v", 0)
    for h in range(heads):
        session.observe("k", h, keys[:, h])
    own = torch.cat([base, flat_heads(frame.unrotate(keys, positions))], -1)
    for h in range(heads):
        mean, _ = session.predict("v", h)
        torch.testing.assert_close(mean, own @ stream[("v", h)].weight, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("coder", [None, "huff"])  # lanes (its default), and huff's per-element contexts
def test_generation_is_exact_and_decodes_a_kind_of_a_layer_in_one_call(monkeypatch, coder):
    model, ids = model6(), random_ids(1, 70, seed=5)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "output_logits": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        want = model.generate(ids, cache=DynamicCache(), **kwargs)
        cache = CompressedCache(config(coder=coder), model=model, calibration=calibration())
        got = model.generate(ids, cache=cache, **kwargs)
    assert cache.config.lossless.coder == (coder or "lanes")
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want.logits, got.logits))
    blocks = len(cache.layers[0].blocks)
    assert blocks >= 4
    calls = count_codec_calls(monkeypatch)
    predicted = count_session_calls(monkeypatch)
    decodes = cache.lossless.decodes
    with torch.no_grad():
        model(got.sequences[:, -1:], cache=cache)
    # every block of every layer decoded (no budget), in two codec calls per layer: keys, then values
    assert cache.lossless.decodes - decodes == LAYERS * blocks
    assert len(calls) == 2 * LAYERS and set(calls) == {blocks * 2}  # blocks x kv heads (2) per call
    # one stacked pass per layer; each block's kind predicted and observed in one session call, none head by head
    assert predicted == {"PhasedLayer.__init__": LAYERS, "LayerBlockSession.predict_kind": 2 * LAYERS * blocks,
                         "LayerBlockSession.observe_kind": 2 * LAYERS * blocks}


def count_session_calls(monkeypatch) -> dict[str, int]:
    """How often a decoder builds a `PhasedLayer` and calls each session method that predicts or observes, from now
    on (``Class.method`` -> calls)."""
    calls: dict[str, int] = {}
    methods = [(PhasedLayer, "__init__")] + [(cls, name) for cls in (PhasedSession, LayerBlockSession)
                                             for name in ("predict", "observe", "predict_kind", "observe_kind")]
    for cls, name in methods:
        original, key = getattr(cls, name), f"{cls.__name__}.{name}"

        def counted(self, *args, _key=key, _original=original, **kwargs):
            calls[_key] = calls.get(_key, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("portable", [False, True])
def test_a_kind_at_once_equals_head_after_head(portable):
    """`predict_kind` / `observe_kind` (the decoder's stacked path) give the bits `predict` / `observe` give head by
    head (the encoder's), surprise included: two rows and 13 tokens, so that no shape is a multiple of a vector."""
    cal, layer, tokens, batch = calibration(), 3, 13, 2
    g = torch.Generator().manual_seed(8)
    heads, dim = cal.meta["model"]["kv_heads"], cal.meta["model"]["head_dim"]
    below_k, below_v, keys, values = (torch.randn(batch, heads, tokens, dim, generator=g).bfloat16() for _ in range(4))
    inputs = BlockInputs(layer, batch, torch.arange(21, 21 + tokens),
                         LayerValues(below_k, below_v, torch.rand(batch, tokens, generator=g) + 0.5))
    predictor = BelowPredictor(cal, portable=portable)
    one, together = predictor.session(inputs), predictor.session(inputs)
    for kind, x in (("k", keys), ("v", values)):
        mean, std = together.predict_kind(kind, heads)
        for h in range(heads):
            want_mean, want_std = one.predict(kind, h)
            assert same_bits(mean[h], want_mean) and same_bits(std[h], want_std.expand_as(mean[h]))
            one.observe(kind, h, x[:, h])
        together.observe_kind(kind, x)
    assert same_bits(one.finish(keys, values).surprise, together.finish(keys, values).surprise)
    with pytest.raises(RuntimeError, match="twice"):
        together.observe_kind("v", values)


@pytest.mark.parametrize("coder", [None, "huff"])
def test_save_load_continues_bit_for_bit(tmp_path, coder, monkeypatch):
    model, ids = model6(), random_ids(1, 60, seed=2)
    reference, cache = DynamicCache(), CompressedCache(config(coder=coder), model=model, calibration=calibration())
    with torch.no_grad():
        model(ids[:, :50], cache=reference)
        model(ids[:, :50], cache=cache)
    path = cache.save(tmp_path / "below.kvc", predictor="below")
    predicted = count_session_calls(monkeypatch)
    loaded = CompressedCache.load(path, model=model, calibration=calibration(), config=config(coder=coder))
    # the file's full blocks (float64 statistics, settled) decoded a layer at a time, as generation decodes them (the
    # shorter last block of a layer with a session of its own; the encoder codes generation's blocks head by head)
    assert predicted["PhasedLayer.__init__"] >= LAYERS
    for a, b in zip(cache.kv_layers(), loaded.kv_layers()):
        assert same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
    with torch.no_grad():
        want = model(ids[:, 50:], cache=reference).logits
        got = model(ids[:, 50:], cache=loaded).logits
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))


@pytest.mark.parametrize("coder", ["lanes", "huff"])
def test_held_bytes_count_the_stacked_heads_and_release_the_calibrations_copy(tmp_path, coder):
    calibration().save(tmp_path / "cal")
    model = model6()
    loaded = Calibration.load(tmp_path / "cal", model)
    cache = CompressedCache(config(coder=coder), model=model, calibration=loaded)
    with torch.no_grad():
        model(random_ids(1, 40, seed=1), cache=cache)
    heads = cache.lossless.predictor.state_tensors()
    head_bytes = sum(t.numel() * t.element_size() for t in heads)
    assert len(heads) >= 4 * LAYERS and head_bytes > 0  # the stacked heads and the RoPE tables
    # the calibration's own copy of the heads was released: it holds the marginals the codec reads (lanes), no
    # heads; huff reads no marginal, so nothing of the calibration stays loaded
    if coder == "lanes":
        assert set(loaded.loaded_groups()) == {"marginal"}
        marginals = [loaded.tensors[name] for name in loaded.tensors if name.startswith("marginal/")]
        assert loaded.loaded_bytes() == sum(t.numel() * t.element_size() for t in marginals)
    else:
        assert loaded.loaded_bytes() == 0 and loaded.loaded_groups() == {}
    stats = cache.stats()
    assert stats["held_bytes"] >= stats["stored_bytes"] + head_bytes
    assert walk_held_bytes(cache, skip=[cache.model_config]) <= stats["held_bytes"]
    # the codec's marginals view the calibration's tensors: released by the calibration, they are still held (by
    # the codec) and still counted, once
    loaded.release()
    assert cache.stats()["calibration_bytes"] == stats["calibration_bytes"]
    assert len(cache.lossless.marginal_tensors()) == (LAYERS if coder == "lanes" else 0)


def test_layers_that_drop_tokens_are_refused_at_construction():
    model = sliding_model(48, torch.bfloat16)
    fitted = Calibration.fit(model, None, ids=random_ids(1, 64, seed=1), tokens=64, chunk=32, predictors=("below",),
                             progress=False)
    with pytest.raises(ValueError, match=r"reads the layer below, but this model has \['sliding_attention'\] layers"):
        CompressedCache(config(), model=model, calibration=fitted)


def test_without_a_calibration_it_codes_with_block_statistics():
    model, ids = model6(), random_ids(1, 40, seed=4)
    reference, cache = DynamicCache(), CompressedCache(config(), model=model, calibration=None)
    with torch.no_grad():
        want = model(ids, cache=reference).logits
        got = model(ids, cache=cache).logits
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    assert not cache.lossless.predictor.kind_batched and cache.lossless.depth == 0


def test_the_phased_recipe_reads_no_value_heads_and_every_key_head():
    recipe = FeatureRecipe(below=1, inter_head=True, phased=True)
    assert [recipe.own_features("k", h, 3) for h in range(3)] == [0, 0, 0]
    assert [recipe.own_features("v", h, 3) for h in range(3)] == [3, 3, 3]
    plain = FeatureRecipe(below=1, inter_head=True)
    assert [plain.own_features("v", h, 3) for h in range(3)] == [3, 4, 5]


def test_prefix_store_round_trip_is_exact(tmp_path):
    """``PrefixStore(predictor="below")``: chunks coded with the calibration's maps, transcoded on lookup; the hit
    generates as the reused DynamicCache does."""
    model, ids = model6(), random_ids(1, 50, seed=14)
    cfg = CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=0)
    store = PrefixStore(model, path=tmp_path, chunk_tokens=2 * BLOCK, predictor="below", config=cfg,
                        calibration=calibration(), max_bytes=1 << 30)
    prefix = DynamicCache()
    with torch.no_grad():
        model(ids[:, : 4 * BLOCK // 2], cache=prefix)
    assert store.put(ids[:, : 2 * BLOCK], prefix) == 2 * BLOCK
    cache = store.cache_for(ids)
    assert cache.get_seq_length() == 2 * BLOCK
    reference = DynamicCache()
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "output_logits": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        model(ids[:, : 2 * BLOCK], cache=reference)
        want = model.generate(ids, cache=reference, **kwargs)
        got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want.logits, got.logits))



@pytest.mark.parametrize("portable", [False, True])
def test_a_layer_decoded_together_gives_each_blocks_own_bits(portable):
    """`BelowPredictor.sessions` of three blocks of one layer (generation's, or a file's) share one `PhasedLayer`;
    every block's statistics and surprise are the bits of its own `PhasedSession` (two rows and 13 tokens per block,
    so that stacked tensors are not a multiple of a vector where a block's alone would be)."""
    cal, layer, tokens, batch, blocks = calibration(), 2, 13, 2, 3
    g = torch.Generator().manual_seed(11)
    heads, dim = cal.meta["model"]["kv_heads"], cal.meta["model"]["head_dim"]
    predictor = BelowPredictor(cal, portable=portable)

    def block(start: int) -> tuple[BlockInputs, torch.Tensor, torch.Tensor]:
        below = LayerValues(*(torch.randn(batch, heads, tokens, dim, generator=g).bfloat16() for _ in range(2)),
                            torch.rand(batch, tokens, generator=g) + 0.5)
        keys, values = (torch.randn(batch, heads, tokens, dim, generator=g).bfloat16() for _ in range(2))
        return BlockInputs(layer, batch, torch.arange(start, start + tokens), below), keys, values

    found = [block(start) for start in (0, 13, 26)]
    together = predictor.sessions([inputs for inputs, _, _ in found])
    assert {type(s) for s in together} == {LayerBlockSession}
    alone = [predictor.session(inputs) for inputs, _, _ in found]
    for kind, which in (("k", 1), ("v", 2)):
        for i in range(blocks):
            mean, std = together[i].predict_kind(kind, heads)
            want_mean, want_std = alone[i].predict_kind(kind, heads)
            assert same_bits(mean, want_mean) and same_bits(std, want_std)
        for i in range(blocks):
            together[i].observe_kind(kind, found[i][which])
            alone[i].observe_kind(kind, found[i][which])
    for i, (_, keys, values) in enumerate(found):
        assert same_bits(together[i].finish(keys, values).surprise, alone[i].finish(keys, values).surprise)
    assert all(s.portable == portable for s in together)
    with pytest.raises(RuntimeError, match="a kind at a time"):
        together[0].predict("k", 0)
