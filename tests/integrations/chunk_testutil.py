"""Chunks for the KV chunk coder and LMCache serde tests: synthetic ones with channel structure (so they
compress, like real KV) and real ones from a tiny model with a small calibration of it."""

from __future__ import annotations

import functools
import struct
import zlib

import torch
from helpers import fresh_tiny_model, random_ids

from hf_kvcompress.calibration import Calibration
from hf_kvcompress.integrations.kv_chunk import HEADER
from hf_kvcompress.predictors.rerun import run_decoder

#: SmolLM2-135M's chunk at LMCache's default 256 tokens: [2, 30 layers, 256 tokens, 3 kv heads x 64]
SMOLLM2_SHAPE = (2, 30, 256, 192)



def channel_chunk(shape=(2, 3, 64, 32), dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Gaussian values with a mean and spread per (k/v, layer, channel), spread also varying by token."""
    g = torch.Generator().manual_seed(seed)
    kinds, layers, tokens, hidden = shape
    mean = torch.randn(kinds, layers, 1, hidden, generator=g) * 2
    spread = torch.rand(kinds, layers, 1, hidden, generator=g) * 3 + 0.05
    token_scale = torch.rand(1, 1, tokens, 1, generator=g) + 0.5
    return (mean + spread * token_scale * torch.randn(shape, generator=g)).to(dtype)


def noise_chunk(shape=(2, 2, 16, 32), seed: int = 0) -> torch.Tensor:
    """Uniformly random 16-bit patterns (NaNs and infinities included): incompressible."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, shape, generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@functools.cache
def tiny_calibrated() -> tuple[torch.nn.Module, Calibration]:
    """A bf16 tiny Llama (2 layers, 2 kv heads x 16) and a ``context`` calibration of it on random ids."""
    model = fresh_tiny_model("llama-gqa", torch.bfloat16)
    calibration = Calibration.fit(model, None, ids=random_ids(1, 256, seed=3), tokens=256, chunk=128,
                                  predictors=("context",), progress=False)
    return model, calibration


def model_chunks(model: torch.nn.Module, tokens: int, chunk: int, seed: int = 1) -> list[torch.Tensor]:
    """The model's KV of ``tokens`` random ids as ``[2, layers, chunk, kv_heads * head_dim]`` chunks."""
    cache, _ = run_decoder(model, random_ids(1, tokens, seed=seed))
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, heads, tokens, dim]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    layers, heads, n, dim = keys.shape
    kv = torch.stack([keys, values]).permute(0, 1, 3, 2, 4).reshape(2, layers, n, heads * dim)
    return [kv[:, :, start : start + chunk].contiguous() for start in range(0, n - chunk + 1, chunk)]


def resealed(payload: bytes | bytearray, byte: int | None = None, bit: int = 0) -> bytes:
    """``payload`` with bit ``bit`` of byte ``byte`` flipped (None: no flip) and its payload CRC recomputed, as a
    faulty writer would: what the decoder's structural checks must catch behind the CRC."""
    damaged = bytearray(payload)
    if byte is not None:
        damaged[byte] ^= 1 << bit
    crc = zlib.crc32(damaged[HEADER.size :], zlib.crc32(damaged[: HEADER.size - 4]))
    struct.pack_into("<I", damaged, HEADER.size - 4, crc)
    return bytes(damaged)
