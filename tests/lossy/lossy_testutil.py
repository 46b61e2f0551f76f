"""Helpers for the lossy tests: an independent walk of the tensors a lossy layer holds."""

from __future__ import annotations

import torch


def _walk(obj, seen: set[int], found: dict[int, int]) -> None:
    """Every tensor storage reachable from ``obj`` through hf_kvcompress objects, lists, tuples and dicts."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _walk(item, seen, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _walk(item, seen, found)
    elif type(obj).__module__.startswith("hf_kvcompress") and hasattr(obj, "__dict__"):
        for name, item in vars(obj).items():
            if name != "model":  # the model is the user's, not the cache's
                _walk(item, seen, found)


def walked_bytes(layer) -> int:
    found: dict[int, int] = {}
    _walk(layer, set(), found)
    return sum(found.values())
