"""Shared fixtures: tiny random models (fast) and the embedded default model (marked real_model)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

#: torch's own thread count here (one per core)
TORCH_THREADS = torch.get_num_threads()


def pytest_runtest_setup(item):
    """Tiny models run on one torch thread: their operations are too small to split, and beside any other
    process on a two-core machine two OpenMP threads spin against it (a greedy run of 8 tokens took 0.02-0.2 s
    on one thread, 0.5-8 s on two). The real-model tier keeps every thread (its prefills are matrix products
    worth splitting). Set before the test's fixtures, so that session fixtures built for the real-model tier (the
    default model, its calibration) get every thread too; a test that sets its own count has it restored by the
    next test's setup. (No test needs a thread count of its own: saved files record threads only for predictors
    that rerun the model, `persist.recorded_environment`.)"""
    torch.set_num_threads(TORCH_THREADS if item.get_closest_marker("real_model") is not None else 1)


def pytest_collection_modifyitems(config, items):
    """The whole loader fuzz (marked ``fuzz``, minutes) runs only when asked for: ``-m fuzz``; its seeded sample
    runs always (tests/test_fuzz_loaders.py)."""
    if "fuzz" in (config.getoption("markexpr") or ""):
        return
    wanted = [item for item in items if item.get_closest_marker("fuzz") is None]
    if len(wanted) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("fuzz") is not None])
        items[:] = wanted


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


@pytest.fixture(scope="session")
def smollm2_calibration(smollm2):
    """A quick context-only calibration of the default model (2 x 512 calibration-split tokens): enough to
    exercise the calibrated paths; fitted once for every real-model test that reads one."""
    from hf_kvcompress.calibration import Calibration

    model, tokenizer = smollm2
    return Calibration.fit(model, tokenizer, tokens=1024, chunk=512, predictors=("context",), progress=False)
