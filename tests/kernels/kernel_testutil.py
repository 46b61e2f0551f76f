"""Helpers for the kernel tests: the backends to parametrise over (Triton skipped when not installed)."""

from __future__ import annotations

import pytest

from hf_kvcompress.kernels.dispatch import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
