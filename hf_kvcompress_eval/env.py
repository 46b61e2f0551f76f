"""What a result depends on besides the suite: library versions, the machine, a peak-memory probe and an
independent walk of the bytes an object holds."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.metadata
import os
import platform
import re
import sys
from array import array
from typing import Any

import torch

PACKAGES = ("hf_kvcompress", "torch", "transformers", "datasets", "tokenizers", "accelerate", "constriction",
            "numpy", "safetensors", "zstandard", "zipnn", "hqq", "optimum-quanto", "kvpress", "matplotlib")


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages results depend on (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict[str, Any]:
    """The machine and the torch settings timings depend on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python_executable": sys.executable,
    }
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        info["load_average"] = None
    info["memory_total_gib"] = _meminfo_gib("MemTotal")
    info["cpu_model"] = _cpu_model()
    return info


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _meminfo_gib(key: str) -> float | None:
    text = _read("/proc/meminfo")
    if text is None:
        return None
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return round(int(found.group(1)) / 2**20, 2) if found else None


def _cpu_model() -> str | None:
    text = _read("/proc/cpuinfo")
    if text is None:
        return None
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else None


def _status_kib(key: str) -> int | None:
    text = _read("/proc/self/status")
    if text is None:
        return None
    found = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else None


class PeakMemory:
    """Peak resident-memory growth of this process over a ``with`` block, in bytes (Linux; None elsewhere).

    Frees what the allocator holds (``gc``, ``malloc_trim``), resets the kernel's high-water mark
    (``/proc/self/clear_refs``), and reads ``VmHWM - VmRSS(start)`` at the end. Counts everything the block
    allocates (cache, decoded blocks, activations), not only the cache.
    """

    def __init__(self) -> None:
        self.start: int | None = None
        self.peak_bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = _status_kib("VmRSS")
        except OSError:
            self.start = None
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _status_kib("VmHWM")
        if self.start is not None and peak is not None:
            self.peak_bytes = max(0, peak - self.start) * 1024


def walk_held_bytes(root, skip=()) -> int:
    """Bytes reachable from ``root``, found without asking it: every tensor's whole storage (each storage
    once, so a view that pins a larger buffer counts that buffer) and every bytes object and `array.array`, through object
    attributes, dicts, lists, tuples and sets. Modules (the model) and the objects in ``skip`` are not
    walked."""
    seen: set[int] = {id(obj) for obj in skip}
    storages: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type, str, int, float, bool)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (bytes, bytearray)):
            total += len(obj)
        elif isinstance(obj, memoryview):
            total += obj.nbytes
        elif isinstance(obj, array):
            total += len(obj) * obj.itemsize
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, name) for name in obj.__slots__ if hasattr(obj, name))
    return total
