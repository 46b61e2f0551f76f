"""Bad input to the cache gets an exception whose message names the problem."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import random_ids, tiny_model

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.errors import LayerKindError

NONE = CompressionConfig(mode="none", block_tokens=4, residual_tokens=2)


def kv(dtype=torch.float32, batch=1, heads=2, tokens=3, dim=8):
    return torch.randn(batch, heads, tokens, dim).to(dtype), torch.randn(batch, heads, tokens, dim).to(dtype)


def test_config_must_be_a_compression_config():
    with pytest.raises(TypeError, match="CompressionConfig"):
        CompressedCache({"mode": "none"})  # type: ignore[arg-type]


def test_a_model_config_as_config_builds_the_models_layers_as_dynamic_cache_does():
    """`CompressedCache(config=model.config)`, transformers' `DynamicCache(config=model.config)` call: one layer per
    model layer, sliding windows where the model has them, the default compression; a second, other model config
    is refused naming the arguments."""
    from helpers import RAW, sliding_model
    from transformers import DynamicCache

    model = sliding_model(RAW)
    cache = CompressedCache(config=model.config)
    assert cache.config == CompressionConfig() and cache.model_config is model.config
    dynamic = DynamicCache(config=model.config)
    assert len(cache.layers) == len(dynamic.layers) == 6
    assert [layer.sliding_window for layer in cache.layers] == [getattr(layer, "sliding_window", None)
                                                                 for layer in dynamic.layers]
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache, use_cache=True)
        model(random_ids(1, 20), cache=dynamic, use_cache=True)
    assert cache.get_seq_length() == dynamic.get_seq_length() == 20
    with pytest.raises(TypeError, match="pass the model's config as model_config= and a CompressionConfig as config="):
        CompressedCache(model.config, model_config=tiny_model("llama-gqa").config)


def test_wrong_dtype_is_rejected():
    cache = CompressedCache(NONE)
    k, v = kv()
    with pytest.raises(TypeError, match="floating-point"):
        cache.update(k.to(torch.int32), v.to(torch.int32), 0)
    cache.update(k, v, 0)
    k16, v16 = kv(torch.bfloat16)
    with pytest.raises(TypeError, match=r"holds torch.float32"):
        cache.update(k16, v16, 0)


def test_wrong_shapes_are_rejected():
    cache = CompressedCache(NONE)
    k, v = kv()
    with pytest.raises(ValueError, match="4-D"):
        cache.update(k[0], v[0], 0)
    with pytest.raises(ValueError, match="disagree"):
        cache.update(k, v[:, :, :2], 0)
    cache.update(k, v, 0)
    k2, v2 = kv(heads=3)
    with pytest.raises(ValueError, match="do not match the cached"):
        cache.update(k2, v2, 0)


def test_layer_index_out_of_range():
    model = tiny_model("llama-gqa")
    cache = CompressedCache(NONE, model=model)
    k, v = kv(dtype=torch.float32, dim=16)
    with pytest.raises(IndexError, match="out of range for a model with 2 layers"):
        cache.update(k, v, 2)
    with pytest.raises(IndexError, match=">= 0"):
        cache.update(k, v, -1)
    with pytest.raises(TypeError, match="layer_idx must be an integer"):
        cache.update(k, v, "0")  # type: ignore[arg-type]
    with pytest.raises(IndexError, match=r"layer 1 has not been created|holds no KV"):
        CompressedCache(NONE).layer(1)


def test_bad_crop_and_batch_indices():
    cache = CompressedCache(NONE)
    k, v = kv(tokens=10)
    cache.update(k, v, 0)
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(3)
    with pytest.raises(ValueError, match="cannot remove 11 tokens"):
        cache.crop(-11)
    with pytest.raises(IndexError, match="out of range for a batch of 1"):
        cache.batch_select_indices(torch.tensor([1]))


def test_a_layer_the_model_reads_or_asks_for_that_a_lazy_cache_cannot_know_is_a_clear_error():
    # models with cache layers of their own kinds read cache.layers[i] first (Qwen4-exp's indexer layer) or call
    # their layer class's methods (DeepSeek-V4's store_compression_weights): without model= the cache cannot know
    cache = CompressedCache(NONE)
    with pytest.raises(LayerKindError, match=r"read cache layer 3 before any update.*model=model") as raised:
        cache.layers[3]
    assert isinstance(raised.value, (IndexError, ValueError))
    k, v = kv()
    cache.update(k, v, 0)
    layer = cache.layers[0]
    with pytest.raises(LayerKindError, match=r"asked cache layer 0 .* for 'store_compression_weights'.*model=model"):
        layer.store_compression_weights("compressor", k, v)
    # an attribute probe still reads as on any object, and a copy is unaffected
    assert not hasattr(layer, "update_indexer") and getattr(layer, "record_past_x", 7) == 7
    with pytest.raises(AttributeError) as private:
        _ = layer._no_such_thing
    assert type(private.value) is AttributeError
    twin = copy.deepcopy(cache)
    assert torch.equal(twin.layers[0].keys, layer.keys) and isinstance(twin.layers, type(cache.layers))
    # with a model the layers exist from the start, and an index past them is transformers' plain IndexError
    built = CompressedCache(NONE, model=tiny_model("llama-gqa"))
    with pytest.raises(IndexError) as past:
        built.layers[5]
    assert not isinstance(past.value, LayerKindError)


def test_unsupported_layer_type_is_a_clear_error_at_construction():
    config = tiny_model("qwen3-sliding").config.__class__.from_dict(tiny_model("qwen3-sliding").config.to_dict())
    config.layer_types = ["sliding_attention", "indexed_attention"]
    with pytest.raises(ValueError, match=r"layer type 'indexed_attention' \(layer 1 of qwen3\): .*indexer.*DynamicCache"):
        CompressedCache(NONE, model_config=config)


def test_a_cache_reused_with_another_batch_size_says_so():
    """Not a raw torch.cat error from inside the cache: the library's own ValueError, before any layer runs."""
    model = tiny_model("llama-gqa")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=16), model=model)
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache)
        with pytest.raises(ValueError, match=r"holds 1 batch row.*passes 2.*new cache"):
            model(random_ids(2, 5), cache=cache)
    cache.reset()
    with torch.no_grad():
        model(random_ids(2, 5), cache=cache)  # a reset cache takes a new batch
    assert cache.get_seq_length() == 5


