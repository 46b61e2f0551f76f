"""The ``ans`` coder's two flows: encode, tensor -> symbols per window (`windows`, `entropy`) -> stream
(`layout`); decode, stream -> verified header -> windows (serial, threads, processes, or the device: `device`)
-> tensor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...errors import CorruptStreamError, ParameterMismatchError
from ...kernels import dispatch
from ..codec_config import CodecConfig, fingerprint, fingerprint8
from ..interface import (
    check_config,
    check_has_data,
    check_parallel,
    check_range,
    check_stat,
    check_stats,
    check_x,
    triton_device,
)
from ..params import ParamSource
from ..symbols import bits_to_tensor, join_bits, split_bits, tensor_bits
from ..tables import Marginal, get_tables
from .device import DeviceSource, decode_on_device, device_of
from .entropy import decode_chunk, encode_chunk, fork_available, models_for, run_jobs, run_jobs_forked
from .layout import (
    MAX_NDIM,
    VERSION,
    Header,
    entry_dtype,
    is_compact,
    read_compact,
    read_stream,
    write_compact,
    write_stream,
)
from .windows import (
    CHUNK,
    CausalScheduler,
    chunks_of,
    data_crc,
    global_spread,
    planned_lengths,
    source_residual_codes,
    window_crc,
    window_crcs_of,
    window_seed,
    window_sigma_bits,
    window_sigma_codes,
)


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
    return dispatch.device_path(*(t for t in tensors if isinstance(t, torch.Tensor)))


def encode_impl(x, mean, std, config, want_costs: bool = False) -> tuple[bytes, EncodeTrace]:
    """Check the arguments, plan windows, code chunk by chunk, assemble the stream."""
    cfg = check_config(config)
    x, fmt = check_x(x)
    shape = tuple(int(d) for d in x.shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"codec: x has {len(shape)} dims; streams hold at most {MAX_NDIM}")
    mean32, std32 = check_stats(mean, std, shape)
    bits = tensor_bits(x)
    n = bits.size
    keys, raw = split_bits(bits, fmt)
    src = ParamSource(shape, mean32, std32, fmt, cfg.mean_steps)
    on_device = _wants_device(x, mean, std)
    if on_device:  # the per-element model through the kernels, on the inputs' device (same bytes)
        src = DeviceSource(src, shape, x, mean, std, mean32, std32, cfg, device_of(x, mean, std))
    models = models_for(fmt, cfg)
    need_res = cfg.window in ("metadata", "causal") or std32 is None or want_costs
    res = None
    if need_res:
        res = np.empty(n, dtype=np.int32)
        for a in range(0, n, 1 << 20):
            b = min(n, a + (1 << 20))
            res[a:b] = source_residual_codes(bits[a:b], src, a, b)
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


class Decoder:
    """A parsed, verified stream plus the inputs needed to decode any of its windows."""

    def __init__(self, blob, mean, std, marginal: Marginal | None, config: CodecConfig | None = None) -> None:
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"codec: blob must be bytes, got {type(blob).__name__}")
        marginal = _check_marginal_config(marginal, config)
        if is_compact(blob):
            h, entries, offsets, buf = read_compact(blob, config)
        else:
            # self-describing: its own config governs; a given config only supplies the marginal, so full
            # streams written before a caller switched settings still decode
            h, entries, offsets, buf = read_stream(blob, marginal)
        self.h, self.entries, self.offsets, self.buf = h, entries, offsets, buf
        self.fmt = h.fmt
        mean32 = self._stat(mean, "mean", h.has_mean, h.mean_fp)
        std32 = self._stat(std, "std", h.has_std, h.std_fp)
        tables = get_tables()
        if h.tables_sha256 != bytes.fromhex(tables.sha256):
            raise CorruptStreamError(
                f"stream was written with codec tables {h.tables_sha256.hex()[:16]}..., this build has "
                f"{tables.sha256[:16]}... (incompatible codec version or platform)"
            )
        if h.marginal_sha256 != bytes.fromhex(h.config.marginal_or_default.sha256):
            raise CorruptStreamError("stream was written with a different default marginal p_hat")
        self.src = ParamSource(h.shape, mean32, std32, h.fmt, h.config.mean_steps)
        self.src_mean32, self.src_std32 = mean32, std32  # validated float32 copies (the device path's inputs)
        self.models = models_for(h.fmt, h.config)
        self.cfg = h.config
        self.lengths: np.ndarray | None = None if self.cfg.window == "causal" else self._lengths()
        if self.lengths is not None and (int(self.lengths.sum()) != h.numel or self.lengths.size != h.n_windows):
            raise CorruptStreamError("corrupt codec stream: window table does not match the window plan")
        self.timings: list | None = None

    def _stat(self, value, name, present: bool, fp: bytes):
        if value is None and present:
            raise CorruptStreamError(f"stream was encoded with a {name}; pass the same {name} to decode")
        if value is not None and not present:
            raise CorruptStreamError(f"stream was encoded without a {name}; pass {name}=None to decode")
        if value is None:
            return None
        if not isinstance(value, (torch.Tensor, np.ndarray, int, float)) or isinstance(value, bool):
            raise TypeError(f"codec: {name} must be a torch.Tensor or a number, got {type(value).__name__}")
        if isinstance(value, torch.Tensor):
            check_has_data(value, name)  # a clear error, not a fingerprint mismatch
        try:
            arr = check_stat(value, name, self.h.shape, name == "std")
        except ValueError:
            arr = None
        fingerprint_of = fingerprint8 if self.h.compact else fingerprint
        if arr is None or fingerprint_of(arr, name.encode()) != fp:
            raise ParameterMismatchError(
                f"the {name} passed to decode differs from the one used to encode (fingerprint mismatch); "
                f"decoding would produce garbage"
            )
        return arr

    def _lengths(self) -> np.ndarray:
        cfg, h = self.cfg, self.h
        if cfg.window == "metadata":
            return self.entries["len1"].astype(np.int64) + 1
        return planned_lengths(cfg, h.numel, self.src, h.g_spread, None)

    def _sigma_bits(self, w0: int, w1: int, lengths: np.ndarray) -> np.ndarray | None:
        if self.h.has_std:
            return None
        return window_sigma_bits(self.entries["sigma"][w0:w1].astype(np.int64), lengths)

    def decode_windows(self, w0: int, w1: int, a: int, lengths: np.ndarray) -> np.ndarray:
        """Bits (int64) of windows w0..w1-1, which start at element a, each checked against its CRC."""
        buf, offsets = self.buf, self.offsets
        b = a + int(lengths.sum())
        p = self.src.params(a, b, self._sigma_bits(w0, w1, lengths))
        tiers = [self.cfg.tier_of_length(int(x)) for x in lengths]
        keys, raw = decode_chunk(buf, offsets[w0 : w1 + 1], p, lengths, self.models, tiers, self.timings)
        bits = join_bits(keys, raw, self.fmt)
        crcs = window_crcs_of(buf, offsets[w0 : w1 + 1], bits, lengths, self.fmt, self.h.version, self.h.data_crc, w0)
        bad = np.flatnonzero(crcs != self.entries["crc"][w0:w1])
        if bad.size:
            raise CorruptStreamError(f"corrupt codec stream: checksum mismatch in window {w0 + int(bad[0])}")
        return bits

    def out_dtype(self):
        return np.uint32 if self.fmt.dtype == torch.float32 else np.uint16

    def decode_all(self, threads: int = 1, workers: int = 1) -> np.ndarray:
        n = self.h.numel
        if self.lengths is None:
            return self.decode_causal(n)
        lengths = self.lengths
        jobs = chunks_of(lengths)

        def run(out: np.ndarray, i: int) -> None:
            w0, w1, a, b = jobs[i]
            out[a:b] = self.decode_windows(w0, w1, a, lengths[w0:w1])

        sizes = [b - a for _, _, a, b in jobs]
        if workers > 1 and fork_available() and len(jobs) > 1:
            return run_jobs_forked(run, sizes, workers, n, self.out_dtype())
        out = np.empty(n, dtype=self.out_dtype())
        run_jobs(lambda i: run(out, i), sizes, max(threads, workers))  # no fork here: threads instead
        return out

    def decode_causal(self, stop: int) -> np.ndarray:
        """Causal mode: each boundary needs the values before it. Decode a batch of windows whose lengths
        assume the scheduler state stays put, keep the prefix that replaying the scheduler confirms, and
        fall back to one window when a guess was wrong. The batch doubles after a fully confirmed batch
        and drops to one window after a miss, so unstable regions cost about one extra window each."""
        h = self.h
        out = np.empty(h.numel, dtype=self.out_dtype())
        sched = CausalScheduler(h.numel, self.cfg, h.g_spread)
        w = 0
        batch = 8
        while sched.pos < stop:
            spec = sched.speculate(batch, CHUNK)[: h.n_windows - w]
            if not spec:
                raise CorruptStreamError("corrupt codec stream: causal window plan does not match the table")
            a = sched.pos
            try:
                bits = self.decode_windows(w, w + len(spec), a, np.array(spec, dtype=np.int64))
            except CorruptStreamError:
                if len(spec) == 1:
                    raise
                spec = spec[:1]  # a wrong guess for a later window, or real corruption: go one by one
                bits = self.decode_windows(w, w + 1, a, np.array(spec, dtype=np.int64))
                batch = 1
            codes = source_residual_codes(bits, self.src, a, a + len(bits))
            off = 0
            for length in spec:
                if sched.next_length() != length:
                    batch = 1
                    break
                out[a + off : a + off + length] = bits[off : off + length]
                sched.observe(codes[off : off + length])
                off += length
                w += 1
            else:
                batch = min(64, 2 * batch)
        if stop == h.numel and w != h.n_windows:
            raise CorruptStreamError("corrupt codec stream: more windows in the table than in the plan")
        return out[:stop]

    def decode_range(self, start: int, stop: int) -> np.ndarray:
        if self.h.version < 2:
            # version-1 window CRCs are not bound to their stream: only the data CRC over everything catches
            # a window spliced in from another stream, so check it (decoding every window)
            bits = self.decode_all()
            if data_crc(bits, self.fmt) != self.h.data_crc:
                raise CorruptStreamError("corrupt codec stream: checksum of the decoded data does not match")
            return bits[start:stop]
        if self.lengths is None:
            return self.decode_causal(stop)[start:stop]
        cum = np.concatenate([[0], np.cumsum(self.lengths)])
        w0 = int(np.searchsorted(cum, start, side="right")) - 1
        w1 = int(np.searchsorted(cum, stop, side="left"))
        if stop == start:
            return np.zeros(0, dtype=self.out_dtype())
        a = int(cum[w0])
        bits = self.decode_windows(w0, w1, a, self.lengths[w0:w1])
        return bits[start - a : stop - a].astype(self.out_dtype())

    def tensor(self, bits: np.ndarray, shape) -> torch.Tensor:
        return bits_to_tensor(bits, self.fmt, shape)


def stream_info_impl(blob, marginal, config: CodecConfig | None = None) -> tuple[torch.dtype, tuple[int, ...]]:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"codec: blob must be bytes, got {type(blob).__name__}")
    marginal = _check_marginal_config(marginal, config)
    h = read_compact(blob, config)[0] if is_compact(blob) else read_stream(blob, marginal)[0]
    return h.fmt.dtype, h.shape


def _check_marginal_config(marginal, config) -> Marginal | None:
    """The marginal to parse a full stream with: ``marginal=`` or the one in ``config=`` (not two)."""
    if marginal is not None and not isinstance(marginal, Marginal):
        raise TypeError(f"codec: marginal must be a Marginal or None, got {type(marginal).__name__}")
    if config is None:
        return marginal
    if not isinstance(config, CodecConfig):
        raise TypeError(f"codec: config must be a CodecConfig or None, got {type(config).__name__}")
    if marginal is not None and marginal != config.marginal:
        raise ValueError("codec: marginal= differs from config.marginal; pass the marginal in one place")
    return config.marginal


def decode_impl(blob, mean, std, marginal, threads: int, workers: int, timings: list | None = None,
                config: CodecConfig | None = None):
    check_parallel(threads, workers)
    d = Decoder(blob, mean, std, marginal, config)
    d.timings = timings
    device = _device_for(d, mean, std)
    if device is not None:
        return _decode_on_device(d, mean, std, device)
    bits = d.decode_all(threads, workers)
    if data_crc(bits, d.fmt) != d.h.data_crc:
        raise CorruptStreamError("corrupt codec stream: checksum of the decoded data does not match")
    out = d.tensor(bits, d.h.shape)
    cuda = [t for t in (mean, std) if isinstance(t, torch.Tensor) and t.is_cuda]
    return out.to(cuda[0].device) if cuda else out


def _device_for(d: Decoder, mean, std):
    """The device to decode on (CUDA inputs with Triton, or forced kernels), else None: the host path."""
    if d.lengths is None or d.timings is not None:  # causal boundaries are serial; monitoring times the CPU
        return None
    return triton_device(mean, std)


def _decode_on_device(d: Decoder, mean, std, device) -> torch.Tensor:
    bits_t = decode_on_device(d, mean, std, device)
    mask = 0xFFFFFFFF if d.fmt.dtype == torch.float32 else 0xFFFF
    bits = bits_t.cpu().numpy().astype(np.int64) & mask  # checksums on the host (see device.py)
    crcs = window_crcs_of(d.buf, d.offsets, bits, d.lengths, d.fmt, d.h.version, d.h.data_crc)
    bad = np.flatnonzero(crcs != d.entries["crc"])
    if bad.size:
        raise CorruptStreamError(f"corrupt codec stream: checksum mismatch in window {int(bad[0])}")
    if data_crc(bits, d.fmt) != d.h.data_crc:
        raise CorruptStreamError("corrupt codec stream: checksum of the decoded data does not match")
    return bits_t.view(d.fmt.dtype).reshape(d.h.shape)


def decode_range_impl(blob, start: int, stop: int, mean, std, marginal,
                      config: CodecConfig | None = None) -> torch.Tensor:
    d = Decoder(blob, mean, std, marginal, config)
    n = d.h.numel
    check_range(start, stop, n)
    bits = d.decode_range(start, stop)
    if start == 0 and stop == n and data_crc(bits, d.fmt) != d.h.data_crc:
        raise CorruptStreamError("corrupt codec stream: checksum of the decoded data does not match")
    return d.tensor(bits, (stop - start,))
