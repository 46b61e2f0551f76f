"""The coder interface: what every coder of the codec implements (`Coder`), with what its calls share (the checks
of ``x``, ``mean``, ``std`` and ``config``, the result of `encode_with_stats`, a decode begun in the background, the
``out=`` tensor of a batch decode).

A coder turns a batch of tensors with their predicted mean and spread into one byte stream each and back, bit
for bit. The coders are registered by name in `coders` (`CodecConfig.coder` names one); the entry points in
`api` look the coder up (by config to encode, by a stream's magic bytes to decode) and call it.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..errors import CorruptStreamError
from ..kernels import dispatch
from ..validation import check_int
from .codec_config import CodecConfig
from .symbols import Format, format_of
from .tables import Marginal

# ---------------------------------------------------------------------------------------------------------
# The checks of what a caller hands the entry points (x, mean, std, config) and the device a call runs on.


def check_x(x: object) -> tuple[torch.Tensor, Format]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec: x must be a torch.Tensor, got {type(x).__name__}")
    check_has_data(x, "x")
    return x, format_of(x.dtype)


def check_has_data(t: torch.Tensor, name: str) -> None:
    """Meta tensors (and fake ones) have a shape but no values to code or to predict with."""
    if t.device.type == "meta":
        raise ValueError(f"codec: {name} is on the meta device: it has no values (load the weights first)")


def check_call_data(*values) -> None:
    """Every tensor among an entry point's x / mean / std / out holds values (not the meta device): checked once
    per call, for every coder (`api`)."""
    for name, value in zip(("x", "mean", "std", "out"), values):
        if isinstance(value, torch.Tensor):
            check_has_data(value, name)


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


def check_stats(mean: object, std: object, shape: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """`check_stat` of a call's mean and std: the checked float32 arrays (or None)."""
    return check_stat(mean, "mean", shape, False), check_stat(std, "std", shape, True)


def check_config(config: object) -> CodecConfig:
    if config is None:
        return CodecConfig()
    if not isinstance(config, CodecConfig):
        raise TypeError(f"codec: config must be a CodecConfig, got {type(config).__name__}")
    return config


def device_of(*tensors) -> torch.device:
    """The device of the first CUDA tensor among ``tensors`` (the arguments of a coder call), else the CPU."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return torch.device("cpu")


@dataclass
class CodecStats:
    """Sizes, ideal code lengths and window monitoring of one `encode` (`encode_with_stats`).

    ``model_bits``: -sum log2 q under the codec's own integer tables (what an ideal coder would emit);
    ``exact_bits``: the same under the exact, unquantised mixture 0.95 N(m, s^2) + 0.03 N(m, 9 s^2) +
    0.02 p_hat with each element's own (mean, std); ``exact_codec_bits``: that mixture with the codec's
    weights (escape probability by window tier), so ``model_bits - exact_codec_bits`` is what the table
    approximations (quantised std, t and offset, finite alphabets, ulp-uniform N bins) give up. A coder
    that does not measure ideal code lengths (``lanes``) leaves ``model_bits`` and ``escapes`` None. ``coder``:
    the `CodecConfig.coder` that coded the stream.
    """

    coder: str
    n_elements: int
    n_windows: int
    total_bytes: int
    header_bytes: int
    table_bytes: int
    payload_bytes: int
    encode_seconds: float
    model_bits: float | None
    escapes: int | None
    window_hist: dict[int, int]
    tier_hist: dict[int, int]
    window_bits_mean: float
    window_bits_var: float
    decode_seconds: float | None = None
    decode_seconds_by_window: dict[int, float] = field(default_factory=dict)
    exact_bits: float | None = None
    exact_codec_bits: float | None = None
    locality: dict | None = None

    @property
    def bits_per_scalar(self) -> float:
        return 8.0 * self.total_bytes / max(1, self.n_elements)

    @property
    def model_bits_per_scalar(self) -> float | None:
        return None if self.model_bits is None else self.model_bits / max(1, self.n_elements)

    @property
    def coding_overhead(self) -> float | None:
        """Payload bits over the ideal model bits, minus 1 (the coder's own loss, headers excluded)."""
        return None if self.model_bits is None else 8.0 * self.payload_bytes / max(self.model_bits, 1e-9) - 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bits_per_scalar=self.bits_per_scalar, model_bits_per_scalar=self.model_bits_per_scalar,
                 coding_overhead=self.coding_overhead)
        d["window_hist"] = {str(k): v for k, v in self.window_hist.items()}
        d["tier_hist"] = {str(k): v for k, v in self.tier_hist.items()}
        d["decode_seconds_by_window"] = {str(k): v for k, v in self.decode_seconds_by_window.items()}
        return d


