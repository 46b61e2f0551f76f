"""The thread plan (`hf_kvcompress.threads`): torch's threads and the codec's workers chosen within the cores the
process may run on, one override (``HF_KVCOMPRESS_THREADS`` or `configure_threads`), applied by the command line
and by `configure_threads`, never by building a cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_model

from hf_kvcompress import CompressedCache, CompressionConfig, configure_threads
from hf_kvcompress import threads as threads_mod
from hf_kvcompress.threads import ENV, ThreadPlan, thread_plan, torch_threads


@pytest.fixture
def affinity(monkeypatch):
    """Set the CPU affinity the library sees (no override in the environment, none configured)."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(threads_mod, "_configured", None)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))

    return set_cores


@pytest.mark.parametrize(("cores", "torch_count", "codec"), [(1, 1, 1), (2, 1, 2), (3, 1, 3), (8, 4, 8), (64, 32, 64)])
def test_the_plan_splits_the_cores_the_process_may_use(affinity, cores, torch_count, codec):
    affinity(cores)
    assert thread_plan() == ThreadPlan(cores=cores, torch=torch_count, codec=codec, source="CPU affinity")


def test_the_environment_overrides_the_affinity_and_a_call_overrides_both(affinity, monkeypatch):
    affinity(2)
    monkeypatch.setenv(ENV, "6")
    assert thread_plan() == ThreadPlan(cores=6, torch=3, codec=6, source=ENV)
    before = torch.get_num_threads()
    try:
        plan = configure_threads(4)
        assert plan == ThreadPlan(cores=4, torch=2, codec=4, source="configure_threads")
        assert torch.get_num_threads() == 2
        assert thread_plan() == plan  # the count given stays the override
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("text", ["0", "two", "-3"])
def test_a_bad_environment_value_is_one_clear_error(affinity, monkeypatch, text):
    affinity(2)
    monkeypatch.setenv(ENV, text)
    with pytest.raises(ValueError, match=rf"^{ENV}='{text}': expected a number of cores >= 1") as info:
        thread_plan()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("cores", "error"), [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_configure_threads_checks_its_count(affinity, cores, error):
    affinity(2)
    with pytest.raises(error, match=r"^configure_threads: cores must (be an integer|lie in \[1, 256\])"):
        configure_threads(cores)


def test_a_cache_takes_the_plans_codec_workers_and_leaves_torch_alone(affinity, monkeypatch):
    affinity(3)
    model = tiny_model("llama-gqa")
    torch.set_num_threads(1)
    lossless = CompressionConfig(mode="lossless")
    assert CompressedCache(lossless, model=model).lossless.workers == 3
    monkeypatch.setenv(ENV, "5")
    assert CompressedCache(lossless, model=model).lossless.workers == 5
    fixed = CompressionConfig(mode="lossless", lossless={"workers": 1})
    assert CompressedCache(fixed, model=model).lossless.workers == 1
    assert torch.get_num_threads() == 1  # building a cache never changes torch's threads


def test_torch_threads_sets_a_count_for_a_block_and_zero_takes_the_plan(affinity):
    affinity(4)
    torch.set_num_threads(3)
    with torch_threads(0):
        assert torch.get_num_threads() == 2
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3
    with pytest.raises(ValueError, match=r"count \(0: the thread plan's\) must be >= 0"):
        torch_threads(-1)


def test_version_and_help_import_neither_torch_nor_transformers():
    code = ("import sys\nfrom hf_kvcompress.cli import main\n"
            "for argv in (['--version'], ['--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'numba') if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "hf-kvcompress " in out and "{demo,calibrate,store,eval,bench}" in out
    assert "HEAVY []" in out, out


def test_the_error_types_and_calibration_import_from_the_package_without_torch():
    """`from hf_kvcompress import CacheFileError` (every documented error type) imports no torch; the names are the
    types the library raises, and `Calibration` loads on first use like `CompressedCache`."""
    import hf_kvcompress
    from hf_kvcompress import errors

    code = ("import sys\nfrom hf_kvcompress import CacheFileError, CalibrationError, ChunkPayloadError\n"
            "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out
    documented = sorted(name for name, value in vars(errors).items() if isinstance(value, type)
                        and issubclass(value, Exception) and value.__module__ == errors.__name__ and name != "CliError")
    assert sorted(hf_kvcompress.ERRORS) == documented
    for name in documented:
        assert getattr(hf_kvcompress, name) is getattr(errors, name) and name in hf_kvcompress.__all__
    from hf_kvcompress.calibration import Calibration
    assert hf_kvcompress.Calibration is Calibration


@pytest.mark.parametrize("text", [str(threads_mod.MAX_WORKERS + 1), str(2**40)])
def test_an_environment_value_beyond_the_bound_is_refused(affinity, monkeypatch, text):
    affinity(2)
    monkeypatch.setenv(ENV, text)
    with pytest.raises(ValueError, match=rf"^{ENV}='{text}': expected a number of cores >= 1 and <= "):
        thread_plan()
    with pytest.raises(ValueError, match=r"cores must lie in \[1, 256\]"):
        thread_plan(int(text))
