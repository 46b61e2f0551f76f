"""The encode flow: tensor -> symbols per window -> stream."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .broadcast import ParamSource
from .coder import encode_chunk
from .compact import write_compact
from .inputs import check_config, check_stat, check_x, fingerprint, fingerprint8
from .model import get_tables
from .plan import (
    chunks_of,
    data_crc,
    global_spread,
    models_for,
    planned_lengths,
    residual_codes,
    window_crc,
    window_seed,
    window_sigma_bits,
    window_sigma_codes,
)
from .stream import MAX_NDIM, VERSION, Header, entry_dtype, write_stream
from .symbols import split_bits, tensor_bits


@dataclass
class EncodeTrace:
    """What `encode_with_stats` needs from an encode."""

    lengths: np.ndarray
    model_bits: np.ndarray | None
    sigma_codes: np.ndarray | None
    res_codes: np.ndarray | None
    g: int
    header_bytes: int
    table_bytes: int
    payload_sizes: np.ndarray


def _wants_device(*tensors) -> bool:
    from ..kernels.dispatch import device_path

    return device_path(*(t for t in tensors if isinstance(t, torch.Tensor)))


def encode_impl(x, mean, std, config, want_costs: bool = False) -> tuple[bytes, EncodeTrace]:
    """Check the arguments, plan windows, code chunk by chunk, assemble the stream."""
    cfg = check_config(config)
    x, fmt = check_x(x)
    shape = tuple(int(d) for d in x.shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"codec: x has {len(shape)} dims; streams hold at most {MAX_NDIM}")
    mean32 = check_stat(mean, "mean", shape, False)
    std32 = check_stat(std, "std", shape, True)
    bits = tensor_bits(x)
    n = bits.size
    keys, raw = split_bits(bits, fmt)
    src = ParamSource(shape, mean32, std32, fmt, cfg.mean_steps)
    on_device = _wants_device(x, mean, std)
    if on_device:  # the per-element model through the kernels, on the inputs' device (same bytes)
        from .device import DeviceSource, device_of

        src = DeviceSource(src, shape, x, mean, std, mean32, std32, cfg, device_of(x, mean, std))
    models = models_for(fmt, cfg)
    need_res = cfg.window in ("metadata", "causal") or std32 is None or want_costs
    res = None
    if need_res:
        res = np.empty(n, dtype=np.int32)
        for a in range(0, n, 1 << 20):
            b = min(n, a + (1 << 20))
            res[a:b] = residual_codes(bits[a:b], src, a, b)
    g = global_spread(cfg, src, res)
    lengths = planned_lengths(cfg, n, src, g, res)
    sigma = window_sigma_codes(res, lengths) if std32 is None else None
    tiers = [cfg.tier_of_length(int(w)) for w in lengths]
    payloads: list[bytes] = []
    costs = []
    for w0, w1, a, b in chunks_of(lengths):
        sig = None if sigma is None else window_sigma_bits(sigma[w0:w1], lengths[w0:w1])
        pre = None
        if on_device:
            p, valid, sym = src.symbols(a, b, sig)
            pre = (valid, sym)
        else:
            p = src.params(a, b, sig)
        pl, c = encode_chunk(keys[a:b], None if raw is None else raw[a:b], p, lengths[w0:w1], models,
                             tiers[w0:w1], want_costs, pre)
        payloads.extend(pl)
        if c is not None:
            costs.append(c)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    entries = np.zeros(lengths.size, dtype=entry_dtype(cfg.window, std32 is not None))
    entries["nbytes"] = [len(p) for p in payloads]
    stream_crc = data_crc(bits, fmt)
    entries["crc"] = [window_crc(p, bits[a:b], fmt, window_seed(VERSION, stream_crc, w))
                      for w, (p, a, b) in enumerate(zip(payloads, starts.tolist(), (starts + lengths).tolist()))]
    if cfg.window == "metadata":
        entries["len1"] = lengths - 1
    if sigma is not None:
        entries["sigma"] = sigma
    compact = cfg.header == "compact"
    fp = fingerprint8 if compact else fingerprint
    header = Header(
        fmt, shape, n, mean32 is not None, std32 is not None, cfg, int(lengths.size), g, stream_crc,
        bytes.fromhex(get_tables().sha256), bytes.fromhex(cfg.marginal_or_default.sha256),
        fp(mean32, b"mean"), fp(std32, b"std"), compact,
    )
    blob = (write_compact if compact else write_stream)(header, entries, payloads)
    payload_sizes = entries["nbytes"].astype(np.int64)
    table_bytes = entries.nbytes + 4
    trace = EncodeTrace(lengths, np.concatenate(costs) if costs else None, sigma, res, g,
                        len(blob) - int(payload_sizes.sum()) - table_bytes, table_bytes, payload_sizes)
    return blob, trace
