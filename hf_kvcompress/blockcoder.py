"""One block coder for every writer and reader of lossless bytes: the cache's blocks (`cache.coded`, and through
it saved files and the prefix store) and LMCache chunks (`integrations.kv_chunk`).

A block is ``rows * 2 * heads`` streams (one per batch row, kind and head, in `stream_order`). Each stream is

- predicted: mean and std ``[rows, tokens, width]`` from the block's `PredictorSession`;
- scaled: one byte per stream and row (`choose_scale`) scales the std by ``2^(s/4)`` to fit the block's actual
  spread (cheap protection against text unlike the calibration text);
- settled: a `portable` session's float64 statistics are coded as canonical float32 values that every CPU
  computes alike, the elements near a class boundary listed with the stream (`settle_stream`);
- coded channel-major (``[width, tokens]``: a channel's elements share a spread, so the coder switches tables
  less), many streams per codec call: one call per codec setting and shape of stream and statistics (the
  ``lanes`` coder; ``ans`` codes stream by stream).

`encode_blocks` and `decode_blocks` take many blocks at once (a cache block, or every layer of a chunk): the
streams of `independent` sessions are predicted up front and coded in grouped calls across all the blocks; a
dependent session goes stream by stream, shown each stream's values (`PredictorSession.observe`) before it
predicts the next. Keys and values may differ in width (an MLA latent and its rotary part): they then land in
separate calls. `decode_stacked` is the grouped decode of blocks whose statistics were predicted together (a
cache's read of a layer).
"""

from __future__ import annotations

import contextlib
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .codec import (
    CodecConfig,
    CorruptStreamError,
    decode_streams,
    encode_streams,
    set_table_cache,
)
from .codec.params import settle
from .codec.symbols import format_of
from .downloads import cache_dir
from .predictors.base import KINDS, Predictor, PredictorSession, stream_order

# The codec knows no application folders; the library keeps its built tables with its other files (a path read
# when the tables are first built, so importing creates nothing). Set here, where every library path that codes
# a block passes (the cache, save / load, the chunk coder, the prefix store), so that `import hf_kvcompress`
# itself stays light (its names load on first use).
set_table_cache(lambda: cache_dir() / "codec")

# The per-stream std scale, in quarter octaves (std * 2^(s/4)), one byte per stream: a format constant (saved files
# hold it and persist.py refuses codes outside it). The range, std x 2^-8 .. 2^15.75, is a choice, not a tuned value:
# `choose_scale` clips to it, and a clipped scale only costs rate, never exactness (docs/lossless.md, "Data flow").
SCALE_MIN, SCALE_MAX = -32, 63

#: 2 ** (q / 4) for q = 0..3, correctly rounded, written out: `scale_factor` needs no libm ``pow``, whose last bit
#: may differ between C libraries (these are the values glibc's ``pow`` gives, so the factors did not change)
_QUARTER_OCTAVES = (1.0, float.fromhex("0x1.306fe0a31b715p+0"), float.fromhex("0x1.6a09e667f3bcdp+0"),
                    float.fromhex("0x1.ae89f995ad3adp+0"))


