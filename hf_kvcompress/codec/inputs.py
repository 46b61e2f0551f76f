"""Argument checking for encode / decode: x, mean, std, config, and the mean/std fingerprints."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import torch

from .config import CodecConfig
from .symbols import Format, format_of

_NO_FP = bytes(16)


def check_x(x: object) -> tuple[torch.Tensor, Format]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec: x must be a torch.Tensor, got {type(x).__name__}")
    check_has_data(x, "x")
    return x, format_of(x.dtype)


def check_has_data(t: torch.Tensor, name: str) -> None:
    """Meta tensors (and fake ones) have a shape but no values to code or to predict with."""
    if t.device.type == "meta":
        raise ValueError(f"codec: {name} is on the meta device: it has no values (load the weights first)")


def check_stat(value: object, name: str, shape: tuple[int, ...], is_std: bool) -> np.ndarray | None:
    """mean/std -> float32 numpy array with x's ndim (broadcastable), after checking shape and values."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"codec: {name} must be a tensor or a number, got bool")
    if isinstance(value, (int, float)):
        t = torch.tensor(float(value), dtype=torch.float64)
    elif isinstance(value, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, torch.Tensor):
        check_has_data(value, name)
        t = value
    else:
        raise TypeError(f"codec: {name} must be a torch.Tensor or a number, got {type(value).__name__}")
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"codec: {name} must be real-valued, got dtype {t.dtype}")
    if t.dim() > len(shape):
        raise ValueError(f"codec: {name} of shape {tuple(t.shape)} has more dims than x {shape}")
    padded = (1,) * (len(shape) - t.dim()) + tuple(t.shape)
    if any(c != 1 and c != s for c, s in zip(padded, shape)):
        raise ValueError(f"codec: {name} of shape {tuple(t.shape)} does not broadcast to x's shape {shape}")
    arr = t.detach().to("cpu", torch.float32).contiguous().numpy().reshape(padded)
    if not np.isfinite(arr).all():
        bad = "NaN" if np.isnan(arr).any() else "inf"
        raise ValueError(f"codec: {name} contains {bad}; it must be finite")
    if is_std and (arr < 0).any():
        raise ValueError(f"codec: std must be >= 0, got a minimum of {float(arr.min())}")
    return np.ascontiguousarray(arr)


def fingerprint(arr: np.ndarray | None, tag: bytes) -> bytes:
    """16-byte hash of the float32 values and (padded) shape the coder used; zeros for None."""
    if arr is None:
        return _NO_FP
    h = hashlib.blake2b(tag, digest_size=16)
    h.update(np.asarray(arr.shape, dtype="<u8").tobytes())
    h.update(arr.astype("<f4").tobytes())
    return h.digest()


def fingerprint8(arr: np.ndarray | None, tag: bytes) -> bytes:
    """8-byte fingerprint for the compact layout: CRC-32 and Adler-32 of the same bytes `fingerprint`
    hashes (4x cheaper than BLAKE2b; it guards against a predictor that did not reproduce, not an
    adversary). Zeros for None."""
    if arr is None:
        return bytes(8)
    head = tag + np.asarray(arr.shape, dtype="<u8").tobytes()
    data = np.ascontiguousarray(arr, dtype="<f4").view(np.uint8).reshape(-1)
    crc = zlib.crc32(data, zlib.crc32(head))
    adler = zlib.adler32(data, zlib.adler32(head))
    return crc.to_bytes(4, "little") + adler.to_bytes(4, "little")


def check_config(config: object) -> CodecConfig:
    if config is None:
        return CodecConfig()
    if not isinstance(config, CodecConfig):
        raise TypeError(f"codec: config must be a CodecConfig, got {type(config).__name__}")
    return config
