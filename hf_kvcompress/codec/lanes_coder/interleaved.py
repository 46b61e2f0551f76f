"""The ``lanes`` coder (`CodecConfig(coder="lanes")`, the default): compiled interleaved rANS, each stream one
window (`lanes`: layout, host batch encode / decode; `jit`: the numba kernels), decoded by the Triton kernels
(`device_triton`) where a batch's statistics or ``out`` live on a CUDA device with Triton (`triton_device`).
docs/codec_format.md section 12."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..codec_config import CodecConfig
from ..interface import Coder, triton_device
from ..registry import register
from ..symbols import Format
from ..tables import Marginal
from . import lanes


@register
class LanesCoder(Coder):
    name = "lanes"
    magic = (lanes.MAGIC,)
    windows = ("fixed",)
    batched = True

    def check_config(self, cfg: CodecConfig) -> None:
        if cfg.window != "fixed":
            raise ValueError(f"CodecConfig(coder='lanes') codes each stream as one window: window must be 'fixed', "
                             f"got {cfg.window!r} (adaptive windows: coder='ans')")

    def encode_batch(self, x, mean, std, cfg: CodecConfig, threads: int | None = None) -> list[bytes]:
        return lanes.encode_batch_impl(x, mean, std, cfg, threads=threads)

    def encode(self, x, mean, std, cfg: CodecConfig) -> bytes:
        return lanes.encode_one(x, mean, std, cfg)

    def decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                     threads: int | None = None, verify: bool | Sequence[bool] = True) -> torch.Tensor:
        device = triton_device(mean, std, out)
        if device is not None:
            lanes.check_threads(threads)
            from .. import device_triton  # optional dependency, imported when a kernel runs as Triton

            return device_triton.decode_batch_triton(blobs, mean, std, cfg, device=device, out=out, verify=verify)
        return lanes.decode_batch_impl(blobs, mean, std, cfg, out=out, threads=threads, verify=verify)

    def start_decode_batch(self, blobs, mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                           threads: int = 1, verify: bool | Sequence[bool] = True,
                           chunks: int = 8) -> lanes.DecodeJob | None:
        if triton_device(mean, std, out) is not None:
            return None
        lanes.check_threads(threads)
        return lanes.DecodeJob(blobs, mean, std, cfg, out, verify, chunks).start(threads)

    def decode(self, blob, mean, std, config: CodecConfig | None, marginal: Marginal | None = None,
               threads: int = 1, workers: int = 1) -> torch.Tensor:
        return lanes.decode_one(blob, mean, std, _config(config, marginal))

    def decode_range(self, blob, start: int, stop: int, mean, std, config: CodecConfig | None,
                     marginal: Marginal | None = None) -> torch.Tensor:
        return lanes.decode_range_one(blob, start, stop, mean, std, _config(config, marginal))

    def stream_infos(self, blobs, config: CodecConfig | None,
                     marginal: Marginal | None = None) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        cfg = _config(config, marginal)
        return [lanes.stream_info_one(blob, cfg) for blob in blobs]

    def payload_bytes(self, blob: bytes, n: int, fmt: Format) -> int:
        return len(blob) - lanes.parse_header(bytes(blob), verify=False).data_start


def _config(config: CodecConfig | None, marginal: Marginal | None) -> CodecConfig:
    """The config to check a lanes stream's digest against: ``config`` (None: `CodecConfig()`, the default
    coder's), its marginal supplied by ``marginal=`` if given."""
    if marginal is not None and not isinstance(marginal, Marginal):
        raise TypeError(f"codec: marginal must be a Marginal or None, got {type(marginal).__name__}")
    if config is None:
        config = CodecConfig()
    if not isinstance(config, CodecConfig):
        raise TypeError(f"codec: config must be a CodecConfig or None, got {type(config).__name__}")
    if marginal is None:
        return config
    if config.marginal is not None and marginal != config.marginal:
        raise ValueError("codec: marginal= differs from config.marginal; pass the marginal in one place")
    return dataclasses.replace(config, marginal=marginal)