class PendingDecode(Protocol):
    """A batch decode begun in the background (`Coder.start_decode_batch`)."""

    def finish(self) -> torch.Tensor:
        """Decode what is left on the calling thread, wait for the rest: what `decode_batch` returns."""

    def cancel(self) -> None:
        """Start nothing more, wait for what runs (its errors are dropped)."""

    def nbytes(self) -> int:
        """Bytes held beside ``out``."""


_pools: dict[str, tuple[ThreadPoolExecutor, int]] = {}
_pool_lock = threading.Lock()


def thread_pool(n: int, name: str) -> ThreadPoolExecutor:
    """The process's thread pool ``name`` with at least ``n`` threads (replaced by a larger one when needed)."""
    with _pool_lock:
        pool, size = _pools.get(name, (None, 0))
        if pool is None or size < n:
            pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=name)
            _pools[name] = (pool, n)
        return pool


class ChunkedJob:
    """A batch decode whose compiled kernel runs in chunks of streams that any thread may take (a `PendingDecode`):
    `start` hands chunks to background threads and returns at once; `finish` takes what is left on the calling
    thread, waits for the rest and returns `result`; `cancel` hands out nothing more and waits for the chunks
    already running. A coder's job parses and checks its streams, then hands this class what it runs (`_setup`):
    the kernel ``kernel(*args, lo, hi)`` (``args[0]`` the joined streams, the last one the per-stream error codes
    it writes), the chunk boundaries, the tensor written and the ``out`` asked for. The job calls nothing of the
    coder's module, so a coder and this interface never call each other both ways."""

    def _setup(self, kernel, args: tuple, cuts: list[int], host: torch.Tensor, out: torch.Tensor | None,
               corrupt: str, errors: dict[int, str]) -> None:
        self._kernel, self.args, self.err = kernel, args, args[-1]
        self.host, self.out = host, out
        self._corrupt, self._errors = corrupt, errors
        self._cuts = cuts
        self._next = 0
        self._lock = threading.Lock()
        self._running: list = []

    def result(self, mean=None, std=None) -> torch.Tensor:
        """After every chunk ran: `CorruptStreamError` for the first stream whose kernel failed, else the tensor
        (``out`` if given, else on the device of a CUDA ``mean`` / ``std``, else the CPU's)."""
        if self.err.any():
            i = int(np.flatnonzero(self.err)[0])
            raise CorruptStreamError(f"{self._corrupt}: stream {i}: {self._errors.get(int(self.err[i]), 'decode failed')}")
        if self.out is not None:
            return self.out if self.out is self.host else copy_into(self.out, self.host)
        return self.host.to(device_of(mean, std))

    def nbytes(self) -> int:
        """Bytes held beside ``out``: the joined streams and a temporary output."""
        extra = 0 if self.host is self.out else self.host.numel() * self.host.element_size()
        return self.args[0].nbytes + extra

    def _take(self) -> tuple[int, int] | None:
        with self._lock:
            k = self._next
            if k >= len(self._cuts) - 1:
                return None
            self._next = k + 1
        return self._cuts[k], self._cuts[k + 1]

    def _work(self) -> None:
        while (chunk := self._take()) is not None:
            self._kernel(*self.args, *chunk)

    def start(self, threads: int = 1) -> ChunkedJob:
        """Let ``threads`` background threads take chunks (a pool of their own, not the one `decode_batch` and
        `encode_batch` split their work on, so those never queue behind a job)."""
        self._running = [thread_pool(threads, "kvc-ahead").submit(self._work) for _ in range(threads)]
        return self

    def finish(self) -> torch.Tensor:
        """Decode the chunks nobody took yet here, wait for the others; the decoded tensor (``out`` if given)."""
        try:
            self._work()
        finally:
            for f in self._running:
                f.result()
        return self.result(None, None)

    def cancel(self) -> None:
        """Hand out no more chunks and wait for the running ones (their errors are dropped with the job)."""
        with self._lock:
            self._next = len(self._cuts)
        for f in self._running:
            f.result()


