"""The one place that decides whether a kernel runs as Triton or as its pure-torch reference.

Rule: Triton when it is importable and the tensors are on a CUDA device; the torch reference otherwise
(CPU tensors, or no Triton). ``HF_KVCOMPRESS_KERNELS`` (``auto`` / ``torch`` / ``triton``) or the `forced`
context manager override it: ``triton`` with CPU tensors runs the kernels in Triton's interpreter, which is
how the tests check them on a machine without a GPU (set ``TRITON_INTERPRET=1`` before importing triton).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "torch", "triton")
_ENV = "HF_KVCOMPRESS_KERNELS"
_forced: str | None = None


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``import triton`` works (it is an optional dependency)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested() -> str:
    """The backend asked for: `forced`, else the environment variable, else ``auto``."""
    choice = _forced or os.environ.get(_ENV, "auto") or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{_ENV} must be one of {list(BACKENDS)}, got {choice!r}")
    return choice


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the kernels for these tensors should run as Triton (see module docstring)."""
    choice = requested()
    if choice == "torch":
        return False
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(f"{_ENV}=triton but triton cannot be imported")
        if not interpreting() and not all(t.is_cuda for t in tensors):
            raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
        return True
    return triton_available() and bool(tensors) and all(t.is_cuda for t in tensors)


def device_path(*tensors: torch.Tensor | None) -> bool:
    """Whether the codec should take its device (kernel) path for these inputs: any of them on CUDA, or
    ``triton`` forced (the interpreter tests)."""
    if requested() == "triton":
        return True
    return any(t is not None and t.is_cuda for t in tensors)


@contextlib.contextmanager
def forced(backend: str) -> Iterator[None]:
    """Run the block with ``backend`` (``torch`` / ``triton`` / ``auto``) regardless of the environment."""
    global _forced
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    previous, _forced = _forced, backend
    try:
        yield
    finally:
        _forced = previous
