"""The codec's per-element model as device kernels: (x, mean, std) -> table id, symbol, and the integer
frequency / cumulative frequency of x's bin; decoded symbols -> bit patterns; the dtype symbol transforms.

Each function runs the Triton kernel (`codec_triton`) or the torch reference (`codec_ref`), chosen by
`dispatch.use_triton`; both are bit-exact with the numpy codec (tested). Tensors are flat and of equal
length; mean / std are float32 (``check_stat`` semantics: finite, std >= 0).
"""

from __future__ import annotations

import torch

from ..codec.marginal import Marginal
from ..codec.symbols import Format, format_of
from . import codec_ref
from .codec_tables import DeviceTables, device_tables
from .dispatch import use_triton


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a float tensor (int16 or int32), contiguous and flat."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _stat_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous().reshape(-1).view(torch.int32)


def _impl(*tensors: torch.Tensor):
    if use_triton(*tensors):
        from . import codec_triton

        return codec_triton
    return codec_ref


def tables_for(fmt: Format, device, marginal: Marginal | None = None,
               escape: tuple[int, int, int] = (256, 128, 64)) -> DeviceTables:
    return device_tables(fmt, marginal, escape, device)


def element_params(mean: torch.Tensor, std: torch.Tensor, fmt: Format, mean_steps: int = 8,
                   tables: DeviceTables | None = None) -> tuple[torch.Tensor, ...]:
    """(tid, cp, cn, s) per element (int32), as `hf_kvcompress.codec.params.element_params`."""
    mb, sb = _stat_bits(mean), _stat_bits(std)
    tables = tables or tables_for(fmt, mb.device)
    impl = _impl(mb, sb)
    if impl is codec_ref:
        return codec_ref.element_params(mb, sb, fmt, mean_steps, tables.radius)
    return impl.element_params(mb, sb, fmt, mean_steps, tables)


def encode_model(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, mean_steps: int = 8,
                 tables: DeviceTables | None = None) -> dict[str, torch.Tensor]:
    """Per element of ``x`` (bfloat16 / float16 / float32): ``tid``, ``cp``, ``cn``, ``s``, ``group`` (table
    id, or 968 = p_hat when escaped), ``sym``, its ``freq`` and ``cum`` out of 2^24, ``escaped``, ``raw`` low
    bits; all int32."""
    fmt = format_of(x.dtype)
    xb, mb, sb = _bits(x), _stat_bits(mean), _stat_bits(std)
    tables = tables or tables_for(fmt, xb.device)
    return _impl(xb, mb, sb).encode_model(xb, mb, sb, fmt, mean_steps, tables)


def decode_bits(sym: torch.Tensor, escaped: torch.Tensor, params: tuple[torch.Tensor, ...], raw: torch.Tensor,
                fmt: Format, tables: DeviceTables | None = None) -> torch.Tensor:
    """Decoded symbols (and raw low bits) -> bit patterns (int16 / int32): inverse of `encode_model`."""
    tables = tables or tables_for(fmt, sym.device)
    tid, cp, cn, s = params
    if use_triton(sym, escaped, tid):
        from . import codec_triton

        return codec_triton.decode_bits(sym, escaped, tid, cp, cn, s, raw, fmt, tables)
    return codec_ref.join_bits(codec_ref.decode_keys(sym, escaped, tid, cp, cn, s, fmt, tables), raw, fmt)


def split_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 / fp16 / fp32 symbol transform: values -> (order-preserving key, raw low bits), int32."""
    bits = _bits(x)
    return _impl(bits).split_bits(bits, format_of(x.dtype))


def join_bits(key: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `split_bits`, as a tensor of ``dtype``."""
    key, raw = key.contiguous().reshape(-1), raw.contiguous().reshape(-1)
    return _impl(key, raw).join_bits(key, raw, format_of(dtype)).view(dtype)
