"""The codec's device path: when x / mean / std live on a GPU (or the kernels are forced, as in the
interpreter tests), the per-element model and the window decoding run through `hf_kvcompress.kernels`
(Triton, or its torch reference) on that device; entropy *encoding* stays on constriction (CPU).

Streams are byte-identical to the host path (tested): the kernels implement the same integer arithmetic
and constriction's ANS decoder bit for bit. Checksums (per-window and global CRC32) and the mean / std
fingerprints are still computed on host copies, so a device decode moves the decoded bits (2 or 4 bytes per
element) and the statistics to the host once; a device CRC would remove that (docs/kernels.md).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .broadcast import ParamSource
from .config import CodecConfig
from .errors import CorruptStreamError
from .params import Params
from .plan import window_sigma_bits
from .symbols import Format, raw_padded_nbytes, unpack_raw

__all__ = ["DeviceSource", "decode_on_device", "device_of"]


def device_of(*tensors) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return torch.device("cpu")


def _flat_stat(value, host: np.ndarray | None, shape: tuple[int, ...], device) -> torch.Tensor | None:
    """mean / std as a flat float32 tensor of x's size on ``device`` (the same float32 values the host
    path validated and fingerprinted)."""
    if host is None:
        return None
    if isinstance(value, torch.Tensor) and value.device == torch.device(device):
        t = value.detach().to(torch.float32)
    else:
        t = torch.from_numpy(host).to(device)
    return t.reshape(host.shape).expand(shape).reshape(-1)


class DeviceSource:
    """A `ParamSource` whose per-element model runs on the device; everything else is the host source's."""

    def __init__(self, host: ParamSource, shape: tuple[int, ...], x: torch.Tensor | None, mean, std,
                 mean32: np.ndarray | None, std32: np.ndarray | None, cfg: CodecConfig, device) -> None:
        self.host, self.fmt, self.device = host, host.fmt, torch.device(device)
        self.mean_steps = cfg.mean_steps
        self.mean = _flat_stat(mean, mean32, shape, device)
        if self.mean is None:
            self.mean = torch.zeros(int(np.prod(shape)), dtype=torch.float32, device=device)
        self.std = _flat_stat(std, std32, shape, device)
        self.x = None if x is None else x.detach().to(device).reshape(-1)
        self.tables = kernels.tables_for(self.fmt, self.device, cfg.marginal, cfg.escape)

    def __getattr__(self, name: str):
        return getattr(self.host, name)

    def _std(self, a: int, b: int, sigma_bits: np.ndarray | None) -> torch.Tensor:
        if self.std is not None:
            return self.std[a:b]
        assert sigma_bits is not None
        return torch.from_numpy(sigma_bits.astype(np.int32)).to(self.device).view(torch.float32)

    def params(self, a: int, b: int, sigma_bits: np.ndarray | None = None) -> Params:
        p = kernels.element_params(self.mean[a:b], self._std(a, b, sigma_bits), self.fmt, self.mean_steps, self.tables)
        return _host_params(p)

    def symbols(self, a: int, b: int, sigma_bits: np.ndarray | None = None):
        """(params, valid, symbol) of elements a..b-1 from the encode kernel (host arrays)."""
        assert self.x is not None
        out = kernels.encode_model(self.x[a:b], self.mean[a:b], self._std(a, b, sigma_bits), self.mean_steps,
                                   self.tables)
        p = _host_params((out["tid"], out["cp"], out["cn"], out["s"]))
        return p, out["escaped"].cpu().numpy() == 0, out["sym"].cpu().numpy()


def _host_params(p) -> Params:
    tid, cp, cn, s = (t.cpu().numpy() for t in p)
    return Params(tid.astype(np.uint16), cp, cn, s.astype(np.int8))


def decode_on_device(d, mean, std, device) -> torch.Tensor:
    """All windows of the parsed stream ``d`` (a `decoder.Decoder`, non-causal) decoded on ``device``: the
    bit patterns (int16 / int32 tensor, flat), checked against every CRC."""
    fmt: Format = d.fmt
    lengths = d.lengths
    n, nw = int(d.h.numel), int(lengths.size)
    cfg = d.cfg
    src = DeviceSource(d.src, d.h.shape, None, mean, std, d.src_mean32, d.src_std32, cfg, device)
    sigma = None if d.h.has_std else window_sigma_bits(d.entries["sigma"].astype(np.int64), lengths)
    params = kernels.element_params(src.mean, src._std(0, n, sigma), fmt, cfg.mean_steps, src.tables)
    words, word_lo, word_count, raw = [], np.zeros(nw, np.int64), np.zeros(nw, np.int64), []
    start = 0
    for w, m in enumerate(lengths.tolist()):
        lo, hi = int(d.offsets[w]), int(d.offsets[w + 1])
        nraw = raw_padded_nbytes(m, fmt) if fmt.raw_bits else 0
        count = (hi - lo - nraw) // 4
        if count < 0:
            raise CorruptStreamError("corrupt codec stream: window payload too short for its raw bits")
        words.append(np.frombuffer(d.buf, dtype="<u4", count=count, offset=lo).astype(np.int64))
        word_lo[w], word_count[w] = start, count
        start += count
        if fmt.raw_bits:
            raw.append(unpack_raw(d.buf[lo + 4 * count : hi], m, fmt))
    dev = torch.device(device)
    words_t = torch.from_numpy(np.concatenate(words) if words else np.zeros(0, np.int64)).to(dev)
    tiers = torch.tensor([cfg.tier_of_length(int(m)) for m in lengths], dtype=torch.int32, device=dev)
    lengths_t = torch.from_numpy(lengths.astype(np.int64)).to(dev)
    sym, escaped, ok = kernels.decode_windows(words_t, torch.from_numpy(word_lo).to(dev),
                                              torch.from_numpy(word_count).to(dev), lengths_t, tiers, params[0],
                                              src.tables)
    if not bool(ok.all()):
        bad = int(torch.nonzero(~ok)[0, 0])
        raise CorruptStreamError(f"corrupt codec stream: window {bad} does not decode to an empty coder")
    raw_t = (torch.from_numpy(np.concatenate(raw).astype(np.int32)).to(dev) if raw
             else torch.zeros(n, dtype=torch.int32, device=dev))
    return kernels.decode_bits(sym, escaped, params, raw_t, fmt, src.tables)

