"""Shared fixtures: tiny random models (fast) and the embedded default model (marked real_model)."""

from __future__ import annotations

import pytest
from helpers import tiny_model


@pytest.fixture(params=["llama-gqa", "llama-mqa", "qwen3-gqa"])
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded default, SmolLM2-135M-Instruct in bf16."""
    from hf_kvcompress.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def shakespeare_prompt(smollm2):
    """A 300-token prompt from the evaluation split."""
    from hf_kvcompress.data import token_ids

    return token_ids(smollm2[1], 300, split="evaluation", offset=2000)
