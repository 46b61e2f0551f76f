"""The codec's tables as torch tensors on a device, for the device path (`device`) and the Triton kernels
(`device_triton`): one flat layout of every group, cached per format, p_hat, escape weights and device.

Group ids follow the codec (`tables`): 0..967 the N and W tables, 968 p_hat (the escape path, 2^16 or 2^13
symbols), then 969..971 the binary escape-flag models of the three window tiers (symbol 1 = escaped). Per group:
``off`` (start in ``freq`` / ``cum``), ``size``, ``half`` and ``radius`` (see `params`). ``cum`` is the exclusive
prefix sum inside each group, so a symbol's coding interval is ``[cum, cum + freq)`` out of ``2^24``: exactly
constriction's ``perfect=False`` categorical model with weights ``freq - 1`` (docs/codec_format.md, section 3).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .symbols import FORMATS_BY_CODE, Format
from .tables import ESCAPE_GROUP, TOTAL, Marginal, get_tables

FLAG_GROUP = ESCAPE_GROUP + 1  # + window tier (0, 1, 2)
N_GROUPS = FLAG_GROUP + 3


@dataclass(frozen=True)
class DeviceTables:
    freq: torch.Tensor  # int32 [total]
    cum: torch.Tensor  # int32 [total]
    off: torch.Tensor  # int64 [N_GROUPS]
    size: torch.Tensor  # int32 [N_GROUPS]
    half: torch.Tensor  # int32 [N_GROUPS]
    radius: torch.Tensor  # int32 [N_GROUPS]


@functools.lru_cache(maxsize=8)
def _host_tables(fmt_code: int, marginal: Marginal, escape: tuple[int, int, int]) -> DeviceTables:
    fmt: Format = FORMATS_BY_CODE[fmt_code]
    t = get_tables()
    phat = marginal.frequencies(fmt)
    flags = [np.array([TOTAL - (e << 8), e << 8], dtype=np.int64) for e in escape]
    groups = [*t.freqs, np.asarray(phat, dtype=np.int64), *flags]
    sizes = np.array([g.size for g in groups], dtype=np.int64)
    freq = np.concatenate(groups)
    cum = np.concatenate([np.concatenate([[0], np.cumsum(g)[:-1]]) for g in groups])
    pad = N_GROUPS - len(t.half)
    return DeviceTables(
        torch.from_numpy(freq.astype(np.int32)), torch.from_numpy(cum.astype(np.int32)),
        torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)),
        torch.from_numpy(sizes.astype(np.int32)),
        torch.from_numpy(np.concatenate([t.half, np.zeros(pad, np.int32)]).astype(np.int32)),
        torch.from_numpy(np.concatenate([t.radius, np.zeros(pad, np.int32)]).astype(np.int32)),
    )


@functools.lru_cache(maxsize=16)
def _on_device(fmt_code: int, marginal: Marginal, escape: tuple[int, int, int], device: str) -> DeviceTables:
    h = _host_tables(fmt_code, marginal, escape)
    return DeviceTables(*(getattr(h, f).to(device) for f in ("freq", "cum", "off", "size", "half", "radius")))


def device_tables(fmt: Format, marginal: Marginal | None = None, escape: tuple[int, int, int] = (256, 128, 64),
                  device: torch.device | str = "cpu") -> DeviceTables:
    """The tables for ``fmt`` with p_hat ``marginal`` (None: the default) and escape weights ``escape``
    (units of 2^-16, per window tier), on ``device`` (cached: ~20 MB)."""
    marginal = marginal if marginal is not None else Marginal.default()
    return _on_device(fmt.code, marginal, tuple(escape), str(torch.device(device)))


def tables_for(fmt: Format, device, marginal: Marginal | None = None,
               escape: tuple[int, int, int] = (256, 128, 64)) -> DeviceTables:
    return device_tables(fmt, marginal, escape, device)
