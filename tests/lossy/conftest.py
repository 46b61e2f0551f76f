"""Tiny random models for lossy-mode tests: fresh instances, since lossy mode switches a model's attention."""

from __future__ import annotations

import pytest
from helpers import fresh_tiny_model


@pytest.fixture(params=["llama-gqa", "qwen3-gqa"])
def tiny_model(request):
    return fresh_tiny_model(request.param)


@pytest.fixture
def llama():
    return fresh_tiny_model("llama-gqa")