def scale_factor(code: int) -> float:
    """The std multiplier ``2 ** (code / 4)`` of a stream's scale code (exact scaling of a written-out constant)."""
    return math.ldexp(_QUARTER_OCTAVES[code % 4], code // 4)


# every code's factor as the float32 the encoder multiplies by (`scale_factor` rounded to float32)
_SCALE_FACTORS = np.array([scale_factor(code) for code in range(SCALE_MIN, SCALE_MAX + 1)], dtype=np.float32)


def scale_factors(codes: np.ndarray) -> torch.Tensor:
    """The float32 factors of scale codes in ``[SCALE_MIN, SCALE_MAX]`` (any shape): what a float32 std times
    `scale_factor` gives, for many streams at once."""
    return torch.from_numpy(_SCALE_FACTORS[np.asarray(codes, dtype=np.int64) - SCALE_MIN])


def choose_scale(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> int:
    """The quarter-octave std scale that fits this stream's residuals (outliers clipped at 5 sigma, which
    the mixture's wide component and escape pay for anyway)."""
    z2 = _clipped_square(x, mean, std)
    return scale_code(float(z2.mean()) if z2.numel() else 1.0)


def choose_scales(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> np.ndarray:
    """`choose_scale` of many streams at once: ``x`` ``[..., tokens, width]`` (each stream's elements contiguous,
    as `choose_scale` reads one), ``mean`` / ``std`` broadcastable to it; int64 codes ``[...]``. The same codes: the
    elementwise maths is IEEE, each stream's mean one contiguous row reduced as a stream alone is, and the log
    the same Python ``math.log2`` (`scale_code`)."""
    z2 = _clipped_square(x, mean, std)
    lead = z2.shape[:-2]
    if not z2.shape[-1] * z2.shape[-2]:
        return np.full(lead, scale_code(1.0), dtype=np.int64)
    ms = z2.flatten(-2).mean(-1)
    return np.array([scale_code(v) for v in ms.reshape(-1).tolist()], dtype=np.int64).reshape(lead)


def _clipped_square(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Each element's squared z-score against ``mean`` / ``std``, clipped at 25 (5 sigma; NaN and inf count 25)."""
    z = (x.to(torch.float32) - mean) / std.clamp_min(1e-30)
    return torch.nan_to_num(z.square(), nan=25.0, posinf=25.0).clamp(max=25.0)


def scale_code(ms: float) -> int:
    """The scale code of a stream whose clipped mean squared z-score is ``ms``: ``round(2 log2 ms)``, clipped."""
    if ms <= 0.0:
        return SCALE_MIN
    return int(min(SCALE_MAX, max(SCALE_MIN, round(2.0 * math.log2(ms)))))


@contextlib.contextmanager
def one_thread():
    """Predictor maths on one thread: its matrices are small (intra-op threads only add synchronisation,
    badly so on a busy machine: 30x measured here), and the means then do not depend on the caller's thread
    setting, so encoder and decoder agree whatever ``torch.set_num_threads`` says."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every broadcast (stride-0) dimension cut to size 1: per-channel statistics stay
    ``[D, 1]`` instead of ``[D, T]``, so the coder reads (and fingerprints) D values, not D x T."""
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                  for stride, size in zip(t.stride(), t.shape))
    return t[index]


def settle_stream(mean: torch.Tensor, std: torch.Tensor, factors: list[float],
                  bounds: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype,
                  config: CodecConfig) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """The float32 statistics a `portable` session's stream is coded with: canonical values
    (`codec.params.settle`) that every CPU computes alike. ``mean`` / ``std``: float64 ``[batch, tokens, dim]``
    (std broadcastable to it); the std is scaled by its row's ``factors`` first (`scale_factor`: the coded std's
    class is what must agree). Also, per batch row, the elements within ``bounds`` of a class boundary, as int32
    ``[n, 3]``: element index in the row's statistics, canonical mean and std bits, which the encoder sends and
    `resettle_stream` puts back (``bounds=None``: the decoder's call, nothing is listed)."""
    batch = mean.shape[0]
    scale = np.asarray(factors, dtype=np.float64).reshape(batch, *([1] * (mean.dim() - 1)))
    std64 = np.broadcast_to(std.numpy(), mean.shape) * scale
    tol = (None, None) if bounds is None else (bounds[0].numpy(), bounds[1].numpy() * scale)
    m, s, idx = settle(mean.numpy(), std64, tol[0], tol[1], format_of(dtype), config.mean_steps)
    per_row = m.size // batch
    flat_m, flat_s = m.reshape(-1).view(np.int32), s.reshape(-1).view(np.int32)
    listed = []
    for b in range(batch):
        at = idx[(idx >= b * per_row) & (idx < (b + 1) * per_row)]
        listed.append(np.stack([at - b * per_row, flat_m[at], flat_s[at]], axis=1).astype(np.int32))
    return torch.from_numpy(m), torch.from_numpy(s), listed


def resettle_stream(mean: torch.Tensor, std: torch.Tensor, factors: list[float], listed: list[np.ndarray],
                    dtype: torch.dtype, config: CodecConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's `settle_stream`: canonical statistics with the encoder's ``listed`` elements (per row,
    int32 ``[n, 3]``, element indices checked by the caller) put back."""
    mean, std, _ = settle_stream(mean, std, factors, None, dtype, config)
    rows_m = mean.numpy().reshape(mean.shape[0], -1).view(np.int32)
    rows_s = std.numpy().reshape(std.shape[0], -1).view(np.int32)
    for b, entries in enumerate(listed):
        if entries.shape[0]:
            rows_m[b, entries[:, 0]] = entries[:, 1]
            rows_s[b, entries[:, 0]] = entries[:, 2]
    return mean, std


def listed_problem(order: np.ndarray, limit: int) -> str | None:
    """What is wrong with a list's element keys ``order`` (int64, in the list's order; a file's (stream, element)
    pairs as ``stream * elements + element``), or None: each in ``[0, limit)``, strictly increasing."""
    if not order.size:
        return None
    if int(order.min()) < 0 or int(order.max()) >= limit:
        return "out of range"
    if not bool((order[1:] > order[:-1]).all()):
        return "out of order or repeated"
    return None


def expected_side(predictor: Predictor, layer: int, heads: int, tokens: int, dim: int,
                  dtype: torch.dtype, value_dim: int | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The side data ``predictor`` sends with one row of a ``heads x tokens x dim`` block of ``layer`` (values
    ``value_dim`` wide, default ``dim``): name -> (dtype, shape of the row's tensor), from a zero probe. A reader
    checks what a file or payload holds against it before any predictor reads it (a missing or misshapen tensor
    would fail inside the predictor instead, with an error of the predictor's)."""
    probe = torch.zeros(1, heads, tokens, dim, dtype=dtype)
    values = probe if value_dim is None or value_dim == dim else torch.zeros(1, heads, tokens, value_dim, dtype=dtype)
    return {name: (t.dtype, tuple(t.shape[1:])) for name, t in predictor.side_data(layer, probe, values).items()}


# ---------------------------------------------------------------------------------------------------- blocks


@dataclass
class CodedStreams:
    """One block's coded streams, per batch row in `stream_order`: ``codes[row][stream]`` the std scale code
    (`choose_scale`), ``blobs[row][stream]`` the codec stream and, for a `portable` session, ``listed[row][stream]``
    the elements `settle_stream` lists, int32 ``[n, 3]`` (element, mean bits, std bits; empty for most streams,
    and always for a stream whose statistics are exact float32). ``listed`` is None for other sessions."""

    codes: list[Sequence[int]]
    blobs: list[list[bytes]]
    listed: list[list[np.ndarray]] | None = None


@dataclass
class EncodeItem:
    """A block to code: its session, keys ``[rows, heads, tokens, dim]`` and values ``[rows, heads, tokens,
    value_dim]`` on the host, and its layer's codec setting."""

    session: PredictorSession
    keys: torch.Tensor
    values: torch.Tensor
    config: CodecConfig


@dataclass
class DecodeItem:
    """A block to decode: its session, its `CodedStreams`, its shape (keys ``[rows, heads, tokens, dim]``, values
    ``value_dim`` wide, ``dtype``), its layer's codec setting, and whether to check the streams' hashes (False
    only for streams this process decoded with the check before: `codec.decode_batch`'s ``verify``)."""

    session: PredictorSession
    streams: CodedStreams
    heads: int
    tokens: int
    dim: int
    value_dim: int
    dtype: torch.dtype
    config: CodecConfig
    verify: bool = True


@dataclass
class _Stream:
    """One stream of a call: its place (item, stream index in `stream_order`, kind, head, batch row), what the
    codec takes (``data``: the values ``[width, tokens]`` to encode, or the blob to decode, ``shape`` and ``dtype``
    of the values) and its statistics channel-major (the mean as predicted, the std compact and scaled)."""

    item: int
    stream: int
    kind: str
    head: int
    row: int
    data: torch.Tensor | bytes
    shape: tuple[int, int]
    dtype: torch.dtype
    mean: torch.Tensor
    std: torch.Tensor
    config: CodecConfig
    verify: bool = True


_NOTHING = np.zeros((0, 3), np.int32)  # an empty list of settled elements


def encode_blocks(items: list[EncodeItem], threads: int = 1) -> list[CodedStreams]:
    """The streams of each block of ``items`` (see module docstring); ``threads``: codec threads per call (the
    bytes do not depend on it)."""
    out, pending = [], []
    phased = []  # blocks whose sessions go a kind at a time: coded together after the others, kind by kind
    for i, item in enumerate(items):
        rows, heads = item.keys.shape[:2]
        streams = 2 * heads
        coded = CodedStreams([array("b", bytes(streams)) for _ in range(rows)], [[b""] * streams for _ in range(rows)],
                             [[_NOTHING] * streams for _ in range(rows)] if item.session.portable else None)
        out.append(coded)
        if item.session.kind_independent and not item.session.independent:
            phased.append(i)
            continue
        for index, (kind, head) in enumerate(stream_order(heads)):
            x = (item.keys if kind == "k" else item.values)[:, head]
            found = _scaled(item, coded, i, index, kind, head, x)
            if item.session.independent:  # coded with every other independent stream of the call, below
                pending += found
            else:
                _encode(out, found, threads)
                item.session.observe(kind, head, x)
    _encode(out, pending, threads)
    # exact dense statistics a kind at a time: scaled and coded from stacked tensors (`_encode_kind`)
    stacked = [i for i in phased if items[i].session.stacks_kind and not items[i].session.portable]
    for kind in KINDS:  # one codec call per kind for all phased blocks (per shape of statistics)
        _encode_kind(out, items, stacked, kind, threads)
        for i in stacked:
            items[i].session.observe_kind(kind, items[i].keys if kind == "k" else items[i].values)
        found = []
        for i in phased:
            if i in stacked:
                continue
            item, heads = items[i], items[i].keys.shape[1]
            for index, (k, head) in enumerate(stream_order(heads)):
                if k == kind:
                    found += _scaled(item, out[i], i, index, kind, head, (item.keys if kind == "k" else item.values)[:, head])
        _encode(out, found, threads)
        for i in phased:
            if i in stacked:
                continue
            item = items[i]
            for head in range(item.keys.shape[1]):
                item.session.observe(kind, head, (item.keys if kind == "k" else item.values)[:, head])
    return out


def _encode_kind(out: list[CodedStreams], items: list[EncodeItem], members: list[int], kind: str,
                 threads: int) -> None:
    """The streams of ``kind`` of the `PredictorSession.stacks_kind` blocks ``members`` (not `portable`): the bytes
    and scale codes `_scaled` and `_encode` give them stream by stream (the same statistics, `choose_scales`' codes
    and float32 factors), from each block's `PredictorSession.predict_kind` stacked: one codec call per codec
    setting and shape, the statistics as `_decode_kind` gives them to the decoder."""
    groups: dict[tuple, list[int]] = {}
    for i in members:
        x = items[i].keys if kind == "k" else items[i].values
        groups.setdefault((id(items[i].config), *x.shape[2:], x.dtype), []).append(i)
    for (_, tokens, width, _), group in groups.items():
        xs, means, stds = [], [], []
        for i in group:
            item = items[i]
            x = (item.keys if kind == "k" else item.values).transpose(0, 1)  # [heads, rows, tokens, width]
            heads, rows = x.shape[:2]
            first = 0 if kind == "k" else heads  # the kind's first stream in `stream_order`
            mean, std = item.session.predict_kind(kind, heads)  # [heads, rows, tokens, width]
            codes = choose_scales(x, mean, std)  # [heads, rows]
            for b in range(rows):
                out[i].codes[b][first : first + heads] = array("b", codes[:, b].tolist())
            std = std * scale_factors(codes)[..., None, None]
            xs.append(x.transpose(-1, -2).reshape(heads * rows, width, tokens))
            means.append(mean.transpose(-1, -2).reshape(heads * rows, width, tokens))
            stds.append(std.transpose(-1, -2).reshape(heads * rows, width, tokens))
        blobs = encode_streams(torch.cat(xs), torch.cat(means), torch.cat(stds), items[group[0]].config,
                               threads=threads)
        at = 0
        for i in group:
            heads, rows = items[i].keys.shape[1], len(out[i].blobs)
            first = 0 if kind == "k" else heads
            for h in range(heads):
                for b in range(rows):
                    out[i].blobs[b][first + h] = blobs[at + h * rows + b]
            at += heads * rows


def encode_stacked(keys: torch.Tensor, values: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                   config: CodecConfig, threads: int = 1) -> list[CodedStreams]:
    """`encode_blocks` of same-shaped blocks whose statistics were predicted together (`Predictor.predict_blocks`:
    sessions that are `independent`, not `portable`, keys and values of one width), the inverse of
    `decode_stacked`: ``keys`` / ``values`` ``[blocks, rows, heads, tokens, width]``, ``mean`` / ``std`` ``[blocks,
    2 * heads, rows, 1 or tokens, width]`` in `stream_order` (std unscaled). Every stream is scaled at once
    (`choose_scales`) and all of them go to one codec call: the bytes `encode_blocks` gives each block through its
    session, without Python per stream."""
    count, rows, heads, tokens, width = keys.shape
    # [blocks, streams, rows, tokens, width]: each stream's elements contiguous, as `encode_blocks` reads them
    x = torch.stack([keys, values], 1).transpose(2, 3).reshape(count, 2 * heads, rows, tokens, width)
    codes = choose_scales(x, mean, std)
    lead = (count, 2 * heads, rows)
    # channel-major statistics compacted per stream (`_scaled`'s ``compact``), the std scaled by its float32 factor
    blobs = encode_streams(x.view(-1, tokens, width).transpose(1, 2), _per_stream(mean.transpose(-1, -2), lead),
                           _per_stream(std.transpose(-1, -2), lead) * scale_factors(codes).view(-1, 1, 1), config,
                           threads=threads)
    out = []
    for i in range(count):
        block = codes[i].T  # [rows, streams]
        at = i * 2 * heads * rows
        out.append(CodedStreams([array("b", block[b].tolist()) for b in range(rows)],
                                [blobs[at + b : at + 2 * heads * rows : rows] for b in range(rows)]))
    return out


def _per_stream(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """Statistics ``[*lead, width, 1 or tokens]`` (leading dims broadcastable to ``lead``) as one ``[streams,
    ...]`` tensor, each stream's two trailing dims `compact` as `_scaled` makes them (a broadcast dim cut to 1)."""
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                  for stride, size in zip(t.stride()[-2:], t.shape[-2:]))
    t = t[(..., *index)]
    return t.expand(*lead, *t.shape[-2:]).reshape(-1, *t.shape[-2:])


def decode_blocks(items: list[DecodeItem], threads: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of `encode_blocks`: each block's keys and values on the host. Raises the codec's
    `CorruptStreamError` (its `ParameterMismatchError` when a session did not reproduce the encoder's statistics)
    for a stream that does not decode to the declared shape exactly."""
    out, pending = [], []
    phased = []  # as in `encode_blocks`
    for i, item in enumerate(items):
        rows = len(item.streams.blobs)
        keys = torch.empty((rows, item.heads, item.tokens, item.dim), dtype=item.dtype)
        values = torch.empty((rows, item.heads, item.tokens, item.value_dim), dtype=item.dtype)
        out.append((keys, values))
        if item.session.kind_independent and not item.session.independent:
            phased.append(i)
            continue
        # an independent session's streams predicted in one call (`PredictorSession.predict_all`, equal to its
        # `predict` of each; the portable ones settle stream by stream, keys and values of two widths do not stack)
        together = item.session.independent and not item.session.portable and item.dim == item.value_dim
        stats = item.session.predict_all(item.heads) if together else None
        for index, (kind, head) in enumerate(stream_order(item.heads)):
            found = _expected(item, i, index, kind, head, None if stats is None else (stats[0][index], stats[1][index]))
            if item.session.independent:
                pending += found
            else:
                _decode(out, found, threads)
                item.session.observe(kind, head, (keys if kind == "k" else values)[:, head])
    _decode(out, pending, threads)
    stacked = [i for i in phased if items[i].session.stacks_kind]
    for kind in KINDS:
        _decode(out, [s for i in phased if i not in stacked for index, (k, head) in enumerate(stream_order(items[i].heads))
                      if k == kind for s in _expected(items[i], i, index, kind, head)], threads)
        _decode_kind(out, items, stacked, kind, threads)
        for i in phased:
            if i in stacked:
                items[i].session.observe_kind(kind, out[i][0 if kind == "k" else 1])
            else:
                for head in range(items[i].heads):
                    items[i].session.observe(kind, head, out[i][0 if kind == "k" else 1][:, head])
    return out


def _decode_kind(out: list[tuple[torch.Tensor, torch.Tensor]], items: list[DecodeItem], members: list[int], kind: str,
                 threads: int) -> None:
    """The streams of ``kind`` of the `PredictorSession.stacks_kind` blocks ``members``, as `_expected` and `_decode`
    give them (the same statistics, stream order and calls: one per codec setting and shape), from each block's
    `PredictorSession.predict_kind` stacked, and written back a block at a time."""
    groups: dict[tuple, list[int]] = {}
    for i in members:
        item = items[i]
        groups.setdefault((id(item.config), item.tokens, item.dim if kind == "k" else item.value_dim, item.dtype),
                          []).append(i)
    for (_, tokens, width, dtype), group in groups.items():
        means, stds, blobs, verify = [], [], [], []
        for i in group:
            item, coded = items[i], items[i].streams
            rows, heads = len(coded.blobs), item.heads
            first = 0 if kind == "k" else heads  # the kind's first stream in `stream_order`
            mean, std = item.session.predict_kind(kind, heads)  # [heads, rows, tokens, width]
            codes = np.array([[coded.codes[b][first + h] for b in range(rows)] for h in range(heads)], dtype=np.int64)
            if item.session.portable and mean.dtype == torch.float64:
                mean, std = _resettled_kind(item, kind, first, mean, std, codes)
            else:
                if coded.listed is not None and any(coded.listed[b][first + h].shape[0]
                                                    for b in range(rows) for h in range(heads)):
                    raise CorruptStreamError(f"a stream of kind {kind} lists elements though its statistics are exact")
                std = std * scale_factors(codes)[..., None, None]
            means.append(mean.transpose(-1, -2).reshape(heads * rows, width, tokens))
            stds.append(std.transpose(-1, -2).reshape(heads * rows, width, tokens))
            blobs += [coded.blobs[b][first + h] for h in range(heads) for b in range(rows)]
            verify += [item.verify] * (heads * rows)
        x = decode_streams(blobs, torch.cat(means), torch.cat(stds), items[group[0]].config,
                           out=torch.empty((len(blobs), width, tokens), dtype=dtype), threads=threads, verify=verify)
        at = 0
        for i in group:
            rows, heads = len(items[i].streams.blobs), items[i].heads
            target = out[i][0 if kind == "k" else 1]  # [rows, heads, tokens, width]
            target.copy_(x[at : at + heads * rows].view(heads, rows, width, tokens).permute(1, 0, 3, 2))
            at += heads * rows


def _resettled_kind(item: DecodeItem, kind: str, first: int, mean: torch.Tensor, std: torch.Tensor,
                    codes: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """`_expected`'s settling of a `portable` session's float64 statistics ``[heads, rows, tokens, width]`` of every
    stream of ``kind`` at once (`resettle_stream` is element-wise but for the listed elements it puts back, stream by
    stream): float32, the std scaled, the same shape."""
    heads, rows = codes.shape
    coded = item.streams
    listed = [coded.listed[b][first + h] if coded.listed is not None else _NOTHING
              for h in range(heads) for b in range(rows)]
    for index, entries in enumerate(listed):
        problem = listed_problem(entries[:, 0].astype(np.int64), mean[0, 0].numel())
        if problem is not None:
            raise CorruptStreamError(f"the listed elements of stream {kind}{index // rows} are {problem}")
    factors = [scale_factor(int(code)) for code in codes.reshape(-1)]
    flat = mean.reshape(heads * rows, *mean.shape[2:]), std.reshape(heads * rows, *std.shape[2:])
    mean, std = resettle_stream(*flat, factors, listed, item.dtype, item.config)
    return mean.view(heads, rows, *mean.shape[1:]), std.view(heads, rows, *std.shape[1:])


def _scaled(item: EncodeItem, coded: CodedStreams, i: int, index: int, kind: str, head: int,
            x: torch.Tensor) -> list[_Stream]:
    """Stream ``index`` of block ``i`` predicted, scaled and settled (its codes and listed elements go to
    ``coded``): one `_Stream` per row."""
    session = item.session
    mean, std = session.predict(kind, head)
    factors = []
    for b in range(x.shape[0]):
        coded.codes[b][index] = choose_scale(x[b], mean[b], std[b])
        factors.append(scale_factor(coded.codes[b][index]))
    if session.portable and mean.dtype == torch.float64:  # coded as their canonical float32, std scaled
        mean, std, listed = settle_stream(mean, std, factors, session.bounds(kind, head), x.dtype, item.config)
        factors = [1.0] * len(factors)
        for b, entries in enumerate(listed):
            coded.listed[b][index] = entries
    width, tokens = x.shape[-1], x.shape[-2]
    # scaled before broadcasting, so per-channel statistics stay [head_dim, 1] for the coder
    return [_Stream(i, index, kind, head, b, x[b].T, (width, tokens), x.dtype, mean[b].T,
                    compact(std[b].T).mul(factors[b]), item.config) for b in range(x.shape[0])]


def _expected(item: DecodeItem, i: int, index: int, kind: str, head: int,
              predicted: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[_Stream]:
    """The decoder's `_scaled`: stream ``index`` of block ``i`` with the statistics it was coded with (its
    session's `predict`, or ``predicted``: mean and std ``[batch, tokens or 1, width]`` from `predict_all`)."""
    session, coded = item.session, item.streams
    rows = len(coded.blobs)
    mean, std = predicted if predicted is not None else session.predict(kind, head)
    factors = [scale_factor(coded.codes[b][index]) for b in range(rows)]
    listed = None if coded.listed is None else [coded.listed[b][index] for b in range(rows)]
    if session.portable and mean.dtype == torch.float64:
        listed = listed or [_NOTHING] * rows
        for b, entries in enumerate(listed):
            problem = listed_problem(entries[:, 0].astype(np.int64), mean[b].numel())
            if problem is not None:
                raise CorruptStreamError(f"the listed elements of stream {kind}{head} are {problem}")
        mean, std = resettle_stream(mean, std, factors, listed, item.dtype, item.config)
        factors = [1.0] * rows
    elif listed is not None and any(entries.shape[0] for entries in listed):
        raise CorruptStreamError(f"stream {kind}{head} lists elements though its statistics are exact")
    width = item.dim if kind == "k" else item.value_dim
    return [_Stream(i, index, kind, head, b, coded.blobs[b][index], (width, item.tokens), item.dtype, mean[b].T,
                    compact(std[b].T).mul(factors[b]), item.config, item.verify) for b in range(rows)]


def _groups(streams: list[_Stream]) -> list[list[_Stream]]:
    """``streams`` in groups that one codec call takes: one codec setting, one shape and dtype of values, one
    shape of mean and of std (per-channel ``[D, 1]``, per-element ``[D, T]``)."""
    groups: dict[tuple, list[_Stream]] = {}
    for s in streams:
        key = (id(s.config), s.shape, s.dtype, tuple(compact(s.mean).shape), tuple(s.std.shape))
        groups.setdefault(key, []).append(s)
    return list(groups.values())


def _encode(out: list[CodedStreams], streams: list[_Stream], threads: int) -> None:
    for group in _groups(streams):
        blobs = encode_streams(torch.stack([s.data for s in group]), _stacked([s.mean for s in group]),
                               _stacked([s.std for s in group]), group[0].config, threads=threads)
        for s, blob in zip(group, blobs):
            out[s.item].blobs[s.row][s.stream] = blob


def _decode(out: list[tuple[torch.Tensor, torch.Tensor]], streams: list[_Stream], threads: int) -> None:
    for group in _groups(streams):
        first = group[0]
        # (every stream's dtype and shape checked against `out`)
        xs = decode_streams([s.data for s in group], _stacked([s.mean for s in group]), _stacked([s.std for s in group]),
                            first.config, out=torch.empty((len(group), *first.shape), dtype=first.dtype), threads=threads,
                            verify=[s.verify for s in group])
        for s, x in zip(group, xs):
            keys, values = out[s.item]
            (keys if s.kind == "k" else values)[s.row, s.head] = x.T


def decode_stacked(blobs: list[bytes], means, stds, config: CodecConfig, *, shape: tuple[int, int],
                   dtype: torch.dtype, device: torch.device, threads: int, verify: list[bool]) -> torch.Tensor:
    """The streams of blocks whose statistics were predicted together (a cache's read of a layer), in one codec
    call per shape of statistics: ``blobs`` block by block, each block's in one order; ``means`` / ``stds``
    each block's statistics of them, ``[..., width, 1 or tokens]`` in that order (a list, or one tensor ``[blocks,
    ...]`` predicted in one call), the std scaled; ``verify`` per block. Gives ``[blocks, streams of a block,
    *shape]`` on ``device``, where the codec decodes them (`codec.decode_batch`: a CUDA device with Triton)."""
    blocks = len(verify)
    per_block = len(blobs) // blocks
    shapes: dict[tuple, list[int]] = {}
    for i, (m, s) in enumerate(zip(means, stds)):
        shapes.setdefault((tuple(m.shape), tuple(s.shape)), []).append(i)
    parts: list[torch.Tensor | None] = [None] * blocks
    for members in shapes.values():
        if len(members) == blocks and isinstance(means, torch.Tensor):  # predicted as one batch
            mean, std = means.flatten(0, -3), stds.flatten(0, -3)
        else:
            mean = torch.stack([means[i] for i in members]).flatten(0, -3)
            std = torch.stack([stds[i] for i in members]).flatten(0, -3)
        group = [blobs[i * per_block + j] for i in members for j in range(per_block)]
        x = decode_streams(group, mean, std, config, out=torch.empty((len(group), *shape), dtype=dtype, device=device),
                           threads=threads, verify=[verify[i] for i in members for _ in range(per_block)])
        x = x.view(len(members), per_block, *shape)
        for j, i in enumerate(members):
            parts[i] = x[j]
    # one group (the usual case) decoded into one tensor already in block order: no stacking copy
    return x if len(shapes) == 1 else torch.stack(parts)


def _stacked(stats: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([compact(t) for t in stats])