ADVICE = ("generate() continues the sequence a cache holds, so its input must be the cached tokens (cache.token_ids) "
          "followed by new ones; for another prompt use a new cache or call cache.reset()")


def test_a_cache_reused_with_another_prompt_is_refused_in_one_line():
    """``generate()`` with a used cache and a prompt of at most its length: one ValueError before any layer runs
    (without the check: transformers' raw reshape error for a prompt of at most half the cache, a silent
    continuation from the stale K/V otherwise). After ``reset()`` the cache generates as a new one does."""
    model = tiny_model("llama-gqa")
    config = CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=4)
    cache = CompressedCache(config, model=model)
    first = random_ids(1, 40, seed=1)
    out = model.generate(first, cache=cache, max_new_tokens=3, do_sample=False)
    out = model.generate(out, cache=cache, max_new_tokens=2, do_sample=False)  # a continuation is fine
    held = cache.get_seq_length()
    assert held == 44 and torch.equal(cache.token_ids, out[:, :-1])
    for length, problem in ((10, "passes none after them"), (40, "positions start at 4"),
                            (44, "positions start at 0")):
        with pytest.raises(ValueError) as info:
            model.generate(random_ids(1, length, seed=length), cache=cache, max_new_tokens=2, do_sample=False)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"CompressedCache holds {held} tokens"), message
        assert problem in message and message.endswith(ADVICE), message
        assert cache.get_seq_length() == held  # refused before the forward: nothing appended
    cache.reset()
    other = random_ids(1, 30, seed=7)
    again = model.generate(other, cache=cache, max_new_tokens=4, do_sample=False)
    fresh = model.generate(other, cache=CompressedCache(config, model=model), max_new_tokens=4, do_sample=False)
    assert torch.equal(again, fresh)


def test_model_must_be_the_model_object():
    with pytest.raises(TypeError) as info:
        CompressedCache(CompressionConfig(mode="lossless"), model="smollm2")  # type: ignore[arg-type]
    assert str(info.value) == ("CompressedCache: model must be the model object (a torch.nn.Module, e.g. from "
                               "load_model()), got str 'smollm2'")
    with pytest.raises(TypeError, match=r"^CompressedCache: model_config must be a transformers PretrainedConfig, "
                                        r"got dict$"):
        CompressedCache(model_config={"num_hidden_layers": 2})  # type: ignore[arg-type]