class Coder(ABC):
    """One coder: a stream format with its encoder and decoder. Subclass, set the class attributes, implement
    the abstract methods, and add one line to the registry (`coders.CODERS`).

    Attributes:
        name: its `CodecConfig.coder` value.
        magic: the first bytes of each of its streams (how `decode` and `stream_info` tell coders apart).
        windows: the `CodecConfig.window` modes it codes (`check_config`).
        batched: whether a batch is one call with compact (broadcast) statistics, fingerprinted per stream as
            the batch gives them. False: each stream is coded on its own and fingerprints mean / std in the
            shapes it was handed, so callers that must keep such streams' bytes (saved files) code them one
            by one with those shapes (`encode` / `decode`).
        reads_marginal: whether its streams depend on `CodecConfig.marginal` (the p_hat of escaped values). False:
            a marginal changes none of its bytes, so callers need not hold one for it (`blockcodec.BlockCodec`).
    """

    name: str
    magic: tuple[bytes, ...]
    windows: tuple[str, ...] = ("fixed",)
    batched: bool = False
    reads_marginal: bool = True

    def check_config(self, cfg: CodecConfig) -> None:
        """Raise ValueError if this coder cannot code with ``cfg`` (called by `CodecConfig` when constructed)."""
        if cfg.window not in self.windows:
            raise ValueError(f"CodecConfig(coder={self.name!r}) codes windows {list(self.windows)}: window must be one "
                             f"of them, got {cfg.window!r}")

    # -- batches: the calls every coder implements

    @abstractmethod
    def encode_batch(self, x: torch.Tensor, mean, std, cfg: CodecConfig, threads: int | None = None) -> list[bytes]:
        """``x`` of shape ``[N, ...]`` as N streams; ``mean`` / ``std`` broadcast to ``x`` (a leading dim of 1 is
        shared); stream ``i`` is ``encode(x[i], mean[i], std[i])``."""

    @abstractmethod
    def decode_batch(self, blobs: Sequence[bytes], mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                     threads: int | None = None, verify: bool | Sequence[bool] = True) -> torch.Tensor:
        """Inverse of `encode_batch`: ``[N, ...]`` (into ``out`` when given, `check_out`)."""

    def start_decode_batch(self, blobs: Sequence[bytes], mean, std, cfg: CodecConfig, out: torch.Tensor | None = None,
                           threads: int = 1, verify: bool | Sequence[bool] = True,
                           chunks: int = 8) -> PendingDecode | None:
        """`decode_batch` begun in the background, or None where this coder has no such form (or would decode
        on a device): the caller then calls `decode_batch`. Errors in the arguments or headers raise here."""
        return None

    # -- single streams

    def encode(self, x: torch.Tensor, mean, std, cfg: CodecConfig) -> bytes:
        """One stream of ``x`` (any shape)."""
        check_tensor(x)
        return self.encode_batch(x[None], _one(mean), _one(std), cfg)[0]

    @abstractmethod
    def decode(self, blob, mean, std, config: CodecConfig | None, marginal: Marginal | None = None,
               threads: int = 1, workers: int = 1) -> torch.Tensor:
        """Inverse of `encode`; ``config`` None: the stream's own (if it carries one) or `CodecConfig()`;
        ``marginal``: the p_hat if not the config's."""

    def decode_range(self, blob, start: int, stop: int, mean, std, config: CodecConfig | None,
                     marginal: Marginal | None = None) -> torch.Tensor:
        """Flat elements ``start:stop``; by default the whole stream is decoded and cut."""
        n = math.prod(self.stream_infos([blob], config, marginal)[0][1])
        check_range(start, stop, n)
        return self.decode(blob, mean, std, config, marginal).reshape(-1)[start:stop].clone()

    @abstractmethod
    def stream_infos(self, blobs: Sequence, config: CodecConfig | None,
                     marginal: Marginal | None = None) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each stream's (dtype, shape) from its checked header (the payloads are not decoded); a batch, so a
        container checks a block's streams in one call."""

    def encode_with_stats(self, x: torch.Tensor, mean, std, cfg: CodecConfig, *, decode: bool = True,
                          exact: bool = True) -> tuple[bytes, CodecStats]:
        """`encode` plus sizes and timings, the stream as one window (``exact`` is for coders that compute
        ideal code lengths)."""
        t0 = time.perf_counter()
        blob = self.encode(x, mean, std, cfg)
        seconds = time.perf_counter() - t0
        n = x.numel()
        payload = self.payload_bytes(blob, n, format_of(x.dtype))
        windows = 1 if n else 0
        st = CodecStats(
            n_elements=n, n_windows=windows, total_bytes=len(blob), header_bytes=len(blob) - payload, table_bytes=0,
            payload_bytes=payload, encode_seconds=seconds, model_bits=None, escapes=None,
            window_hist={n: 1} if n else {}, tier_hist={cfg.tier_of_length(n): 1} if n else {},
            window_bits_mean=8.0 * payload / n if n else 0.0, window_bits_var=0.0, coder=self.name,
        )
        if decode:
            t0 = time.perf_counter()
            y = self.decode(blob, mean, std, cfg)
            st.decode_seconds = time.perf_counter() - t0
            if not torch.equal(bits_of(y), bits_of(x.reshape(y.shape))):
                raise AssertionError("codec round trip failed")
            st.decode_seconds_by_window = {n: st.decode_seconds} if n else {}
        return blob, st

    def payload_bytes(self, blob: bytes, n: int, fmt: Format) -> int:
        """Bytes of ``blob`` after its header (`encode_with_stats`); by default all of it."""
        return len(blob)


