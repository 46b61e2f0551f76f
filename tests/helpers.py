"""Test helpers: tiny random models (fast, deterministic: attention-only, sliding-window and hybrid ones), random
token ids and bit-exact comparisons."""

from __future__ import annotations

import functools

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY = {
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama-mqa": (LlamaConfig, LlamaForCausalLM, {"num_attention_heads": 4, "num_key_value_heads": 1}),
    "qwen3-gqa": (Qwen3Config, Qwen3ForCausalLM, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}),
    "qwen3-sliding": (
        Qwen3Config,
        Qwen3ForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def fresh_tiny_model(kind: str, dtype: torch.dtype = torch.float32, layers: int = 2):
    """A new randomly initialised ``layers``-layer model of ``kind`` (see TINY), deterministic, eval mode: for
    tests that change the model (lossy mode switches its attention implementation). Use >= 6 layers where a
    per-step cost or a memo of the last layers could hide behind two."""
    config_cls, model_cls, extra = TINY[kind]
    config = config_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


#: the shared instance of `fresh_tiny_model` for tests that leave the model as it is
tiny_model = functools.cache(fresh_tiny_model)



#: sliding windows for caches of 8-token blocks and 4 residual tokens: a window of 48 seals blocks in lossless
#: mode (47 >= 4 + 4 * 8); one of 12 stays raw (tests/layer/test_sliding.py checks the arithmetic)
SEALING, RAW = 48, 12


@functools.cache
def sliding_model(window: int, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """Six layers, sliding and full alternating (5:1 would leave one full layer in six; alternating shows both
    kinds next to each other, as a layer below / above each other)."""
    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, use_sliding_window=True, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 3,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


HYBRID_COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
                 "max_position_embeddings": 512}
HYBRID = {
    # conv layers beside attention layers
    "lfm2": {"num_hidden_layers": 6, "full_attn_idxs": [2, 5]},
    # mamba and attention in every layer ("hybrid")
    "falcon_h1": {"num_hidden_layers": 6, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
                  "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 16},
}


@functools.cache
def hybrid_model(kind: str, dtype: torch.dtype = torch.float32):
    """A six-layer hybrid model of ``kind`` (see HYBRID): transformers' own state layers beside attention."""
    config = AutoConfig.for_model(kind, **{**HYBRID_COMMON, **HYBRID[kind]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def random_ids(batch: int, length: int, seed: int = 0) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)


def tiny_calibration(model, tokens: int, **fit):
    """A calibration fitted on ``tokens`` random ids (seed 9, chunks of 128): the tests' calibrated predictors."""
    from hf_kvcompress.calibration import Calibration

    return Calibration.fit(model, None, ids=random_ids(1, tokens, seed=9), tokens=tokens, chunk=128, progress=False,
                           **fit)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two tensors (dtype and shape too; NaN payloads, infinities, -0.0 and subnormals)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def assert_continues_identically(model, reference, cache, more: torch.Tensor) -> None:
    """Feed ``more`` to ``model`` with ``reference`` (a DynamicCache) and with ``cache``: the logits and every
    layer's keys and values afterwards must be the same bits."""
    with torch.no_grad():
        want = model(more, cache=reference, use_cache=True).logits
        got = model(more, cache=cache, use_cache=True).logits
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    for layer, ref in zip(cache.kv_layers(), reference.layers):
        assert same_bits(layer.keys, ref.keys) and same_bits(layer.values, ref.values)


def count_lanes_decoders(monkeypatch) -> dict[str, int]:
    """Count the streams each lanes decoder decodes from now on (the Triton one, the host's compiled kernel):
    which route a decode took, as work counted, not timed."""
    from hf_kvcompress.codec import device_triton, jit

    return _count_decoders(monkeypatch, device_triton, "decode_batch_triton", lambda blobs, *_a, **_k: len(blobs),
                           jit)


def count_huff_decoders(monkeypatch) -> dict[str, int]:
    """`count_lanes_decoders` for the huff family (huff, mhuff): streams decoded by its Triton decoder
    (`huff_triton.decode_prepared`) and by the host's compiled kernel (`kernels.decode_streams`)."""
    from hf_kvcompress.codec.huff_coder import huff_triton, kernels

    return _count_decoders(monkeypatch, huff_triton, "decode_prepared", lambda prep, *_a, **_k: prep.parsed.tat.size,
                           kernels)


def _count_decoders(monkeypatch, device_module, device_name: str, streams, host_module) -> dict[str, int]:
    """Wrap ``device_module.device_name`` (``streams(*args)``: how many streams a call decodes) and
    ``host_module.decode_streams`` (the compiled kernel, whose last two arguments are its stream range) to count the
    streams each decodes."""
    counts = {"triton": 0, "host": 0}
    device_decode, host_kernel = getattr(device_module, device_name), host_module.decode_streams

    def on_device(*args, **kwargs):
        counts["triton"] += streams(*args, **kwargs)
        return device_decode(*args, **kwargs)

    def on_host(*args):
        counts["host"] += args[-1] - args[-2]  # the kernel's stream range [s_lo, s_hi)
        return host_kernel(*args)

    monkeypatch.setattr(device_module, device_name, on_device)
    monkeypatch.setattr(host_module, "decode_streams", on_host)
    return counts