def test_saving_to_a_folder_is_one_clear_error_before_any_coding(tmp_path, monkeypatch):
    from hf_kvcompress.cache import files

    model = tiny_model("llama-gqa")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=4), model=model)
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache)
    monkeypatch.setattr(files, "make_predictor", lambda *a, **k: pytest.fail("coding started"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(IsADirectoryError) as info:
        cache.save(".")
    assert str(info.value) == "save: '.' is a folder; pass a file path, e.g. 'cache.kvc'"
    with pytest.raises(FileNotFoundError, match=r"^save: the folder nowhere does not exist$"):
        cache.save("nowhere/x.kvc")


def test_saving_onto_a_device_or_into_an_unwritable_folder_is_refused_before_any_coding(tmp_path, monkeypatch):
    """The rename onto the target would replace a device node with a file, and a folder this process may not
    write fails only after the coding: both refused first."""
    import os

    from hf_kvcompress.cache import files

    model = tiny_model("llama-gqa")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=4), model=model)
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache)
    monkeypatch.setattr(files, "make_predictor", lambda *a, **k: pytest.fail("coding started"))
    monkeypatch.setattr(os, "replace", lambda *a, **k: pytest.fail("replaced"))
    with pytest.raises(ValueError, match=r"^save: '/dev/null' is a device or FIFO, not a regular file; pass a file "
                                         r"path$"):
        cache.save("/dev/null")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: False if str(path) == str(tmp_path)
                        else real_access(path, mode, **k))  # as root every folder is writable: say this one is not
    with pytest.raises(PermissionError, match=rf"^save: the folder {tmp_path} is not writable here"):
        cache.save(tmp_path / "x.kvc")



def _dynamic():
    from transformers import DynamicCache

    dynamic = DynamicCache()
    dynamic.update(*kv(), 0)
    return dynamic


#: (call on a cache and its saved file, the error type, the whole message's start)
_BAD_ARGUMENTS = {
    "save(123)": (lambda cache, path: cache.save(123), TypeError,
                  r"save: path must be a file path \(str or os.PathLike\), got int 123$"),
    "save('')": (lambda cache, path: cache.save(""), ValueError, r"save: path is empty; name a file$"),
    "save(DynamicCache)": (lambda cache, path: CompressedCache.save(_dynamic(), path.with_name("d.kvc")), TypeError,
                           r"save: the cache must be a CompressedCache \(to keep a transformers DynamicCache's K/V, "
                           r"put it into a PrefixStore or fill a CompressedCache\), got DynamicCache "),
    "load(None)": (lambda cache, path: CompressedCache.load(None), TypeError,
                   r"load: path must be a file path \(str or os.PathLike\), got NoneType None$"),
    "load(model=123)": (lambda cache, path: CompressedCache.load(path, model=123), TypeError,
                        r"load: model must be the model object \(a torch.nn.Module\) or None, got int 123$"),
    "load(verify='yes')": (lambda cache, path: CompressedCache.load(path, verify="yes"), TypeError,
                           r"load: verify must be a bool or None, got str 'yes'$"),
    "load(calibration=123)": (lambda cache, path: CompressedCache.load(path, calibration=123), TypeError,
                              r"load: calibration must be a Calibration or the path of a calibration folder or None, "
                              r"got int 123$"),
    "load(config=dict)": (lambda cache, path: CompressedCache.load(path, config={"mode": "none"}), TypeError,
                          r"load: config must be a CompressionConfig or None, got dict"),
}


@pytest.mark.parametrize("case", list(_BAD_ARGUMENTS))
def test_save_and_load_arguments_of_the_wrong_type_name_the_argument(tmp_path, monkeypatch, case):
    """Each a TypeError (an empty path: a ValueError) naming the argument and what it must be, raised before the
    file is read or anything is coded."""
    from hf_kvcompress.cache import files, persist

    model = tiny_model("llama-gqa")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=8, residual_tokens=4), model=model)
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache)
    path = cache.save(tmp_path / "x.kvc")
    monkeypatch.setattr(files, "make_predictor", lambda *a, **k: pytest.fail("coding started"))
    monkeypatch.setattr(persist, "_read", lambda *a, **k: pytest.fail("the file was read"))
    call, error, message = _BAD_ARGUMENTS[case]
    with pytest.raises(error, match="^" + message):
        call(cache, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.kvc"]
