"""Tiny random models for lossy-mode tests."""

from __future__ import annotations

import pytest
import torch
import transformers


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tiny_qwen3() -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.fixture(params=["llama", "qwen3"])
def tiny_model(request):
    return tiny_llama() if request.param == "llama" else tiny_qwen3()


@pytest.fixture
def llama():
    return tiny_llama()