# ---------------------------------------------------------------------------------------------------------
# What the coders' calls share


def check_tensor(x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec: x must be a torch.Tensor, got {type(x).__name__}")


def _one(stat):
    """A stream's mean / std as a batch of one (numbers and None as they are)."""
    return stat[None] if isinstance(stat, torch.Tensor) else stat


def check_parallel(threads: int, workers: int) -> None:
    """`decode`'s ``threads`` and ``workers``: ints >= 1."""
    for name, v in (("threads", threads), ("workers", workers)):
        check_int(f"codec: {name}", v, minimum=1)


def check_range(start: int, stop: int, n: int) -> None:
    """`decode_range`'s ``start`` / ``stop``: ints with ``0 <= start <= stop <= n``."""
    for name, v in (("start", start), ("stop", stop)):
        check_int(f"codec: {name}", v)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"codec: need 0 <= start <= stop <= {n}, got start={start}, stop={stop}")


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def unknown_stream(blob) -> CorruptStreamError:
    head = bytes(blob[:8])
    return CorruptStreamError(f"not a codec stream: unknown magic bytes {head!r} (or a stream cut short)")


def check_out(out: torch.Tensor | None, fmt: Format, xshape: tuple[int, ...]) -> None:
    """``decode_batch``'s ``out``: None, or a tensor of the streams' dtype, of shape ``xshape`` (``[N, *shape]``)
    or ``[*lead, *shape]`` with the ``lead`` dims holding the N streams in row-major order; any device, any
    strides whose elements do not overlap."""
    if out is None:
        return
    n_streams, shape = xshape[0], xshape[1:]
    lead = out.dim() - len(shape) if isinstance(out, torch.Tensor) else 0
    if (not isinstance(out, torch.Tensor) or out.dtype != fmt.dtype or lead < 1
            or tuple(out.shape[lead:]) != shape or math.prod(out.shape[:lead]) != n_streams):
        raise ValueError(f"codec.decode_batch: out must be a {fmt.dtype} tensor of shape {xshape} (or [*lead, "
                         f"*{shape}] with {n_streams} streams in lead), got {describe(out)}")
    if _overlaps(out):
        raise ValueError("codec.decode_batch: out's elements overlap (a broadcast or expanded view); pass a tensor "
                         "that gives every element its own memory")


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` might share memory: its dims of size > 1, by stride, must each step over
    everything the smaller ones span (a sufficient test; views cut from one tensor pass it)."""
    span = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def copy_into(out: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``out`` (shape as `check_out` allows) filled with the ``[N, *shape]`` ``decoded``."""
    return out.copy_(decoded.view(out.shape))


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def triton_device(*values) -> torch.device | None:
    """The device an entropy decode runs on as Triton kernels: the CUDA device of any tensor among
    ``values`` (mean, std, out) when `dispatch` says Triton for it, the CPU when the kernels are forced to
    Triton (the interpreter tests); None for the host decoders. Without Triton a CUDA caller is decoded on
    the host and gets its result on its device: the device's torch reference would step every symbol from
    Python."""
    tensors = [t for t in values if isinstance(t, torch.Tensor)]
    if not dispatch.device_path(*tensors):
        return None
    cuda = [t for t in tensors if t.is_cuda]
    if not dispatch.use_triton(*(cuda or tensors)):
        return None
    return device_of(*tensors)


# ---------------------------------------------------------------------- helpers every CPU decoder shares


def check_threads(threads: int | None) -> int:
    if threads is None:
        return 1
    check_int("codec: threads", threads, minimum=1)
    return threads


def verify_mask(verify, n_streams: int) -> np.ndarray:
    """``decode_batch``'s ``verify`` (True, False or one bool per stream) as a uint8 mask for the kernels."""
    if isinstance(verify, (bool, np.bool_)):
        return np.full(n_streams, 1 if verify else 0, dtype=np.uint8)
    mask = np.asarray(verify)
    if mask.dtype != np.bool_ or mask.shape != (n_streams,):
        raise ValueError(f"codec.decode_batch: verify must be a bool or {n_streams} bools (one per stream), got "
                         f"{describe(verify)}")
    return mask.astype(np.uint8)


def out_layout(out: torch.Tensor, shape: tuple[int, ...]):
    """Where the decode kernel writes a CPU ``out`` checked by `check_out`: (a flat writable bit view of the memory
    it spans, each stream's first element in it, run, stride between runs, stride in a run), element ``i`` of a
    stream at ``base + (i // run) * between + (i % run) * within``; None when a stream's dims do not fold into
    two strides (the caller decodes into a contiguous tensor and copies)."""
    lead = out.dim() - len(shape)
    if out.numel() == 0:  # streams without elements: nothing to write
        return bits_view(out.new_empty(0), 0, 0).reshape(0), np.zeros(math.prod(out.shape[:lead]), np.int64), 1, 0, 0
    dims = [(size, stride) for size, stride in zip(out.shape[lead:], out.stride()[lead:]) if size != 1]
    folded: list[tuple[int, int]] = []
    for size, stride in dims:  # merge a dim into the one before when they step like one dim
        if folded and folded[-1][1] == size * stride:
            folded[-1] = (folded[-1][0] * size, stride)
        else:
            folded.append((size, stride))
    if len(folded) > 2:
        return None
    folded = [(1, 0)] * (2 - len(folded)) + folded
    (_, between), (run, within) = folded
    base = np.zeros((), dtype=np.int64)
    for size, stride in zip(out.shape[:lead], out.stride()[:lead]):
        base = (base[..., None] + np.arange(size, dtype=np.int64) * stride)
    span = 1 + sum((size - 1) * stride for size, stride in zip(out.shape, out.stride()))
    flat = torch.as_strided(out, (span,), (1,))
    wide = out.dtype == torch.float32
    bits = flat.view(torch.int32 if wide else torch.int16).numpy().view(np.uint32 if wide else np.uint16)
    return bits, base.reshape(-1), max(1, run), between, within


def bits_view(t: torch.Tensor, n_streams: int, m: int) -> np.ndarray:
    """A CPU tensor's bit patterns as a writable ``[n_streams, m]`` uint16 / uint32 numpy view."""
    wide = t.dtype == torch.float32
    return t.view(torch.int32 if wide else torch.int16).numpy().view(np.uint32 if wide else np.uint16).reshape(
        n_streams, m)
